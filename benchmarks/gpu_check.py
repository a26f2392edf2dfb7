"""One short run on one GPU that checks the CUDA paths no CPU test can (issue 18), and prints one table.

Checks (each in its own subprocess, so a CUDA context never leaks into a fork):

* ``rewrap``: 2 processes on the one GPU (gloo: NCCL refuses two ranks on one device) train a model whose
  branch rank 1 skips every other step from step 10, so SoloDDP's ``find_unused_parameters="auto"`` re-wraps
  DDP twice (to the fast path after its window, to ``True`` after the first skip), each time while the
  previous optimizer step may still run on the GPU; the replicas' parameters must be bit-identical.
* ``syncbn``: SoloSyncBatchNorm, 2 processes on the GPU, rank 0's batch empty, bf16 autocast: output, input
  gradient and running statistics vs BatchNorm over the joined batch; no host sync; identical collectives.
* ``rng``: ``resume.rng_state()`` / ``resume.set_rng_state()`` bring the current device's CUDA generator back.
* ``fork``: after CUDA is initialised, ``SoloDDP(start_method="fork")`` must refuse with a clear error, not
  let every worker die with "Cannot re-initialize CUDA in forked subprocess".
* ``precision``: ``bench_precision.py`` at 224² × 128, channels_last: strict fp32, TF32, bf16-mixed, 16-mixed.
* ``fsdp``: ``SoloFSDP`` on the one GPU (nccl, a one-rank mesh): ``precision="auto"`` must pick bf16 parameters
  with fp32 reduction, the sharded checkpoint must verify and consolidate into a plain model (weights_only).

Usage::

    python benchmarks/gpu_check.py --out benchmarks/gpu_check.md      # about 3 minutes on an H200
    python benchmarks/gpu_check.py --device cpu --only rewrap,syncbn,rng   # the logic, on CPU

Without CUDA (and no ``--device cpu``) it prints why and exits 0, having checked nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ("rewrap", "syncbn", "rng", "fork", "precision", "fsdp")
RESULT = "RESULT "


# ------------------------------------------------------------------ checks (each runs in a child process)


def _rewrap_rank(device: str, rank: int, port: int, out: str) -> None:
    """One of two ranks, started as an external process (the way torchrun/SLURM start them)."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_solo import SoloDDP

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
        RANK=str(rank),
        NODE_RANK=str(rank),
        LOCAL_RANK="0",
    )

    class Branchy(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.trunk, self.branch, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)

        def training_step(self, batch, batch_idx):
            x, y = batch
            h = torch.relu(self.trunk(x))
            # All used in the evidence window (re-wrap to the fast path at step 4), then rank 1 skips the
            # branch every other step from step 10 (completed exactly, re-wrap to True at the next step).
            if not (self.global_rank == 1 and batch_idx >= 10 and batch_idx % 2):
                h = h + self.branch(h)
            return nn.functional.mse_loss(self.head(h), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(512, 16, generator=g), torch.randn(512, 4, generator=g))
    model = Branchy()
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        num_nodes=2,
        max_steps=40,
        strategy=SoloDDP(start_method="popen", process_group_backend="gloo"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=8))
    flat = torch.cat([p.detach().flatten().cpu() for p in model.parameters()])
    decision = trainer.strategy.decisions["find_unused_parameters"]
    torch.save(
        {"params": flat, "find_unused": decision.value, "reason": decision.reason}, f"{out}/rank{rank}.pt"
    )


def check_rewrap(device: str) -> tuple[bool, str]:
    import tempfile

    import torch

    from lightning_solo.testing import free_port

    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--check",
                    "rewrap-rank",
                    "--device",
                    device,
                    "--rank",
                    str(r),
                    "--port",
                    str(port),
                    "--tmp",
                    out,
                ],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in (0, 1)
        ]
        logs = [p.communicate(timeout=240)[0] for p in procs]
        if any(p.returncode for p in procs):
            return False, "a rank failed: " + " | ".join(log[-600:] for log in logs)
        r0, r1 = (torch.load(f"{out}/rank{r}.pt", weights_only=True) for r in (0, 1))
    identical = torch.equal(r0["params"], r1["params"])
    rewrapped = all(r["find_unused"] is True and "switched" in r["reason"] for r in (r0, r1))
    diff = (r0["params"] - r1["params"]).abs().max().item()
    return identical and rewrapped, (
        f"find_unused_parameters={r0['find_unused']!r} ({r0['reason'][-90:]}); replicas bit-identical: "
        f"{identical} (max diff {diff:.3g})"
    )


