"""The doctor's pure parts as tables: the verdict (measured times → bound and ranked remedies), the reduction of
throughput over ranks, DDP's sampled-iteration count, and the step timer's bins (host clock, no processes)."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from lightning_solo.diagnostics.doctor.report import (
    format_table,
    rank_times,
    straggler_phase,
    summarize,
    throughput,
)
from lightning_solo.diagnostics.doctor.timing import (
    COMM,
    DATA,
    FIELDS,
    FWD_BWD,
    SAMPLES,
    STEPS,
    StepTimer,
    recorded_iterations,
)
from lightning_solo.diagnostics.doctor.verdict import MIN_GAIN, RankTimes, Setup, diagnose

CPU = Setup(device="cpu", world_size=2, per_device_batch=32, num_workers=0, idle_cores=3)
GPU = Setup(device="cuda", world_size=8, per_device_batch=64, num_workers=4, idle_cores=4, pin_memory=True)
COMPRESSION = {"fp16", "bf16", "powersgd", "auto"}


def same(times: RankTimes, n: int = 2) -> list[RankTimes]:
    return [times] * n


@pytest.mark.parametrize(
    ("ranks", "setup", "bound", "first", "straggler"),
    [
        (same(RankTimes(40, 8, 1, 1)), CPU, "data", ("DataLoader.num_workers", 3), 0),
        (same(RankTimes(1, 10, 30, 1)), CPU, "communication", ("DataLoader.batch_size", 64), 0),
        (same(RankTimes(1, 10, 30, 1), 8), GPU, "communication", ("DataLoader.batch_size", 128), 0),
        (same(RankTimes(1, 30, 2, 1)), CPU, "compute", ("DataLoader.batch_size", 64), 0),  # small, but measured
        (same(RankTimes(1, 30, 2, 1), 8), Setup(device="cuda", world_size=8, precision="32-true"), "compute",
         ("SoloDDP.precision", "auto"), 0),
        # rank 1 computes 40 ms longer; rank 0 waits for it in the all-reduce
        ([RankTimes(1, 10, 42, 1), RankTimes(1, 50, 2, 1)], CPU, "straggler", (None, None), 1),
        # rank 0 waits 40 ms longer for its data
        ([RankTimes(41, 10, 2, 1), RankTimes(1, 10, 42, 1)], CPU, "straggler", ("DataLoader.num_workers", 1), 0),
        ([RankTimes(0.5, 30, 0, 1)], Setup(), "compute", None, None),  # one process, nothing to gain
    ],
)  # fmt: skip
def test_verdict_table(ranks, setup, bound, first, straggler):
    verdict = diagnose(ranks, setup)
    assert verdict.bound == bound, verdict
    assert verdict.straggler == straggler
    assert abs(sum(verdict.shares.values()) - 1) < 0.05  # the shares split the step
    if first is None:
        assert not verdict.remedies
    else:
        assert (verdict.remedies[0].setting, verdict.remedies[0].value) == first, verdict.remedies
    gains = [r.gain for r in verdict.remedies]
    assert gains == sorted(gains, reverse=True) and all(g >= MIN_GAIN for g in gains)


def test_the_straggler_is_named_with_how_far_behind():
    verdict = diagnose([RankTimes(1, 10, 42, 1), RankTimes(1, 10, 42, 1), RankTimes(1, 50, 2, 1)], CPU)
    assert verdict.straggler == 2 and verdict.behind_ms == pytest.approx(40)
    assert "rank 2 is 40.0 ms per step slower" in verdict.remedies[0].action
    assert verdict.shares["communication"] == pytest.approx(2 / 54)  # the wait for rank 2 is not communication


def test_no_compression_advice_on_cpu_nor_where_auto_measured_it_slower():
    comm_bound = same(RankTimes(1, 10, 30, 1))

    def hooks(setup):
        return {r.value for r in diagnose(comm_bound, setup).remedies if r.setting == "SoloDDP.comm_hook"}

    assert not hooks(CPU) & COMPRESSION
    assert "auto" in hooks(Setup(device="cuda", world_size=2))
    slower = {"exact": 40.0, "fp16": 41.0, "bf16": 40.5, "powersgd": 50.0}
    assert not hooks(Setup(device="cuda", world_size=2, hook_times_ms=slower)) & COMPRESSION
    assert not hooks(Setup(device="cuda", world_size=2, comm_hook="bf16")) & COMPRESSION  # one is in use


@pytest.mark.parametrize(
    ("setup", "setting", "value"),
    [
        (Setup(device="cuda", world_size=2, bucket_count=1, gradient_mib=100.0, overlap_fraction=0.1),
         "SoloDDP.bucket_cap_mb", 25),
        (Setup(world_size=2, bucket_count=40, gradient_mib=10.0, bucket_cap_mb=0.25),
         "SoloDDP.bucket_cap_mb", 1.0),
        (Setup(world_size=2, accumulate=2), "Trainer.accumulate_grad_batches", 4),
        (Setup(world_size=2), "SoloDDP.comm_hook", "post_local_sgd"),
    ],
)  # fmt: skip
def test_communication_remedies_follow_the_layout(setup, setting, value):
    remedies = diagnose(same(RankTimes(1, 10, 30, 1)), setup).remedies
    assert (setting, value) in {(r.setting, r.value) for r in remedies}


def test_a_full_gpu_is_not_told_to_double_its_batch_and_pinned_memory_is_advised_on_gpu():
    full = Setup(device="cuda", world_size=2, per_device_batch=64, memory_fraction=0.8)
    keys = [r.setting for r in diagnose(same(RankTimes(1, 10, 30, 1)), full).remedies]
    assert "DataLoader.batch_size" not in keys and keys[0] == "Trainer.accumulate_grad_batches"
    keys = [r.setting for r in diagnose(same(RankTimes(40, 8, 1, 1)), Setup(device="cuda", num_workers=2)).remedies]
    assert {"DataLoader.pin_memory", "DataLoader.prefetch_factor"} <= set(keys)


def test_throughput_is_reduced_over_ranks_not_rank0_times_world():
    def sums(data_s, fwd_bwd_s, comm_s, samples=320):
        row = [0.0] * len(FIELDS)
        row[STEPS], row[DATA], row[FWD_BWD], row[COMM], row[SAMPLES] = 10, data_s, fwd_bwd_s, comm_s, samples
        return row

    # rank 1 waits 1.5 s longer for data; rank 0 waits for rank 1 inside its all-reduce
    fast, slow = sums(0.0, 2.5, 1.5), sums(1.5, 1.0, 0.0)
    tp = throughput([fast, slow], reference=200.0)
    assert tp["global_samples_per_s"] == pytest.approx(640 / 2.5)  # all samples over the slowest rank's time
    assert tp["per_device_samples_per_s"] == pytest.approx(320 / 2.5)
    assert tp["scaling_efficiency"] == pytest.approx(256 / 400)
    assert throughput([sums(0.0, 1.0, 0.0), slow])["global_samples_per_s"] == pytest.approx(640 / 2.5)  # not 2 × 320
    # SoloDDP's heartbeats, gathered too: seconds in each phase of the rank's own work
    beats = [{"phase_s:data wait": 0.1, "phase_s:training_step": 1.0}, {"phase_s:data wait": 1.6, "phase_s:training_step": 1.0}]  # fmt: skip
    gathered = [
        {"window": fast, "total": fast, "peak_memory_mib": 100.0, "memory_total_mib": 1000.0, "idle_cores": 2.0, "bins": [], **beats[0]},
        {"window": slow, "total": slow, "peak_memory_mib": 500.0, "memory_total_mib": 1000.0, "idle_cores": 0.0, "bins": [], **beats[1]},
    ]  # fmt: skip
    report = summarize(gathered, "window", CPU)
    assert report["ranks"][1]["data_ms"] == pytest.approx(150.0) and report["ranks"][0]["compute_ms"] == pytest.approx(
        100.0
    )
    assert report["verdict"]["bound"] == "straggler" and report["straggler"]["rank"] == 1
    assert report["straggler"]["behind_ms"] == pytest.approx(150.0)
    # named with its phase, from the heartbeat: the straggler has not stopped, it waits on data
    assert report["straggler"]["phase"] == "data wait"
    assert report["straggler"]["phase_excess_ms"] == pytest.approx(150.0)
    assert "most of it in data wait (+150.00 ms per step, by its heartbeat)" in format_table(report)
    # rank 1's excess is its data wait
    assert report["verdict"]["remedies"][0]["setting"] == "DataLoader.num_workers"


@pytest.mark.parametrize(
    ("phase_s", "rank", "found"),
    [
        ([{"training_step": 1.0}, {"training_step": 2.2}], 1, ("training_step", 120.0)),  # slow compute
        (
            [{"data wait": 0.1}, {"data wait": 0.1}, {"data wait": 1.3}],
            2,
            ("data wait", 120.0),
        ),  # slow loader
        ([{"training_step": 1.0}, {"training_step": 1.0}], 1, None),  # nothing over the others
        ([{}, {}], 1, None),  # no heartbeat (not SoloDDP, or watchdog=False)
        ([{"training_step": 1.0}], 0, None),  # one rank
    ],
)
def test_the_straggler_phase_is_its_own_work_most_over_the_others(phase_s, rank, found):
    got = straggler_phase(phase_s, rank, steps=10)
    assert got == found if found is None else (got[0] == found[0] and got[1] == pytest.approx(found[1]))


@pytest.mark.parametrize(
    ("iteration", "rate", "recorded"),
    [
        (0, 100, 0),
        (7, 100, 7),
        (10, 100, 10),
        (99, 100, 10),
        (100, 100, 11),
        (250, 100, 12),
        (25, 1, 25),
        (35, 10, 12),
    ],
)
def test_ddp_times_iterations_1_to_10_then_every_rate_th(iteration, rate, recorded):
    assert recorded_iterations(iteration, rate) == recorded


def test_step_timer_splits_host_time_and_keeps_few_bins():
    timer = StepTimer(torch.device("cpu"), bin_steps=1, max_bins=4)
    timer.start()
    steps = 13
    for step in range(steps):
        timer.batch_start()
        time.sleep(0.002)  # forward+backward
        timer.before_optimizer()
        timer.batch_end(8, torch.tensor(float(step)))
        time.sleep(0.001)  # waiting for the next batch
    window = timer.take_window()
    assert window.v[STEPS] == steps and window.values()[5] == 8 * steps
    t = rank_times(window.values())
    assert t.compute_ms >= 2.0 and 1.0 <= t.data_ms < t.compute_ms and t.comm_ms == 0.0
    assert len(timer.bins) <= 4 and sum(b.v[STEPS] for b in timer.bins) == steps
    assert timer.bin_ends[-1] == steps and timer.bin_ends == sorted(timer.bin_ends)
    assert window.values()[6] == pytest.approx(sum(range(steps)))  # the loss, summed per micro-batch
    assert timer.take_window().v[STEPS] == 0 and timer.total.v[STEPS] == steps


def test_the_chart_needs_matplotlib_only_when_it_is_drawn(tmp_path, monkeypatch):
    from lightning_solo.diagnostics.doctor.report import plot_doctor

    rank = {"data_ms": [1.0, 2.0], "compute_ms": [5.0, 5.0], "comm_ms": [1.0, 0.5], "optimizer_ms": [0.5, 0.5],
            "loss": [2.3, None], "steps": [4.0, 4.0]}  # fmt: skip
    data = {"step": [4, 8], "global_samples_per_s": [100.0, 110.0], "ranks": [rank, rank]}
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if not installed
    assert plot_doctor(data, tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()
    monkeypatch.delitem(sys.modules, "matplotlib.figure")
    assert plot_doctor(data, tmp_path / "doctor.png").read_bytes()[:4] == b"\x89PNG"


class _HostEvent:
    """A stand-in for ``torch.cuda.Event``: the host clock, and a count of the waits on it."""

    waits = 0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = None

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        _HostEvent.waits += 1

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.at - self.at) * 1e3  # milliseconds, as CUDA's


def test_cuda_intervals_are_read_back_a_bin_late_and_all_at_a_report():
    timer = StepTimer(torch.device("cpu"), bin_steps=2, max_bins=4)
    timer.cuda, timer.event, _HostEvent.waits = True, _HostEvent, 0
    timer.start()
    for _ in range(11):
        timer.batch_start()
        time.sleep(0.001)
        timer.before_optimizer()
        timer.batch_end(4, None)
    # bins closed at steps 2, 4, ... (merged past 4): each waited on once, when the next one closed
    assert _HostEvent.waits < 11 and timer.total.v[1:3] != [0.0, 0.0]
    window = timer.take_window()
    assert window.v[STEPS] == 11 and all(not b.pending for b in timer.bins)
    assert rank_times(window.values()).compute_ms >= 1.0  # every interval read back, none lost in a merge
    assert sum(b.v[STEPS] for b in timer.bins) == 11 and len(timer.bins) <= 4
    assert sum(b.v[FWD_BWD] for b in timer.bins) == pytest.approx(window.v[FWD_BWD])  # bins and window agree


def test_the_runner_turns_the_doctor_on_and_checks_its_keys(tmp_path):
    import hydra

    from lightning_solo.app.config_check import ConfigError, check_config
    from lightning_solo.callbacks import TrainingDoctor
    from tests.helpers import composed

    with composed(["callbacks.doctor.every_n_steps=100", "data.prefetch_factor=4"], tmp_path) as cfg:
        check_config(cfg)
        doctor = hydra.utils.instantiate(cfg.callbacks.doctor)
        assert isinstance(doctor, TrainingDoctor) and doctor.every_n_steps == 100
        assert hydra.utils.instantiate(cfg.data).prefetch_factor == 4
    with (
        composed(["+callbacks.doctor.every_n_step=100"], tmp_path) as cfg,
        pytest.raises(ConfigError, match=r"callbacks\.doctor\.every_n_step: .*Did you mean 'every_n_steps'"),
    ):
        check_config(cfg)


def test_one_process_without_ddp_is_measured_too(tmp_path):
    import lightning as L

    from lightning_solo.callbacks import TrainingDoctor
    from tests.helpers.modules import TinyModule

    doctor = TrainingDoctor(warmup_steps=1, every_n_steps=4, chart=None)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=8, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[doctor],
    )  # fmt: skip
    trainer.fit(TinyModule(samples=16, batch_size=2))
    assert [r["steps"] for r in doctor.reports] == [3, 4] and doctor.report["steps"] == 7
    assert doctor.report["straggler"]["rank"] is None and doctor.report["ranks"][0]["comm_ms"] == 0.0
    assert doctor.report["throughput"]["global_samples_per_s"] > 0
    assert doctor.files == {"json": str(tmp_path / "doctor.json"), "chart": None}


def test_the_doctor_watches_the_loss_unless_a_loss_watch_of_its_own_runs(tmp_path):
    import lightning as L

    from lightning_solo.callbacks import LossWatch, TrainingDoctor
    from lightning_solo.diagnostics.loss_watch import NonFiniteLossError
    from tests.helpers.modules import TinyModule

    class NaNAtStep3(TinyModule):
        def training_step(self, batch, batch_idx):
            loss = self.batch_loss(batch)
            return loss * float("nan") if self.trainer.global_step == 3 else loss

    def fit(*callbacks):
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_steps=6, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path, callbacks=list(callbacks),
        )  # fmt: skip
        trainer.fit(NaNAtStep3(samples=16, batch_size=2))
        return trainer

    doctor = TrainingDoctor(chart=None)
    with pytest.raises(NonFiniteLossError, match="optimizer step 3"):
        fit(doctor)
    assert doctor._watch is doctor.loss_watch and "loss_watch.grad_norm" in doctor.decisions
    doctor, watch = TrainingDoctor(chart=None), LossWatch()
    with pytest.raises(NonFiniteLossError, match="optimizer step 3"):
        fit(doctor, watch)
    assert doctor._watch is None  # the trainer's own LossWatch stopped it; the doctor's stayed idle
    doctor = TrainingDoctor(chart=None, loss_watch=False)
    assert fit(doctor).global_step == 6 and doctor.loss_watch is None
