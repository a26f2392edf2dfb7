"""Lightning's own example scripts, downsized, under stock ``DDPStrategy()`` and under ``SoloDDP()``.

Usage::

    python scripts/lightning_examples.py LIGHTNING_SRC [--only NAME ...] [--out docs/lightning-examples.md]

``LIGHTNING_SRC`` is a checkout of Lightning's source tree (holding ``examples/pytorch``), ideally the release of
the installed ``lightning``. Nothing of the examples is copied into this repository: each is run from the checkout,
as ``python <example> <args>``, twice (arms ``stock`` and ``solo``), each arm in its own working folder.
``scripts/lightning_examples_site/sitecustomize.py`` (put on the child's ``PYTHONPATH``) makes both arms offline,
seeded and comparable: synthetic data where the example would download, a 2-process CPU ``Trainer`` with the
arm's strategy and the downsizing of :data:`EXAMPLES`, and, after the last ``fit``, each rank's ``state_dict`` and
``callback_metrics`` saved for the comparison.

An example agrees when both arms exit 0 with the same final weights (``torch.equal``, tensor by tensor) and the
same logged metrics, or fail with the same last error line, or stock fails (SoloDDP may run more). Per example
(:data:`EXAMPLES`): where plain ``DDPStrategy()`` fails, a ``fallback`` stock arm with the kwargs its error asks for
gives the weights to compare with; where a SoloDDP Decision changes the numbers, a ``solo_off`` arm with its off
switches must give stock's weights (SoloDDP's defaults must still run). Rank
1's weights are compared with rank 0's in each arm. Progress is printed one line per arm; the markdown report goes
to stdout and ``--out``. Exit status 1 when an example disagrees. :data:`SKIPPED` lists the examples
not run and why. Cost on 2 shared CPU cores: 8-26 s an arm, about 7 minutes in all.

Dependencies beyond this project's: the ``LightningCLI`` examples need ``jsonargparse[signatures]``
(``docstring-parser``, ``typeshed-client``) and the GAN logs images through TensorBoard (``tensorboardX``); without
them those examples fail the same way in both arms. They need not be installed in the environment: e.g.
``pip install --target /tmp/ex-deps --no-deps docstring-parser typeshed-client tensorboardX protobuf`` and
``PYTHONPATH=/tmp/ex-deps:.``, which the runs inherit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
SITE = SCRIPTS / "lightning_examples_site"
# Each arm's Trainer gets these on top of what the example asks for (then the 2-process CPU strategy).
TRAINER = {"max_steps": 4, "limit_val_batches": 2, "limit_test_batches": 2, "limit_predict_batches": 2}


def _wikitext(cwd: Path) -> None:
    """``WikiText2`` reads ``./data/wikitext-2.txt`` when present: 150k words over a vocabulary of 100."""
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 100, (150_000,), generator=g).tolist()
    (cwd / "data").mkdir()
    lines = (" ".join(f"w{w}" for w in words[i : i + 15]) for i in range(0, len(words), 15))
    (cwd / "data" / "wikitext-2.txt").write_text("\n".join(lines) + "\n")


def _kitti(cwd: Path) -> None:
    """Five 64x32 image/mask pairs in KITTI's layout (four train, one valid after the example's 80/20 split)."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    for sub, mode, high in (("image_2", "RGB", 256), ("semantic", "L", 34)):
        (cwd / "kitti" / "training" / sub).mkdir(parents=True)
        for i in range(5):
            shape = (32, 64, 3) if mode == "RGB" else (32, 64)
            pixels = torch.randint(0, high, shape, generator=g, dtype=torch.uint8).numpy()
            Image.fromarray(pixels, mode=mode).save(cwd / "kitti" / "training" / sub / f"{i}.png")


@dataclass
class Example:
    path: str  # under examples/pytorch
    args: list[str] = field(default_factory=list)
    trainer: dict = field(default_factory=dict)  # on top of TRAINER
    prepare: object = None  # callable(cwd) writing input files
    note: str = ""
    # DDPStrategy kwargs of a second stock arm, run when plain DDPStrategy() fails, to compare SoloDDP's weights with
    fallback: dict = field(default_factory=dict)
    # SoloDDP kwargs that turn off a Decision changing the numbers: a third arm, compared with stock for equality
    solo_off: dict = field(default_factory=dict)