def _syncbn_rank(rank: int, world_size: int, device: str) -> dict:
    import copy

    import torch
    from torch import nn

    from lightning_solo import syncbn
    from lightning_solo.testing import HostSyncRecorder

    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks on the one GPU
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Conv2d(16, 4, 1)).to(device)
    net.to(memory_format=torch.channels_last)
    mine = syncbn.convert(copy.deepcopy(net))
    x = torch.randn(8, 3, 16, 16, device=device) + 3.0
    local = x[: 0 if rank == 0 else 8].clone().requires_grad_()
    recorder = HostSyncRecorder()
    with torch.autocast(device, dtype=torch.bfloat16), recorder:
        y = mine(local)
        y.float().square().sum().backward()
    ref_x = x.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        ref_y = net(ref_x)
        ref_y.float().square().sum().backward()

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()

    out = {
        "syncs": recorder.syncs,
        "allreduces": recorder.allreduces,
        "dtype": str(y.dtype),
        "running_var": rel(mine[1].running_var, net[1].running_var),
    }
    if rank == 1:
        out.update(y=rel(y.detach(), ref_y.detach()), grad_x=rel(local.grad, ref_x.grad))
    return out


def check_syncbn(device: str) -> tuple[bool, str]:
    from lightning_solo.testing import run_ranks

    empty, full = run_ranks(_syncbn_rank, 2, device)
    ok = (
        empty["syncs"] == full["syncs"] == []
        and empty["allreduces"] == full["allreduces"]
        and full["dtype"] == "torch.bfloat16"
        and max(empty["running_var"], full["running_var"]) <= 1e-4
        and full["y"] <= 2e-2
        and full["grad_x"] <= 3e-2
    )
    return ok, (
        f"rel. err y {full['y']:.2g}, grad_x {full['grad_x']:.2g}, running_var {full['running_var']:.2g}; "
        f"host syncs {len(empty['syncs']) + len(full['syncs'])}; all-reduces {full['allreduces']} on both ranks"
    )


def check_rng(device: str) -> tuple[bool, str]:
    import torch

    from lightning_solo import resume

    if device == "cuda":
        torch.cuda.set_device(0)
        torch.randn(1, device="cuda")  # CUDA initialised: its generator is part of the state
    state = resume.rng_state()
    first = torch.randn(4, device=device), torch.randn(4)
    resume.set_rng_state(state)
    again = torch.randn(4, device=device), torch.randn(4)
    same = all(torch.equal(a, b) for a, b in zip(first, again))
    cuda = state.get("cuda")
    held = f"{len(cuda)} CUDA generator state(s)" if isinstance(cuda, (list, tuple)) else type(cuda).__name__
    return same, f"draws after restore identical: {same}; saved: {held}"


def _fork_child() -> None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_solo import SoloDDP

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.zeros(1, device="cuda")  # what a notebook cell does before fit
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SoloDDP(start_method="fork"),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    try:
        trainer.fit(Tiny(), DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2))
    except Exception as err:  # noqa: BLE001 - what the user would see
        print(f"REFUSED {type(err).__name__}: {err}", flush=True)
        return
    print("NOT REFUSED", flush=True)


