"""The runner end to end, in subprocesses (Lightning's popen launcher re-runs the command per rank)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_solo.app.data import DigitsDataModule
from lightning_solo.app.models import SmallCNN
from tests.helpers import REPO, TINY_RUN, run_cli

pytestmark = [pytest.mark.cli, pytest.mark.multiproc]


@pytest.mark.timeout(240)
def test_resnet_4gpu_cpu_dry_run(tmp_path):
    proc = run_cli(
        ["+experiment=resnet_4gpu", "+dryrun=cpu", "hydra.run.dir=run", "trainer.enable_progress_bar=false"],
        cwd=tmp_path,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 4
    assert summary["global_step"] == 3
    assert summary["precision"] == "32-true"  # precision: auto, on CPU
    assert {f"train_ddp_process_{k}.log" for k in (1, 2, 3)} <= {p.name for p in (tmp_path / "run").iterdir()}


def _one_line_error(proc) -> str:
    """Bad input, as a user sees it: exit status 2 and one line on stderr, no traceback."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert lines[0].startswith("lightning_solo: error: ")
    return lines[0]


@pytest.mark.timeout(120)
def test_bad_input_fails_before_any_worker_starts(tmp_path):
    # The other bad-input cases (and HYDRA_FULL_ERROR=1) are checked in-process in test_configs.py; this is the CLI.
    proc = run_cli(["+model.optimizer.momentm=0.9", "hydra.run.dir=run"], cwd=tmp_path, timeout=100, full_error=False)
    line = _one_line_error(proc)
    assert "model.optimizer.momentm" in line and "Did you mean 'momentum'?" in line
    assert not list(tmp_path.rglob("train_ddp_process_*.log"))


@pytest.mark.timeout(60)
def test_a_bad_key_fails_before_torch_or_lightning_is_imported(tmp_path):
    cmd = [sys.executable, "-X", "importtime", "-m", "lightning_solo.run", "badkey=1", "hydra.run.dir=run"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=50)
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    assert proc.returncode != 0 and "badkey" in proc.stderr, proc.stderr[-2000:]
    assert "hydra" in imported and not imported & {"torch", "lightning"}


@pytest.mark.timeout(60)
def test_each_command_names_its_hydra_job_after_itself(tmp_path):  # the job's log file: run.log, evaluate.log
    for module, name in (("lightning_solo.run", "run"), ("lightning_solo.evaluate", "evaluate")):
        proc = run_cli(["--cfg", "hydra"], cwd=tmp_path, timeout=50, module=module)
        assert f"\n    name: {name}\n" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.timeout(60)
def test_under_a_command_the_api_is_imported_and_registered_at_first_use(tmp_path):
    # What Python does while it locates `python -m lightning_solo.run`: sys.argv[0] is "-m".
    code = (
        "import sys; sys.argv[:1] = ['-m']; sys.orig_argv = [sys.executable, '-m', 'lightning_solo.run']\n"
        "import lightning_solo; sys.argv[0] = 'run.py'; lazy = 'lightning' not in sys.modules\n"
        "from lightning_solo import SoloDDP\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "print(lazy, SoloDDP.__name__, 'solo_ddp' in StrategyRegistry, hasattr(lightning_solo, 'nothing'))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=50)
    assert proc.stdout.split() == ["True", "SoloDDP", "True", "False"], proc.stderr[-2000:]


@pytest.mark.timeout(120)
def test_multirun_with_relaunching_launcher_is_refused(tmp_path):
    proc = run_cli(["-m", "trainer.max_epochs=1,2", "hydra.sweep.dir=sweep"], cwd=tmp_path, timeout=100)
    assert proc.returncode != 0
    assert "multirun" in proc.stderr.lower() and "popen" in proc.stderr
    assert not list(tmp_path.rglob("train_ddp_process_*.log"))


