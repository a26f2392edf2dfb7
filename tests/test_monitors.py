"""ResourceMonitor and ProfilerWindow on 2 real gloo ranks: per-rank samples logged as min/max across ranks at
steps every rank agreed on, and one profiler trace per global rank; their decisions as tables."""

from __future__ import annotations

import csv
import json
import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_solo import SoloDDP
from lightning_solo.callbacks import ProfilerWindow, ResourceMonitor
from lightning_solo.diagnostics.resource_monitor import CPU_KEYS, ResourceSampler, decide_every_n_steps, decide_sources
from tests.helpers.modules import TinyModule
from tests.helpers.records import read_rank_records, write_rank_record


@pytest.mark.parametrize(
    ("interval", "pace", "steps"), [(30.0, 0.5, 60), (30.0, 100.0, 1), (0.1, 0.03, 3), (10.0, 0.0, 1)]
)
def test_sampling_steps_follow_the_measured_pace(interval, pace, steps):
    decision = decide_every_n_steps(interval, pace, measured_over=5)
    assert decision.value == steps and "slowest rank" in decision.reason


def test_cpu_sampler_reads_psutil():
    decision = decide_sources(torch.device("cpu"))
    assert decision.value == ["psutil"]
    sampler = ResourceSampler(torch.device("cpu"), nvml=False)
    values = dict(zip(sampler.keys, sampler.sample()))
    assert tuple(values) == CPU_KEYS and values["memory/rss_gib"] > 0.05 and not any(map(math.isnan, values.values()))


class _HeavyRank1(TinyModule):
    def on_train_start(self):
        if self.global_rank == 1:  # rank 1 holds 256 MiB more than rank 0: the max and min must differ
            self.ballast = torch.ones(64 * 2**20)


class _Record(L.Callback):
    def __init__(self, out):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        monitor = next(c for c in trainer.callbacks if isinstance(c, ResourceMonitor))
        profiler = next(c for c in trainer.callbacks if isinstance(c, ProfilerWindow))
        write_rank_record(self.out, trainer.global_rank, {
            "decisions": {k: d.value for k, d in monitor.decisions.items()},
            "trace": str(profiler.trace_path),
        })  # fmt: skip


@pytest.mark.multiproc
def test_min_max_across_ranks_and_a_trace_per_global_rank(tmp_path):
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=SoloDDP(start_method="fork"), max_steps=12,
        logger=CSVLogger(tmp_path, name="csv", version=0), enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=tmp_path,
        callbacks=[ResourceMonitor(interval_s=1e-3, calibration_steps=2),
                   ProfilerWindow(dirpath=str(tmp_path / "profile"), wait=1, warmup=1, active=2), _Record(tmp_path)],
    )  # fmt: skip
    trainer.fit(_HeavyRank1(samples=48, batch_size=2))
    records = read_rank_records(tmp_path)
    # the sampling interval was agreed: every rank decided the same number of steps
    assert records[0]["decisions"] == records[1]["decisions"]
    assert records[0]["decisions"]["resource_monitor.every_n_steps"] == 1
    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("system/memory/rss_gib_max")]
    # calibrated at step 3 (steps 1-3 measured), then every step
    assert [int(r["step"]) for r in rows] == list(range(3, 13))
    for row in rows:
        assert float(row["system/memory/rss_gib_max"]) - float(row["system/memory/rss_gib_min"]) > 0.2
        assert 0 <= float(row["system/cpu/process_percent_min"]) <= float(row["system/cpu/process_percent_max"])
    for rank, record in enumerate(records):
        assert record["trace"].endswith(f"profile/trace_rank{rank}.json")
        trace = json.loads((tmp_path / "profile" / f"trace_rank{rank}.json").read_text())
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
        assert sum(e.get("name", "").startswith("ProfilerStep#") for e in trace["traceEvents"]) == 2  # active=2
