"""Every option the README documents runs on top of the runner's default config (small_cnn on the digits, 2 gloo
processes, every default callback), one epoch cut to a few batches, ending in a checkpoint. Each run also checks
that its options are in force: the decisions in ``summary.json``, the hook state in the checkpoint, the profiler's
traces, the default callbacks' records.

Options that do not interact share a run: one comm hook per run (4 runs) carries a precision, a
``sync_batchnorm``, a ``find_unused_parameters``, an ``exact_eval``, ``profile=window``,
``auto_batch_size=memory``, ``logger=none`` or ``compile``. Elsewhere: ``parallelism=fsdp`` on CPU in
test_fsdp.py; ``comm_hook=auto`` (its trial, its checkpointed choice) and ``post_local_sgd`` (its averaging, its
replicas in checkpoints, resume) in 2-rank fits in test_comm_auto.py and test_comm.py, and the config group that
reaches them in test_comm.py.

The compile run is typed as a user types it, ``python -m lightning_solo.run OPTION`` (Lightning's popen launcher
starts rank 1; compiling in fresh processes), without ``OMP_NUM_THREADS``, as from a fresh shell: the launcher,
not the test, must give every rank the same. The others compose the same overrides as the command line does
(Hydra's compose, :func:`~lightning_solo.app.run.strategy_options`) and run the runner's ``train(cfg)`` on ranks
forked from this process (``start_method=fork``), while the command runs: a command's ranks spend most of their
~10 s importing, one after the other, and that start is the same for every option."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from lightning_solo.app.run import strategy_options, train
from lightning_solo.ddp.comm import CHECKPOINT_KEY
from tests.helpers import composed

pytestmark = [pytest.mark.cli, pytest.mark.multiproc, pytest.mark.slow]

# One epoch of the default run, cut short: 12 of its 23 training batches (profile=window records batches 7-9),
# 2 validation batches. A run's own options come after these and override them.
SHORT = [
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=12",
    "trainer.limit_val_batches=2",
    "trainer.enable_progress_bar=false",
    "hydra.run.dir=run",
]
RUN_TIMEOUT_S = 240

# Dropped from the test's environment: the launch variables (as run_cli does) and conftest's OMP_NUM_THREADS.
NOT_INHERITED = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "OMP_NUM_THREADS",
)

Decided = dict[str, dict[str, Any]]


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    """``python -m lightning_solo.run *args`` in its own session (rank 0 starts the others, so a timeout ends them
    all), its output in ``cwd``/out.txt and err.txt."""
    env = {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
    env.update(HYDRA_FULL_ERROR="1", PYTHONUNBUFFERED="1")
    with open(cwd / "out.txt", "w") as out, open(cwd / "err.txt", "w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "lightning_solo.run", *args],
            cwd=cwd, env=env, stdout=out, stderr=err, start_new_session=True,
        )  # fmt: skip


def _finish(proc: subprocess.Popen, cwd: Path) -> str | None:
    """None when the command succeeded; else its exit status (or timeout) and the end of its stderr."""
    try:
        status = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        status = f"timed out after {RUN_TIMEOUT_S} s"
    return None if status == 0 else f"exit status {status}\n{(cwd / 'err.txt').read_text()[-4000:]}"


def _train_forked(args: list[str], cwd: Path) -> str | None:
    """The same overrides composed as the command line composes them, then the runner's ``train(cfg)`` on ranks
    forked from this process; None when it succeeded, else the traceback."""
    overrides = strategy_options([*args, "parallelism.strategy.start_method=fork"])
    try:
        with composed(overrides, cwd / "run") as cfg:
            train(cfg)
    except Exception:  # noqa: BLE001 - one run's failure fails its own test, not the other runs'
        return traceback.format_exc()[-4000:]
    return None


def _strategy(**options: Any) -> list[str]:
    return [f"parallelism.strategy.{key}={value}" for key, value in options.items()]


def _hook_state(summary: dict) -> dict | None:
    return torch.load(summary["checkpoint_last"], map_location="cpu", weights_only=True).get(CHECKPOINT_KEY)


def _no_hook(run: Path, summary: dict, decided: Decided) -> None:
    assert summary["precision"] == "32-true" and decided["precision"]["value"] == "32-true"
    assert decided["comm_hook"]["value"] is None and _hook_state(summary) is None
    assert decided["sync_batchnorm"]["value"] is True
    assert decided["find_unused_parameters"]["value"] is True
    assert decided["exact_eval"]["value"] is False
    assert decided["per_device_batch_size"]["value"] == summary["per_device_batch"]


def _fp16(run: Path, summary: dict, decided: Decided) -> None:
    assert summary["precision"] == "16-mixed" and decided["precision"]["value"] == "16-mixed"
    assert decided["comm_hook"]["value"] == "fp16"
    assert decided["sync_batchnorm"]["value"] is False
    assert decided["find_unused_parameters"]["value"] is False
    assert decided["exact_eval"]["value"] is True
    assert not (run / "csv").exists()  # logger=none


def _bf16(run: Path, summary: dict, decided: Decided) -> None:
    assert summary["precision"] == "32-true"  # auto, on CPU
    assert decided["comm_hook"]["value"] == "bf16"
    assert decided["sync_batchnorm"]["value"] is True  # auto: 16 per device is below the threshold (32)
    assert decided["find_unused_parameters"]["value"] in (True, False)  # auto: decided from the evidence
    # profile=window: one trace per global rank; the default callbacks (Preflight, LossWatch, ResourceMonitor)
    # at work, ResourceMonitor at the interval the run set.
    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"trace_rank{rank}.json").read_text())
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
    with open(run / "csv" / "version_0" / "metrics.csv") as f:
        steps = [r["step"] for r in csv.DictReader(f) if r.get("system/cpu/process_percent_max")]
    assert steps == [str(step) for step in range(2, 13, 2)]
    assert decided["resource_monitor.every_n_steps"]["value"] == 2
    assert decided["preflight"]["value"] == "passed" and decided["loss_watch.grad_norm"]["value"] is True
    assert "2 rank(s) agree on torch" in decided["preflight"]["reason"], decided["preflight"]


def _powersgd(run: Path, summary: dict, decided: Decided) -> None:
    assert summary["precision"] == "bf16-mixed"
    assert decided["comm_hook"]["value"] == "powersgd"
    state = _hook_state(summary)  # compressing since step 2: error feedback, one shard per rank
    assert state["hook"] == "powersgd" and state["iter"] == 12 and len(state["shards"]["sha256"]) == 2


def _compile(run: Path, summary: dict, decided: Decided) -> None:
    assert decided["compile"]["value"] is True and "inside DDP's forward" in decided["compile"]["reason"]
    assert "0 recompiles in training steps" in decided["compile"]["reason"], decided["compile"]
    state = torch.load(summary["checkpoint_last"], map_location="cpu", weights_only=True)["state_dict"]
    assert not [k for k in state if "_orig_mod" in k]
    assert decided["strip_compiled_prefix"]["value"] is True, decided["strip_compiled_prefix"]


class Run(NamedTuple):
    options: list[str]
    check: Callable[[Path, dict, Decided], None]
    command: bool = False  # typed on the command line (else composed and trained on forked ranks)


RUNS = {
    "no_hook-32_true-syncbn_true-unused_true-stock_eval-auto_batch_size": Run(
        [
            "parallelism.precision=32-true",
            "auto_batch_size=memory",  # its batch (718) cuts the epoch to 2 steps: with no hook that needs more
            *_strategy(comm_hook="null", sync_batchnorm="true", find_unused_parameters="true", exact_eval="false"),
        ],
        _no_hook,
    ),
    "fp16-16_mixed-syncbn_false-unused_false-exact_eval-no_logger": Run(
        [
            "logger=none",
            "parallelism.precision=16-mixed",
            "trainer.limit_train_batches=3",  # real fp16 on CPU: ~35x slower than fp32 in small_cnn
            *_strategy(comm_hook="fp16", sync_batchnorm="false", find_unused_parameters="false", exact_eval="true"),
        ],
        _fp16,
    ),
    "bf16-auto_precision-syncbn_auto-unused_auto-profile_window": Run(
        [
            "parallelism.precision=auto",
            "data.batch_size=16",
            "profile=window",
            "callbacks.resource_monitor.every_n_steps=2",
            *_strategy(comm_hook="bf16", sync_batchnorm="auto", find_unused_parameters="auto"),
        ],
        _bf16,
    ),
    # compile: aot_eager (Dynamo's capture and DDPOptimizer's split without inductor's C++ compile, ~30 s a graph
    # on CPU), bf16 autocast inside the compiled step, PowerSGD on DDP's buckets; strip_compiled_prefix=true:
    # passed on to SoloDDP, which records the user's setting.
    "powersgd-bf16_mixed-compile": Run(
        [
            "parallelism.precision=bf16-mixed",
            *_strategy(
                comm_hook="powersgd",
                powersgd_start_iter=2,
                compile="{backend:aot_eager}",
                strip_compiled_prefix="true",
            ),
        ],
        lambda run, summary, decided: (_powersgd(run, summary, decided), _compile(run, summary, decided)),
        command=True,
    ),
}


@pytest.fixture(scope="module")
def finished(request, tmp_path_factory) -> dict[str, tuple[Path, str | None]]:
    """The selected runs (``-k`` chooses): name -> (its directory, None or what went wrong). The command starts
    first and runs while the others train one after the other."""
    names = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    ]
    dirs = {name: tmp_path_factory.mktemp(name[:40]) for name in names}
    commands = {n: _start([*SHORT, *RUNS[n].options], dirs[n]) for n in names if RUNS[n].command}
    errors = {n: _train_forked([*SHORT, *RUNS[n].options], dirs[n]) for n in names if not RUNS[n].command}
    errors.update({n: _finish(proc, dirs[n]) for n, proc in commands.items()})
    return {name: (dirs[name], errors[name]) for name in names}


@pytest.mark.timeout(3 * RUN_TIMEOUT_S)  # the first test waits for every run
@pytest.mark.parametrize("name", list(RUNS))
def test_option_runs_with_the_runners_defaults_and_checkpoints(name, finished):
    tmp_path, error = finished[name]
    options = RUNS[name].options
    assert error is None, f"{options}: {error}"
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    last = Path(summary["checkpoint_last"])
    assert last.exists() and last.parent == run / "checkpoints", summary["checkpoint_last"]
    assert summary["epochs"] == 1 and summary["global_step"] > 0
    RUNS[name].check(run, summary, {d["setting"]: d for d in summary["decisions"]})
