"""TrainingDoctor on 2 real gloo processes: one fit in four phases of 8 steps, each judged by its own
periodic report: a normal step (compute-bound), a slow dataset (data-bound), an all-reduce slowed by a comm
hook (communication-bound), rank 1 slowed on purpose (straggler-bound, rank 1 named). Then the files.

The forward pass sleeps ``COMPUTE_S`` on top of a small MLP, standing in for device compute: real CPU work on
the shared 2-core test machine swings by tens of percent between ranks with the other jobs' load, which
would make the normal phase's "compute-bound" a coin toss. The deliberate delays are 3x that.
"""

from __future__ import annotations

import json
import threading
import time

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, Dataset

from lightning_solo import SoloDDP
from lightning_solo.app.run_summary import RunSummary
from lightning_solo.callbacks import TrainingDoctor
from lightning_solo.ddp import syncbn
from lightning_solo.ddp.syncbn.wait import SYNCBN_WAIT
from lightning_solo.ddp.unused.policy import UnusedParameters
from lightning_solo.diagnostics.doctor.report import rank_times
from lightning_solo.diagnostics.doctor.timing import StepTimer
from lightning_solo.testing import run_ranks
from tests.helpers import equivalence as eq
from tests.helpers.records import read_rank_records, write_rank_record

PHASE = 8  # optimizer steps per phase, = the doctor's every_n_steps
PHASES = ("compute", "data", "communication", "straggler")
WARMUP = 2
COMPUTE_S = 0.04
SLOW_S = 0.12  # the deliberate delay
BATCH = 32
SLOW_COMM = {"on": False}  # per process: the phase's training_step turns the slow all-reduce on