UNUSED = {"find_unused_parameters": True}  # what stock DDP's error message tells the user to set
# Random augmentations and BatchNorm: SoloDDP seeds each sample's RNG from (seed, epoch, index) (exact_resume) and
# syncs BatchNorm for per-device batches below 32 (docs/syncbn.md), so its defaults change the numbers.
UNUSED_NOTE = (
    "stock DDPStrategy() stops at the first backward (parameters without a gradient in a step); SoloDDP's"
    " find_unused_parameters='auto' runs it, with the weights of stock DDPStrategy(find_unused_parameters=True)"
)
AUGMENTED_BN_OFF = {"sync_batchnorm": False, "exact_resume": False}
EXAMPLES: dict[str, Example] = {
    "bug_report_model": Example("bug_report/bug_report_model.py"),
    "autoencoder": Example("basics/autoencoder.py", ["--data.batch_size=8", "--model.hidden_dim=16"]),
    "backbone_image_classifier": Example("basics/backbone_image_classifier.py", ["--data.batch_size=8"]),
    "transformer": Example("basics/transformer.py", prepare=_wikitext, note="synthetic text, vocabulary 100"),
    "profiler_example": Example(
        "basics/profiler_example.py",
        note="fails in both arms before training: its `trainer_defaults` hold a `PyTorchProfiler()` instance, which"
        " jsonargparse 4.45 refuses as the default of a subclass type",
    ),
    "generative_adversarial_net": Example(
        "domain_templates/generative_adversarial_net.py", ["--latent_dim=16"], fallback=UNUSED, note=UNUSED_NOTE
    ),
    "reinforce_learn_Qnet": Example(
        "domain_templates/reinforce_learn_Qnet.py",
        ["--warm_start_steps=32", "--replay_size=64", "--batch_size=4", "--episode_length=20"],
        note="gym stand-in; " + UNUSED_NOTE,
        fallback=UNUSED,
    ),
    "reinforce_learn_ppo": Example(
        "domain_templates/reinforce_learn_ppo.py",
        ["--steps_per_epoch=32", "--batch_size=8", "--max_episode_len=20"],
        note="gym stand-in; " + UNUSED_NOTE,
        fallback=UNUSED,
    ),
    "semantic_segmentation": Example(
        "domain_templates/semantic_segmentation.py",
        ["--data_path=kitti", "--batch_size=2", "--num_layers=3"],  # --features_start parses as float: unusable
        trainer={"max_steps": 2},
        prepare=_kitti,
        note="fails in both arms: its `configure_optimizers` reads `self.learning_rate`, which it never sets",
    ),
    "computer_vision_fine_tuning": Example(
        "domain_templates/computer_vision_fine_tuning.py",
        ["fit", "--data.dl_path=data", "--data.batch_size=4", "--finetuning.milestones=[1, 2]"],
        trainer={"max_steps": -1, "max_epochs": 3, "limit_train_batches": 1},
        note="synthetic ImageFolder, resnet50 random init; 3 one-batch epochs so both unfreezing milestones run",
        # SoloDDP re-wraps DDP at each unfreezing, so the unfrozen layers are synchronised; stock's never are
        solo_off={**AUGMENTED_BN_OFF, "rewrap_on_trainable_change": False},
    ),
    "imagenet": Example(
        "domain_templates/imagenet.py",
        ["fit", "--seed_everything=0", "--model.data_path=imagenet", "--model.batch_size=8", "--model.workers=0"],
        note="synthetic ImageFolder; a fixed seed (its CLI draws a random one)",
        solo_off=AUGMENTED_BN_OFF,
    ),
}  # fmt: skip
SKIPPED = {
    "fp8_distributed_transformer/train.py": "needs CUDA GPUs (FP8, torchao)",
    "tensor_parallel/train.py": "needs CUDA GPUs (ModelParallelStrategy, DTensor over NCCL)",
    "servable_module/production.py": "serves over HTTP (ServableModuleValidator); trains on one device",
}


def outcome(returncode: int | None, log: str) -> str:
    """``pass``, ``timeout``, or ``fail: <last error line of the log>``."""
    if returncode is None:
        return "timeout"
    if returncode == 0:
        return "pass"
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    lines = [line.split("]: ", 1)[1] if line.startswith("[rank") and "]: " in line else line for line in lines]
    errors = [line for line in lines if line.split(":")[0].endswith(("Error", "Exception", "Interrupt"))]
    return "fail: " + (errors[-1] if errors else f"exit {returncode}")


