"""Preflight across real ranks: a version forged on one rank stops every rank, naming that rank, within seconds,
through the callback (2 gloo ranks under SoloDDP's fork launcher) and through ``python -m lightning_solo.preflight``
(2 processes started as torchrun would start them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import lightning as L
import pytest

import lightning_solo
from lightning_solo import SoloDDP
from lightning_solo.callbacks import Preflight
from lightning_solo.core.cluster import PreflightError
from tests.distributed import free_port
from tests.helpers.modules import TinyModule
from tests.helpers.records import read_rank_records, write_rank_record


class _ForgeVersionOnRank1(L.Callback):
    def setup(self, trainer, pl_module, stage):
        if trainer.global_rank == 1:  # this forked rank's process only
            lightning_solo.__version__ = "0.0.0-forged"


class _RecordedPreflight(Preflight):
    def __init__(self, out):
        super().__init__()
        self.out = out

    def setup(self, trainer, pl_module, stage):
        try:
            super().setup(trainer, pl_module, stage)
        except PreflightError as err:
            write_rank_record(self.out, trainer.global_rank, {"error": str(err)})
            raise


@pytest.mark.multiproc
def test_a_version_forged_on_one_rank_stops_every_rank_naming_it(tmp_path):
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=SoloDDP(start_method="fork"), max_steps=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
        callbacks=[_ForgeVersionOnRank1(), _RecordedPreflight(tmp_path)],
    )  # fmt: skip
    start = time.monotonic()
    with pytest.raises(Exception, match="lightning_solo differs across ranks"):
        trainer.fit(TinyModule())
    assert time.monotonic() - start < 30
    for record in read_rank_records(tmp_path):  # both ranks raised, with the same verdict
        assert "error [agree.lightning_solo] (rank 1)" in record["error"]
        assert "'0.0.0-forged' on rank 1; '0.1.0' on rank 0" in record["error"]
    assert lightning_solo.__version__ == "0.1.0"  # the parent was never touched


def _preflight(rank: int, port: int, extra_env: dict[str, str], args=()) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra_env)  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "lightning_solo.preflight", "--timeout", "60", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.multiproc
@pytest.mark.cli
@pytest.mark.timeout(120)
def test_the_command_line_compares_every_rank_and_fails_on_each(tmp_path):
    port = free_port()
    report = tmp_path / "preflight.json"
    procs = [
        _preflight(0, port, {}, ["--json", str(report)]),
        _preflight(1, port, {"NCCL_PROTO": "Simple"}),  # an NCCL setting exported on one node only
    ]
    try:
        out = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            p.kill()
    (stdout0, _), (_, stderr1) = out
    assert [p.returncode for p in procs] == [2, 2]
    named = "error [agree.env.NCCL_PROTO] (rank 1): env.NCCL_PROTO differs across ranks: 'Simple' on rank 1"
    assert named in stdout0 and "preflight FAILED: 1 error(s)" in stdout0
    assert named in stderr1  # rank 1 says why it failed in its own log too
    data = json.loads(report.read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    assert data["findings"][0]["check"] == "agree.env.NCCL_PROTO" and data["findings"][0]["ranks"] == [1]