def check_fork(device: str) -> tuple[bool, str]:
    if device != "cuda":
        return True, "skipped: needs CUDA"
    proc = subprocess.run(
        [sys.executable, __file__, "--check", "fork-child"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    out = proc.stdout + proc.stderr
    refused = next((line for line in proc.stdout.splitlines() if line.startswith("REFUSED")), None)
    ok = refused is not None and "CUDA" in refused and "Cannot re-initialize" not in out
    return ok, (refused or f"no clear refusal; output tail: {out[-400:]}")[:300]


def check_precision(device: str) -> tuple[bool, str]:
    size = ["--image-size", "224", "--batch-size", "128", "--warmup", "5", "--steps", "20", "--channels-last"]
    if device != "cuda":
        size = ["--image-size", "32", "--batch-size", "16", "--warmup", "1", "--steps", "2"]
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_precision.py"),
            "--device",
            device,
            "--rounds",
            "1",
            *size,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    table = [line for line in proc.stdout.splitlines() if line.startswith("|") or line.startswith("ResNet")]
    return proc.returncode == 0 and len(table) > 3, "\n".join(table) if table else proc.stderr[-600:]


def check_fsdp(device: str) -> tuple[bool, str]:
    import tempfile

    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_solo.consolidate import consolidate
    from lightning_solo.strategy import SoloFSDP

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
            self.dtype_seen = None

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x)
            self.dtype_seen = str(out.dtype)
            return torch.nn.functional.cross_entropy(out.float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    out = Path(tempfile.mkdtemp())
    data = TensorDataset(torch.randn(256, 64), torch.randint(0, 4, (256,)))
    accelerator = "gpu" if device == "cuda" else "cpu"
    trainer = L.Trainer(
        accelerator=accelerator, devices=1, strategy=SoloFSDP(min_num_params=1000), max_steps=4,
        default_root_dir=out, logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    model = Net()
    trainer.fit(model, DataLoader(data, batch_size=32))
    precision = trainer.strategy.decisions["fsdp_precision"].value
    manifest = consolidate(trainer.checkpoint_callback.best_model_path, out / "full.ckpt")
    plain = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    state = torch.load(out / "full.ckpt", weights_only=True)["state_dict"]
    plain.load_state_dict({k.removeprefix("net."): v for k, v in state.items()})
    want = "bf16-mixed" if device == "cuda" and torch.cuda.is_bf16_supported() else "32-true"
    ok = precision == want and manifest["global_step"] == 4
    return (
        ok,
        f"precision {precision} (compute {model.dtype_seen}); consolidated step {manifest['global_step']}",
    )


# ------------------------------------------------------------------ driver


def run_check(name: str, device: str) -> dict:
    """Run one check in a fresh interpreter; returns {check, ok, detail, seconds}."""
    start = time.monotonic()
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--check", name, "--device", device],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=480,
            env=env,
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith(RESULT)), None)
        result = json.loads(line[len(RESULT) :]) if line else {"ok": False, "detail": proc.stderr[-800:]}
    except subprocess.TimeoutExpired:
        result = {"ok": False, "detail": "timed out after 480 s"}
    return {"check": name, **result, "seconds": round(time.monotonic() - start, 1)}


def render(rows: list[dict], device: str) -> str:
    lines = [f"GPU check ({device})", "", "| check | result | seconds | detail |", "|---|---|---|---|"]
    tables = []
    for row in rows:
        detail = row["detail"]
        if "\n" in detail:  # the precision benchmark's own table goes below
            tables.append(detail)
            detail = "table below"
        result = "PASS" if row["ok"] else "FAIL"
        lines.append(f"| {row['check']} | {result} | {row['seconds']} | {detail.replace('|', '/')} |")
    return "\n".join(lines + [""] + tables) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="also write the markdown table here")
    p.add_argument("--only", default=",".join(CHECKS), help=f"comma list of {CHECKS}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the logic without a GPU")
    p.add_argument("--check", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.check == "rewrap-rank":
        _rewrap_rank(args.device, args.rank, args.port, args.tmp)
        return 0
    if args.check == "fork-child":
        _fork_child()
        return 0
    if args.check:
        ok, detail = globals()[f"check_{args.check}"](args.device)
        print(RESULT + json.dumps({"ok": bool(ok), "detail": detail}), flush=True)
        return 0

    names = args.only.split(",")
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        p.error(f"unknown check(s) {unknown}; accepted: {CHECKS}")
    import torch  # is_available() does not initialise CUDA: the children may still fork

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: SKIPPED, CUDA is not available on this machine (nothing was checked). Run it where a "
            "GPU is, or pass --device cpu to exercise the logic on CPU."
        )
        return 0
    rows = []
    for name in names:
        rows.append(run_check(name, args.device))
        print(f"{name}: {'PASS' if rows[-1]['ok'] else 'FAIL'} ({rows[-1]['seconds']} s)", flush=True)
    table = render(rows, args.device)
    print("\n" + table)
    if args.out:
        args.out.write_text(table)
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