def phase(step: int) -> str:
    return PHASES[min(step // PHASE, len(PHASES) - 1)]


class Batches(Dataset):
    """Item i is the whole batch of step i (``batch_size=None``); slow in the data phase."""

    def __init__(self, steps: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = (
            torch.randn(steps, BATCH, 64, generator=g),
            torch.randint(10, (steps, BATCH), generator=g),
        )

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        # A loader with a length is not read ahead: item i is loaded right before step i.
        if phase(i) == "data":
            time.sleep(SLOW_S)
        return self.x[i], self.y[i]


def slow_allreduce(state, bucket):
    """Exact all-reduce, finished ``SLOW_S`` late off the backward thread (a slow link, not slow compute)."""
    fut = default_hooks.allreduce_hook(state, bucket)
    if not SLOW_COMM["on"]:
        return fut
    late = torch.futures.Future()

    def finish():
        time.sleep(SLOW_S)
        late.set_result(fut.wait())

    threading.Thread(target=finish, daemon=True).start()
    return late


class Mlp(L.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        now = phase(self.global_step)
        SLOW_COMM["on"] = now == "communication"
        time.sleep(COMPUTE_S + (SLOW_S if now == "straggler" and self.global_rank == 1 else 0.0))
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(Batches(self.steps), batch_size=None)


class Record(L.Callback):
    def __init__(self, path, doctor):
        self.path, self.doctor = path, doctor

    def on_fit_end(self, trainer, pl_module):
        record = {"reports": self.doctor.reports, "report": self.doctor.report, "files": self.doctor.files}
        write_rank_record(self.path, trainer.global_rank, record)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_each_phase_gets_its_verdict_on_every_rank_and_the_files_are_written(tmp_path):
    steps = PHASE * len(PHASES)
    doctor = TrainingDoctor(every_n_steps=PHASE, warmup_steps=WARMUP)
    summary = RunSummary()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=steps, use_distributed_sampler=False, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=tmp_path, callbacks=[doctor, Record(tmp_path, doctor), summary],
        strategy=SoloDDP(start_method="fork", find_unused_parameters=False, ddp_comm_hook=slow_allreduce),
    )  # fmt: skip
    trainer.fit(Mlp(steps))
    r0, r1 = read_rank_records(tmp_path)

    bounds = [r["verdict"]["bound"] for r in r0["reports"]]
    details = [(r["verdict"]["text"], [(x["data_ms"], x["comm_ms"], x["compute_ms"]) for x in r["ranks"]]) for r in r0["reports"]]  # fmt: skip
    assert bounds == list(PHASES), details
    assert [r["verdict"] for r in r1["reports"]] == [r["verdict"] for r in r0["reports"]]  # one verdict, all ranks
    _compute, data, _comm, straggler = r0["reports"]
    assert straggler["straggler"]["rank"] == 1 and straggler["straggler"]["behind_ms"] > 0.5 * SLOW_S * 1e3
    # named with its phase from SoloDDP's heartbeat (strategy.heartbeats()): slow in training_step, not stopped
    assert straggler["straggler"]["phase"] == "training_step", straggler["straggler"]
    assert straggler["straggler"]["phase_excess_ms"] > 0.5 * SLOW_S * 1e3, straggler["straggler"]
    # The first setting to change; a straggler remedy (no setting) may come first when the machine slows one rank.
    settings = [r["setting"] for r in data["verdict"]["remedies"] if r["setting"] is not None]
    assert settings[:1] == ["DataLoader.num_workers"], data["verdict"]["remedies"]
    advised = {(r["setting"], r["value"]) for report in r0["reports"] for r in report["verdict"]["remedies"]}
    assert not {v for k, v in advised if k == "SoloDDP.comm_hook"} & {"fp16", "bf16", "powersgd", "auto"}, "no compression advice on CPU"  # fmt: skip
    for report in r0["reports"]:
        assert report["steps"] in (PHASE - WARMUP, PHASE)  # the first window starts after the warm-up
        tp = report["throughput"]
        assert tp["global_samples_per_s"] > tp["per_device_samples_per_s"] > 0  # reduced over both ranks

    # The files: rank 0 wrote them, the summary points to them, the chart is a real PNG.
    doc = json.loads((tmp_path / "doctor.json").read_text())
    assert doc["final"]["steps"] == steps - WARMUP and len(doc["periodic"]) == len(PHASES)
    assert len(doc["series"]["ranks"]) == 2 and doc["series"]["step"]
    assert all(loss is not None for r in doc["series"]["ranks"] for loss in r["loss"])
    png = tmp_path / "doctor.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    with Image.open(png) as image:
        assert image.size[0] > 500 and len(image.getcolors(maxcolors=1 << 16) or range(256)) > 8  # not blank
    assert doctor.files == {"json": str(tmp_path / "doctor.json"), "chart": str(png)}  # back in the parent
    assert summary.summary["doctor"]["json"] == str(tmp_path / "doctor.json")


LATE_S, LATE_STEPS = 0.15, 3


def _syncbn_wait(rank: int, world_size: int) -> dict:
    """Rank 1 reaches each step's SyncBN late; rank 0 waits for it inside SyncBN's forward all-reduce."""
    bn = syncbn.convert(nn.BatchNorm1d(4))
    timer = StepTimer(torch.device("cpu"))
    timer.comm.watch(bn)  # what the doctor does at each batch start: SyncBN's waits are timed from here
    timer.start()
    for _ in range(LATE_STEPS):
        timer.comm.watch(bn)
        timer.batch_start()
        time.sleep(LATE_S if rank == 1 else 0.0)
        bn(torch.randn(8, 4)).square().sum().backward()
        timer.before_optimizer()
        timer.batch_end(8, None)
    times = rank_times(timer.take_window().values())
    timer.comm.release()
    return {"comm_ms": times.comm_ms, "compute_ms": times.compute_ms}


@pytest.mark.multiproc
def test_time_waiting_in_syncbn_collectives_is_communication_not_compute():
    waiting, late = run_ranks(_syncbn_wait, 2)
    late_ms = LATE_S * 1e3
    assert waiting["comm_ms"] > 0.7 * late_ms and waiting["compute_ms"] < 0.5 * late_ms, waiting
    assert late["compute_ms"] > 0.9 * late_ms and late["comm_ms"] < 0.5 * late_ms, late  # its sleep: its own work


class _HostEvent:
    """A stand-in for ``torch.cuda.Event`` on the host clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.at - self.at) * 1e3


def test_cuda_syncbn_waits_are_read_back_with_the_timers_own_events(monkeypatch):
    timer = StepTimer(torch.device("cpu"), bin_steps=2)
    timer.cuda, timer.event = True, _HostEvent
    monkeypatch.setattr(SYNCBN_WAIT, "event", _HostEvent)
    cuda = torch.device("cuda")
    timer.comm.watch(None)
    timer.start()
    for _ in range(4):
        timer.batch_start()
        mark = SYNCBN_WAIT.start(cuda)  # what SyncBN does around each all-reduce
        time.sleep(0.01)
        SYNCBN_WAIT.stop(mark, cuda)
        timer.before_optimizer()
        timer.batch_end(4, None)
    times = rank_times(timer.take_window().values())
    timer.comm.release()
    assert times.comm_ms >= 9.0 and times.compute_ms < times.comm_ms, times
    assert SYNCBN_WAIT.start(cuda) is None  # nobody listens after release: nothing is timed


class _Iterations(L.Callback):
    """Per rank: the DDP iterations the doctor's exposed-communication sums counted, and DDP's own count of the
    iterations it timed, summed over the fit's wrappers: each read as SoloDDP drops it (the same public seam as
    the doctor's), the last at the end of training."""

    def __init__(self, path, doctor):
        self.path, self.doctor = path, doctor

    def on_train_start(self, trainer, pl_module):
        self.dropped = 0
        trainer.strategy.add_rewrap_listener(self.read)

    def read(self, ddp):
        self.dropped += ddp._get_ddp_logging_data().get("iteration", 0)  # every one timed (sample rate 1 on CPU)

    def on_train_end(self, trainer, pl_module):  # after the doctor's final report (it comes first)
        self.read(trainer.strategy.model)
        record = {"doctor": self.doctor._timer.comm.iterations, "ddp": self.dropped}
        write_rank_record(self.path, trainer.global_rank, record)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_exposed_communication_counts_carry_across_a_rewrap(tmp_path):
    """find_unused_parameters="auto" re-wraps DDP at the start of step 5 (its window: 4 steps), and SoloDDP drops
    the old wrapper before it builds the next: the doctor reads it out first, so it counts every iteration
    either wrapper timed. DDP times an iteration at the next one's forward, which a dropped wrapper never has:
    one fewer than the same fit without a re-wrap (False). 128 steps: the doctor reads DDP's timings once per
    chart bin of 2 steps, from the end of its 3 warm-up steps, so the old wrapper holds an unread iteration."""
    steps, counts = 128, {}
    assert UnusedParameters().window == 4
    for setting in ("auto", False):
        out = tmp_path / str(setting)
        (out / "iterations").mkdir(parents=True)
        doctor = TrainingDoctor(chart=None)
        strategy = SoloDDP(start_method="fork", find_unused_parameters=setting)
        records = eq.fit(out, eq.Net("used", eq.make_data(steps)), strategy, steps=steps,
                         callbacks=[doctor, _Iterations(out / "iterations", doctor)])  # fmt: skip
        assert records[0]["wrappers"] == (2 if setting == "auto" else 1)
        counts[setting] = read_rank_records(out / "iterations")
        for rank in counts[setting]:
            assert rank["doctor"] == rank["ddp"], (setting, rank)
    assert [r["doctor"] for r in counts["auto"]] == [r["doctor"] - 1 for r in counts[False]]
