"""What the tests share: the Hydra config as the runner composes it and the CLI in a subprocess (here); the one
LightningModule, :class:`~tests.helpers.modules.TinyModule`, that tests configure or subclass; the per-rank
recorder, :class:`~tests.helpers.records.RankRecorder`; the equivalence harness, a TinyModule fitted on 2 ranks
against 1 process (:mod:`tests.helpers.equivalence`); starting N raw ranks is :mod:`tests.distributed`."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig

REPO = Path(__file__).resolve().parents[2]
# A test file run as a script (its fault-injection driver and the ranks it starts) imports tests.helpers from here.
# A script a test starts launches its own ranks: it inherits no rank of the test process's environment.
SCRIPT_ENV = {
    **{
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")
    },
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
}
CONF = REPO / "conf"
# The smallest real run of the runner: one epoch of 8x8 synthetic images.
TINY_RUN = [
    "+experiment=quick_cpu",
    "data.image_size=8",
    "data.train_size=64",
    "data.val_size=32",
    "trainer.max_epochs=1",
]


@contextmanager
def composed(overrides: list[str], output_dir: Path, config_name: str = "config"):
    """The runner's config (``config_name="evaluate"``: the evaluation runner's) as Hydra would compose it, with
    ``${hydra:...}`` resolvable."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
            cfg = compose(
                config_name,
                overrides=[*overrides, f"hydra.runtime.output_dir={output_dir}"],
                return_hydra_config=True,
            )
            HydraConfig().set_config(cfg)
            yield cfg
    finally:
        GlobalHydra.instance().clear()


def run_cli(
    args: list[str],
    cwd: Path,
    timeout: float,
    module: str = "lightning_solo.app.run",
    python: str = sys.executable,
    full_error: bool = True,
    unset: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """``python -m module *args``; ``full_error=False`` runs it as a user would, without ``HYDRA_FULL_ERROR``;
    ``unset``: more variables the command starts without (``OMP_NUM_THREADS``, which conftest sets)."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "PYTHONUNBUFFERED": "1"}
    if not full_error:
        del env["HYDRA_FULL_ERROR"]
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", *unset):
        env.pop(var, None)
    return subprocess.run(
        [python, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_driver(script: str | Path, *args: object, timeout: float) -> dict:
    """Run ``script`` (a test file's ``__main__`` driver) with ``args`` under :data:`SCRIPT_ENV`; the last JSON line
    it printed."""
    import json

    proc = subprocess.run(
        [sys.executable, str(script), *map(str, args)], capture_output=True, text=True, timeout=timeout,
        env=SCRIPT_ENV,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1])