@pytest.mark.timeout(180)
def test_trainer_trains_two_processes_with_solo_ddp(tmp_path):
    # strategy="solo_ddp", then strategy=SoloDDP(watchdog=<the fault tests' small thresholds>) in the same two
    # processes (popen launcher).
    env_cmd = [sys.executable, str(REPO / "tests" / "scripts" / "tiny_fit.py"), str(tmp_path)]
    proc = subprocess.run(env_cmd, cwd=tmp_path, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for mode in ("string", "instance"):
        name, world, steps, _ = (tmp_path / mode / "strategy.txt").read_text().split()
        assert (name, world, steps) == ("SoloDDP", "2", "8")  # 64 samples / 2 ranks / batch 8 × 2 epochs
        p0, p1 = torch.load(tmp_path / mode / "rank0.pt"), torch.load(tmp_path / mode / "rank1.pt")
        assert torch.equal(p0, p1), f"{mode}: DDP must keep the replicas identical"
    # The same seed and data: the string and the instance train the same model.
    assert torch.equal(torch.load(tmp_path / "string" / "rank0.pt"), torch.load(tmp_path / "instance" / "rank0.pt"))
    # A healthy run: the watchdog says nothing and dumps nothing, at its defaults and at small thresholds.
    assert "SoloDDP watchdog" not in proc.stdout + proc.stderr and not (tmp_path / "hang").exists()


@pytest.mark.timeout(120)
def test_ranks_that_compose_different_configs_are_stopped(tmp_path):
    # Every rank composes the config itself; one that resolves differently per process must not train.
    proc = run_cli(
        [
            *TINY_RUN,
            "hydra.run.dir=run",
            "+probe=${oc.env:LOCAL_RANK,0}",
        ],
        cwd=tmp_path,
        timeout=100,
    )
    assert proc.returncode != 0
    assert "rank(s) [1] composed a different configuration than rank 0" in proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def _readme_command(module: str, containing: str = "") -> list[str]:
    """The arguments of the first ``python -m <module>`` command in the README's code blocks with ``containing``."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.DOTALL)
    for line in "\n".join(blocks).splitlines():
        if f"python -m {module}" in line and containing in line:
            return shlex.split(line.split(f"python -m {module}", 1)[1].split("#", 1)[0])
    raise AssertionError(f"the README shows no `python -m {module}` command with {containing!r}")


def _default_run_end_to_end(tmp_path, args: list[str]) -> dict:
    # The default: small_cnn on the handwritten digits (real images, held-out split), 2 gloo processes, 10 epochs.
    started = time.perf_counter()
    proc = run_cli([*args, "trainer.enable_progress_bar=false"], cwd=tmp_path, timeout=280, module="lightning_solo.run")
    wall = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "lightning_solo run summary" in proc.stdout + proc.stderr
    runs = list((tmp_path / "outputs" / "train").iterdir())
    assert len(runs) == 1, f"expected one run directory (children share rank 0's), got {runs}"
    run = runs[0]
    assert len(list(tmp_path.rglob(".hydra"))) == 1
    assert (run / "train_ddp_process_1.log").exists(), "rank 1 must log into rank 0's run directory"
    summary = json.loads((run / "summary.json").read_text())
    print(
        f"default run: wall {wall:.1f} s, val/acc {summary['val_acc']:.4f}, "
        f"{summary['samples_per_second']:.1f} samples/s"
    )
    assert summary["world_size"] == 2 and summary["global_batch"] == 64
    doctor = json.loads((run / "doctor.json").read_text())  # TrainingDoctor is on by default
    assert Path(summary["doctor"]["json"]).resolve() == (run / "doctor.json").resolve()
    assert (run / "doctor.png").exists()
    assert doctor["final"]["verdict"]["bound"] == summary["doctor"]["bound"] and len(doctor["series"]["ranks"]) == 2
    assert summary["global_step"] == 230  # 1,437 training images / 64 per step, rounded up, × 10 epochs
    assert summary["val_acc"] >= 0.97  # 360 held-out digits; chance is 0.1
    ckpt = torch.load(summary["checkpoint_last"], map_location="cpu", weights_only=True)
    net = SmallCNN(num_classes=10, in_channels=1)
    state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items() if k.startswith("model.")}
    net.load_state_dict(state)
    dm = DigitsDataModule()
    dm.setup("fit")
    x, y = dm.val_set.tensors
    with torch.no_grad():
        accuracy = (net.eval()(x).argmax(1) == y).float().mean().item()
    assert abs(accuracy - summary["val_acc"]) < 0.003, "the checkpoint is the model the summary scored"
    return summary


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_readme_first_command_then_its_evaluate_commands(tmp_path):
    # The README's first command, the default run end to end, then its evaluate commands on that run, as written.
    first = _readme_command("lightning_solo.run")
    assert first == [], "the first command is the defaults"
    trained = _default_run_end_to_end(tmp_path, first)
    (run,) = (tmp_path / "outputs" / "train").iterdir()  # the default run directory, outputs/train/<run>

    evaluate = [a.replace("<run>", run.name) for a in _readme_command("lightning_solo.evaluate", "ckpt=auto")]
    assert evaluate == ["ckpt=auto", f"ckpt_dir=outputs/train/{run.name}"]
    proc = run_cli(evaluate, cwd=tmp_path, timeout=120, module="lightning_solo.evaluate")
    assert proc.returncode == 0, proc.stderr[-4000:]
    (evaluated,) = (tmp_path / "outputs" / "evaluate").iterdir()
    report = json.loads((evaluated / "evaluation.json").read_text())
    assert report["checkpoint"] == trained["checkpoint_last"]
    assert report["decisions"][1]["setting"] == "eval_config"  # small_cnn on digits, as the run trained
    assert report["decisions"][1]["value"]["from_run"] == ["model", "data"]
    # The same weights on the same 360 held-out digits: the accuracy the run reported.
    assert report["metrics"]["val/samples"] == 360
    assert report["metrics"]["val/acc"] == pytest.approx(trained["val_acc"], abs=1e-6)

    # The README's other form: a checkpoint inside the run directory, more processes, every stage.
    other = [a.replace("<run>", run.name) for a in _readme_command("lightning_solo.evaluate", "last.ckpt")]
    proc = run_cli([*other, "hydra.run.dir=eval3", "trainer.enable_progress_bar=false"], cwd=tmp_path,
                   timeout=150, module="lightning_solo.evaluate")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "eval3" / "evaluation.json").read_text())
    assert report["world_size"] == 3 and report["metrics"]["test/acc"] == pytest.approx(trained["val_acc"], abs=1e-6)
    assert len((tmp_path / "eval3" / "predictions_predict.csv").read_text().splitlines()) == 361

    # A checkpoint that does not fit the model: one line, exit status 2, before any worker starts.
    proc = run_cli([*evaluate, "model=resnet18", "hydra.run.dir=bad"], cwd=tmp_path, timeout=100,
                   module="lightning_solo.evaluate", full_error=False)  # fmt: skip
    line = _one_line_error(proc)
    assert "does not fit the model" in line and "model.fc.weight" in line and "chose model itself" in line
    assert not (tmp_path / "bad" / "evaluation.json").exists()