def compare_states(a: dict, b: dict, atol: float = 0.0) -> str:
    """``equal`` when both state dicts hold the same keys and equal tensors, ``close`` when no float differs by more
    than ``atol``, else what differs first."""
    if a.keys() != b.keys():
        return f"keys differ: {sorted(set(a) ^ set(b))[:3]}"
    worst = 0.0
    for key in a:
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{key}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        if torch.equal(x, y):
            continue
        if not x.is_floating_point():
            return f"{key}: max |diff| -"
        diff = (x.double() - y.double()).abs().max().item()
        if diff > atol:
            return f"{key}: max |diff| {diff:.3g}"
        worst = max(worst, diff)
    return "equal" if worst == 0 else f"close: max |diff| {worst:.3g} <= {atol:g}"


def compare_metrics(a: dict, b: dict, rtol: float = 0.0) -> str:
    """``equal`` when both hold the same metric names and values, ``close`` within ``rtol``, else the first that
    differs."""
    close = False
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x == y:
            continue
        if x is None or y is None or abs(x - y) > rtol * max(abs(x), abs(y)):
            return f"{key}: {x} vs {y}"
        close = True
    return f"close: rtol {rtol:g}" if close else "equal"


def verdict(stock: str, solo: str, weights: str, metrics: str) -> bool:
    """Whether SoloDDP keeps stock's result: equal weights and metrics where both pass (``stock`` being the fallback
    arm's outcome where there is one), the same failure where both fail, and any run where stock fails."""
    if solo == "pass" and weights != "-":
        return weights.startswith(("equal", "close")) and metrics.startswith(("equal", "close"))
    return stock == solo or stock != "pass"


def run_arm(src: Path, name: str, arm: str, workdir: Path, timeout: float) -> dict:
    """Run one arm: ``stock``, ``solo``, ``fallback`` (stock with ``fallback``) or ``solo_off`` (with ``solo_off``)."""
    ex = EXAMPLES[name]
    cwd = workdir / name / arm
    strategy_kwargs = {"fallback": ex.fallback, "solo_off": ex.solo_off}.get(arm, {})
    arm = "solo" if arm.startswith("solo") else "stock"
    cwd.mkdir(parents=True)
    if ex.prepare:
        ex.prepare(cwd)
    env = dict(os.environ, LIGHTNING_EXAMPLES_ARM=arm, LIGHTNING_EXAMPLES_OUT=str(cwd / "final.pt"))
    env["LIGHTNING_EXAMPLES_TRAINER"] = json.dumps({**TRAINER, **ex.trainer})
    env["LIGHTNING_EXAMPLES_STRATEGY"] = json.dumps(strategy_kwargs)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), str(REPO), os.environ.get("PYTHONPATH")]))
    cmd = [sys.executable, str(src / "examples" / "pytorch" / ex.path), *ex.args]
    start = time.monotonic()
    with open(cwd / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:  # the ranks the launcher started are in the same session
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - start
    text = (cwd / "log.txt").read_text(errors="replace")
    result = torch.load(cwd / "final.pt") if returncode == 0 and (cwd / "final.pt").exists() else None
    if result and (cwd / "final.pt.rank1").exists():  # do the ranks end with the same weights?
        result["ranks"] = compare_states(result["state_dict"], torch.load(cwd / "final.pt.rank1")["state_dict"])
    result_outcome = outcome(returncode, text)
    expected = ("SoloDDP" if arm == "solo" else "DDPStrategy", 2)
    if result and (result["strategy"], result["world_size"]) != expected:
        result_outcome = f"fail: ran with {result['strategy']} on {result['world_size']} processes"
    return {"outcome": result_outcome, "seconds": seconds, "result": result, "log": cwd / "log.txt"}


def cell(text: str, limit: int = 160) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _kwargs(kwargs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items())


def row(name: str, arms: dict) -> dict:
    """One report row. SoloDDP (with ``solo_off`` where set) is compared with the stock arm that passed (the
    fallback where plain DDPStrategy() failed); where ``solo_off`` is set, SoloDDP's defaults are compared too."""
    ref, solo = arms.get("fallback") or arms["stock"], arms.get("solo_off") or arms["solo"]

    def comparison(key: str, a: dict, b: dict) -> str:
        if a["result"] is None or b["result"] is None:
            return "-"
        return (compare_states if key == "state_dict" else compare_metrics)(a["result"][key], b["result"][key])

    weights, metrics = comparison("state_dict", ref, solo), comparison("metrics", ref, solo)
    agree = verdict(ref["outcome"], solo["outcome"], weights, metrics)
    agree = agree and not (ref["outcome"] == "pass" and arms["solo"]["outcome"] != "pass")
    stock_cell, solo_cell = arms["stock"]["outcome"], arms["solo"]["outcome"]
    if "fallback" in arms:
        stock_cell += f"; with {_kwargs(EXAMPLES[name].fallback)}: {arms['fallback']['outcome']}"
    if "solo_off" in arms:
        solo_cell += f"; with {_kwargs(EXAMPLES[name].solo_off)}: {arms['solo_off']['outcome']}"
        off = f"with {_kwargs(EXAMPLES[name].solo_off)}"
        weights = f"{off}: {weights}; defaults: {comparison('state_dict', ref, arms['solo'])}"
        metrics = f"{off}: {metrics}; defaults: {comparison('metrics', ref, arms['solo'])}"
    ranks = " / ".join(a["result"].get("ranks", "-") if a["result"] else "-" for a in (ref, arms["solo"]))
    return {
        "example": name,
        "ranks": ranks,
        "stock": stock_cell,
        "solo": solo_cell,
        "weights": weights,
        "metrics": metrics,
        "agree": agree,
        "seconds": " / ".join(f"{arm['seconds']:.0f}" for arm in arms.values()),
    }


def markdown(rows: list[dict], command: str, version: str) -> str:
    out = [
        "# Lightning's example scripts under stock DDPStrategy() and SoloDDP()",
        "",
        f"Command: `{command}` (lightning {version}, CPU, 2 processes, gloo). Written by `scripts/lightning_examples.py`;",
        "see its docstring for how the examples are downsized and kept offline, and for the optional dependencies",
        "(`jsonargparse[signatures]`, `tensorboardX`) this run had.",
        "",
        f"{sum(r['agree'] for r in rows)} of {len(rows)} examples agree.",
        "",
        "| example | stock | SoloDDP | final weights | final metrics | agree | rank 1 = rank 0 (stock / solo) | seconds"
        " (stock / solo / extra arm) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        agree = "yes" if r["agree"] else "**NO**"
        cells = [r["example"], r["stock"], r["solo"], r["weights"], r["metrics"], agree, r["ranks"]]
        out.append("| " + " | ".join(cell(c) for c in cells) + f" | {r['seconds']} |")
    ran = {r["example"] for r in rows}
    notes = [f"- {name}: {ex.note}" for name, ex in EXAMPLES.items() if ex.note and name in ran]
    if notes:
        out += ["", "Downsizing beyond a few steps and small batches:", "", *notes]
    out += ["", "Not run:", "", *(f"- `{path}`: {why}" for path, why in SKIPPED.items())]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("src", type=Path, help="Lightning checkout holding examples/pytorch")
    parser.add_argument("--only", nargs="+", choices=sorted(EXAMPLES), help="run these examples only")
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    parser.add_argument("--timeout", type=float, default=300, help="seconds an arm may run")
    parser.add_argument("--keep", type=Path, help="run in this (new) folder and keep the logs and final.pt files")
    args = parser.parse_args(argv)
    import lightning

    names = args.only or list(EXAMPLES)
    rows = []
    with contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory() as tmp:
        for name in names:
            ex, arms = EXAMPLES[name], {}
            for arm in ("stock", "solo", "fallback", "solo_off"):
                if arm == "fallback" and (arms["stock"]["outcome"] == "pass" or not ex.fallback):
                    continue
                if arm == "solo_off" and not ex.solo_off:
                    continue
                arms[arm] = run_arm(args.src, name, arm, Path(tmp), args.timeout)
                print(f"{name:28} {arm:8} {arms[arm]['outcome'][:90]:90} {arms[arm]['seconds']:4.0f} s", flush=True)
            rows.append(row(name, arms))
    command = " ".join(
        ["python scripts/lightning_examples.py LIGHTNING_SRC", *(["--only", *args.only] if args.only else [])]
    )
    report = markdown(rows, command, lightning.__version__)
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0 if all(r["agree"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
