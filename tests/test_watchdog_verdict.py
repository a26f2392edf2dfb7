"""The watchdog's pure parts: the verdict from every rank's heartbeat (a table), the heartbeat writer's phases and
allowance, the settings and their promised bound, and the flight recorder's environment."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch.distributed

from lightning_solo.ddp.watchdog import (
    Heartbeat,
    HeartbeatWriter,
    RankView,
    WatchdogSettings,
    decide_flight_recorder,
    judge,
)
from lightning_solo.ddp.watchdog import heartbeat as hb
from lightning_solo.ddp.watchdog.flight_recorder import deadlock
from lightning_solo.ddp.watchdog.verdict import END, REPORT, SUSPECT, Verdict
from lightning_solo.ddp.watchdog.watchdog import peer_failure
from tests.helpers.records import watchdog_lines, watchdog_reports


def beat(rank, phase, step=6, collective=None, seq=0, allowance=30.0, wait=0.0):
    return Heartbeat(rank, 100 + rank, "host", step, phase, 0.0, allowance, collective, seq, wait_s=wait,
                     wait_allowance_s=30.0)  # fmt: skip


def view(rank, phase, age, **kw):
    gone, silent, proc = kw.pop("gone", False), kw.pop("silent", 0.0), kw.pop("proc", None)
    waiting = kw.get("collective") is not None or phase == hb.BACKWARD
    return RankView(rank, beat(rank, phase, wait=age if waiting else 0.0, **kw), age_s=age, silent_s=silent,
                    gone=gone, proc=proc)  # fmt: skip


BACKWARD_0 = "rank 0 waits in backward (DDP's gradient all-reduce) at step 6"
CASES = [
    # (name, views, kind (None: no verdict), stuck ranks, the line)
    ("within allowance", [view(0, hb.BACKWARD, 10), view(1, hb.TRAINING_STEP, 12)], None, None, None),
    (
        "a rank busy in training_step: reported",
        [view(0, hb.BACKWARD, 93), view(1, hb.TRAINING_STEP, 94)],
        REPORT, (1,), f"rank 1 has been in training_step for 94 s at step 6; {BACKWARD_0}",
    ),
    (
        "a rank waiting for data: reported",
        [view(0, hb.BACKWARD, 40), view(1, hb.DATA_WAIT, 41)],
        REPORT, (1,), f"rank 1 has been in data wait for 41 s at step 6; {BACKWARD_0}",
    ),
    (
        "the waiting rank's clock never convicts a busy peer within its own allowance (a first checkpoint write)",
        [view(0, hb.CHECKPOINT_SAVE, 100, allowance=600.0),
         view(1, hb.DATA_WAIT, 99, collective="barrier 'Trainer.save_checkpoint'", seq=12)],
        None, None, None,
    ),
    (
        "a checkpoint write past its allowance: reported",
        [view(0, hb.CHECKPOINT_SAVE, 40),
         view(1, "on_train_batch_end", 39, collective="barrier 'Trainer.save_checkpoint'", seq=12)],
        REPORT, (0,), "rank 0 has been in checkpoint save for 40 s at step 6; "
        "rank 1 waits in barrier 'Trainer.save_checkpoint' (collective #12, in on_train_batch_end) at step 6",
    ),
    (
        "a hook on rank 0 past its allowance (the refined phase): reported",
        [view(0, "on_train_epoch_end", 40), view(1, hb.BACKWARD, 41, step=7)],
        REPORT, (0,), "rank 0 has been in on_train_epoch_end for 40 s at step 6; "
        "rank 1 waits in backward (DDP's gradient all-reduce) at step 7",
    ),
    (
        "every rank waits in a collective: suspected, the one behind named",
        [view(0, hb.BACKWARD, 40), view(1, hb.TRAINING_STEP, 41, collective="barrier 'extra'", seq=7)],
        SUSPECT, (1,), "rank 1 has been waiting in barrier 'extra' (collective #7, in training_step) for 41 s at "
        f"step 6; {BACKWARD_0}",
    ),
    (
        "every rank in backward: suspected, all named",
        [view(0, hb.BACKWARD, 40), view(1, hb.BACKWARD, 40)],
        SUSPECT, (0, 1), "rank 0 has been waiting in backward (DDP's gradient all-reduce) for 40 s at step 6; "
        "rank 1 has been waiting in backward (DDP's gradient all-reduce) for 40 s at step 6",
    ),
    (
        "a rank a step behind in backward is the one named",
        [view(0, hb.BACKWARD, 40, step=7), view(1, hb.BACKWARD, 41)],
        SUSPECT, (1,), "rank 1 has been waiting in backward (DDP's gradient all-reduce) for 41 s at step 6; "
        "rank 0 waits in backward (DDP's gradient all-reduce) at step 7",
    ),
    (
        "a rank whose process ended: the end",
        [view(0, hb.BACKWARD, 1), view(1, hb.TRAINING_STEP, 1, gone=True)],
        END, (1,), f"rank 1 is gone (its process ended; its last heartbeat: training_step at step 6); {BACKWARD_0}",
    ),
    (
        "a silent rank (native code holding the GIL): reported, with its process's state",
        [view(0, hb.BACKWARD, 50), view(1, hb.BACKWARD, 50, silent=45, proc="state S (sleeping)")],
        REPORT, (1,), "rank 1 has been silent for 45 s (last seen in backward at step 6; its process is alive: "
        f"state S (sleeping)); {BACKWARD_0}",
    ),
    (
        "a busy rank whose heartbeat stopped: reported with its process's state",
        [view(0, hb.BACKWARD, 40), view(1, hb.TRAINING_STEP, 40, silent=20, proc="state S (sleeping)")],
        REPORT, (1,), "rank 1 has been in training_step for 40 s at step 6 (its heartbeat silent for 20 s; its "
        f"process is alive: state S (sleeping)); {BACKWARD_0}",
    ),
    (
        "a rank whose heartbeat stopped after its last said backward: busy (a wait releases the lock), reported",
        [view(0, hb.BACKWARD, 40, step=7), view(1, hb.BACKWARD, 40, silent=5, proc="state S (sleeping)")],
        REPORT, (1,), "rank 1 has been waiting in backward (DDP's gradient all-reduce) for 40 s at step 6 (its "
        "heartbeat silent for 5 s; its process is alive: state S (sleeping)); rank 0 waits in backward (DDP's "
        "gradient all-reduce) at step 7",
    ),
    (
        "a heartbeat published late (its thread held up by the lock) is no report: the next one tells",
        [view(0, hb.BACKWARD, 40), RankView(1, replace(beat(1, hb.TRAINING_STEP), late=True), age_s=40)],
        None, None, None,
    ),
    (
        "a finished rank is neither stuck nor waited for",
        [view(0, hb.DONE, 400), view(1, hb.VALIDATION, 10)],
        None, None, None,
    ),
    (
        "a finished rank and a busy one: reported (on_train_end's slow work)",
        [view(0, hb.DONE, 400), view(1, "on_train_end", 40)],
        REPORT, (1,), "rank 1 has been in on_train_end for 40 s at step 6; rank 0 finished training",
    ),
    (
        "a finished rank while another waits in a training collective: the end (uneven data)",
        [view(0, hb.DONE, 400), view(1, hb.BACKWARD, 40)],
        END, (1,), "rank 1 has been waiting in backward (DDP's gradient all-reduce) for 40 s at step 6; "
        "rank 0 finished training",
    ),
    (
        "a rank waits 100 s for its background checkpoint write, the other for it: known work, no report",
        [view(0, hb.CHECKPOINT_WRITE, 100), view(1, "on_train_end", 99, collective="barrier 'x'", seq=3)],
        None, None, None,
    ),
    (
        "a rank gone during a background write: still the end",
        [view(0, hb.CHECKPOINT_WRITE, 5), view(1, hb.TRAINING_STEP, 1, gone=True)],
        END, (1,), "rank 1 is gone (its process ended; its last heartbeat: training_step at step 6); rank 0 is in "
        "background checkpoint write at step 6",
    ),
    (
        "no heartbeat yet from a rank while another waits",
        [view(0, hb.BACKWARD, 40), RankView(1, None)],
        REPORT, (1,), f"rank 1 has sent no heartbeat; {BACKWARD_0}",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("name", "views", "kind", "stuck", "line"), CASES, ids=[c[0] for c in CASES])
def test_verdict(name, views, kind, stuck, line):
    verdict = judge(views, silent_after_s=30.0)
    if kind is None:
        assert verdict is None
    else:
        assert verdict is not None and (verdict.kind, verdict.stuck, verdict.line) == (kind, stuck, line)


def test_reports_come_at_one_two_four_times_the_allowance():
    levels = [Verdict((1,), "", REPORT, over_s=t, allowance_s=3.0).level() for t in (3.1, 5.9, 6.0, 11.9, 12.5, 25)]
    assert levels == [0, 0, 1, 1, 2, 3]


def _pg(seq, op, pending):
    return {"desc": "pg", "seq": seq, "op": op, "state": "scheduled", "pending": pending}


@pytest.mark.parametrize(
    ("summaries", "ranks"),
    [
        # rank 1 in an all_gather on "extra" rank 0 never entered; rank 0 in DDP's all_reduce rank 1 never reached
        ({0: {"0": _pg(52, "ar", True)}, 1: {"0": _pg(49, "ag", False), "1": _pg(1, "ag", True)}}, (0, 1)),
        ({0: {"0": _pg(52, "ar", True)}, 1: {"0": _pg(49, "ag", False)}}, None),  # rank 1 busy: no cycle
        ({0: {"0": _pg(52, "ar", True)}, 1: {"0": _pg(52, "ar", True)}}, None),  # both in the same one
        (
            {0: {"0": _pg(52, "ar", True)}, 1: {"0": _pg(52, "ag", True)}},
            (0, 1),
        ),  # one number, two collectives
        ({0: {"0": _pg(52, "ar", True)}, 1: None}, None),  # no record from rank 1: no proof
        ({0: {"0": _pg(5, "ar", True)}, 1: {"0": _pg(4, "ar", False)}, 2: {"0": _pg(5, "ar", True)}}, None),
    ],
)
def test_a_collective_mismatch_is_a_cycle_of_waits_in_the_flight_records(summaries, ranks):
    assert deadlock(summaries) == ranks


def test_a_heartbeat_round_trips_through_the_store_encoding():
    b = beat(1, hb.BACKWARD, collective="reduce", seq=3)
    assert Heartbeat.decode(b.encode()) == b


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_writer_follows_a_batch_and_measures_steps_without_its_saves():
    clock = Clock()
    writer = HeartbeatWriter(clock)
    for step in range(6):
        writer.batch(step)
        assert writer.state[1] == hb.BATCH_START
        outer_opt = writer.enter(hb.OPTIMIZER_STEP)
        outer = writer.enter(hb.TRAINING_STEP)  # the closure
        clock.t += 0.004
        writer.leave(outer)
        outer = writer.enter(hb.BACKWARD)
        clock.t += 0.004
        writer.leave(outer)
        assert writer.state[1] == hb.OPTIMIZER_STEP and writer.state[2] == clock.t  # its own clock
        clock.t += 0.002
        writer.leave(outer_opt, stepped=True)
        assert writer.state[:2] == (step + 1, hb.DATA_WAIT)  # Lightning counts the step right after
        if step % 2:  # a 5 s save between batches: not a step's time
            outer = writer.enter(hb.CHECKPOINT_SAVE)
            writer.collective("barrier 'x'")
            assert writer.state[3:] == ("barrier 'x'", step // 2 + 1)
            writer.collective(None)
            clock.t += 5.0
            writer.leave(outer)
            assert writer.state[1] == hb.DATA_WAIT
    writer.batch(6)
    assert writer.median("step") == pytest.approx(0.010)
    assert writer.median("checkpoint") == pytest.approx(5.0)
    assert writer.allowance(hb.BACKWARD, 2.0, 30.0, 600.0) == pytest.approx(30.02)
    assert writer.allowance(hb.CHECKPOINT_SAVE, 2.0, 30.0, 600.0) == pytest.approx(40.0)
    assert writer.allowance(hb.VALIDATION, 2.0, 30.0, 600.0) == 600.0  # none yet: the first-step allowance


def test_the_first_steps_get_the_first_step_allowance():
    writer = HeartbeatWriter(Clock())
    for step in range(3):  # the first is the warm-up, excluded: two samples are not enough
        writer.batch(step)
    assert writer.median("step") is None and writer.allowance(hb.TRAINING_STEP, 2.0, 30.0, 600.0) == 600.0


def test_the_sanity_check_is_no_sample_of_a_validation():
    clock = Clock()
    writer = HeartbeatWriter(clock)
    outer = writer.enter(hb.SANITY_CHECK)
    clock.t += 0.5  # two batches
    writer.leave(outer)
    assert writer.state[1] == hb.SETUP and writer.median("validation") is None
    assert writer.allowance(hb.VALIDATION, 2.0, 30.0, 600.0) == 600.0  # the first real one: the first allowance
    outer = writer.enter(hb.VALIDATION)
    clock.t += 100.0
    writer.leave(outer)
    assert writer.allowance(hb.VALIDATION, 2.0, 30.0, 600.0) == 230.0


def test_manual_optimization_keeps_the_training_step_clock():
    clock = Clock()
    writer = HeartbeatWriter(clock)
    writer.batch(0)
    outer = writer.enter(hb.TRAINING_STEP)
    since = writer.state[2]
    clock.t += 1
    inner = writer.enter(hb.OPTIMIZER_STEP)
    writer.leave(inner)
    assert writer.state[1:3] == (hb.TRAINING_STEP, since)
    writer.leave(outer)
    assert writer.state[1] == hb.DATA_WAIT


def test_settings():
    assert WatchdogSettings.from_option(False) is None and WatchdogSettings.from_option(True) == WatchdogSettings()
    assert WatchdogSettings.from_option({"margin_s": 5}).margin_s == 5
    with pytest.raises(ValueError, match="unknown watchdog setting"):
        WatchdogSettings.from_option({"margin": 5})
    with pytest.raises(ValueError, match=r"watchdog\.factor"):
        WatchdogSettings.from_option({"factor": -1})
    with pytest.raises(ValueError, match="must be True, False or a mapping"):
        WatchdogSettings.from_option("yes")
    assert WatchdogSettings.from_option({"abort_after_s": 90}).abort_after_s == 90
    assert WatchdogSettings.from_option({"abort_after_s": None}).abort_after_s is None
    with pytest.raises(ValueError, match=r"watchdog\.abort_after_s"):
        WatchdogSettings.from_option({"abort_after_s": -1})


@pytest.mark.parametrize(
    ("backend", "environ", "env", "value"),
    [
        ("gloo", {}, {"TORCH_FR_BUFFER_SIZE": "2000"}, "TORCH_FR_BUFFER_SIZE=2000"),
        (None, {}, {}, None),
        ("nccl", {}, {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"},
         "TORCH_FR_BUFFER_SIZE=2000, TORCH_NCCL_DUMP_ON_TIMEOUT=1"),
        ("cpu:gloo,cuda:nccl", {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}, {"TORCH_FR_BUFFER_SIZE": "2000"},
         "TORCH_FR_BUFFER_SIZE=2000"),
        ("nccl", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, {}, "TORCH_NCCL_TRACE_BUFFER_SIZE=0"),
        ("nccl", {"TORCH_FR_BUFFER_SIZE": "100"}, {}, "TORCH_FR_BUFFER_SIZE=100"),
        ("gloo", {"TORCH_FR_BUFFER_SIZE": "0"}, {}, "TORCH_FR_BUFFER_SIZE=0"),  # the user's off
        ("gloo", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "16"}, {}, "TORCH_NCCL_TRACE_BUFFER_SIZE=16"),  # the older name
    ],
)  # fmt: skip
def test_the_flight_recorder_is_set_unless_the_user_set_it(backend, environ, env, value):
    decision, added = decide_flight_recorder(backend, environ)
    assert added == env
    assert (decision.value if decision is not None else None) == value
    if decision is not None:
        assert decision.setting == "flight_recorder"
        assert ("=0 to turn it off" if not environ.keys() & {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}
                else "set by the user") in decision.reason  # fmt: skip


def test_two_watchdogs_on_one_store_print_one_line_and_both_dump_their_stacks(tmp_path, capfd):
    # Two ranks' watchdogs in one process on a real store (abort=False: nothing exits): rank 1 stays in
    # training_step past its allowance while rank 0 waits in backward; reported, then ended at abort_after_s.
    import torch.distributed as dist

    from lightning_solo.ddp.watchdog import Watchdog

    store = dist.HashStore()
    settings = WatchdogSettings(margin_s=0.3, first_s=0.3, interval_s=0.05, grace_s=2, abort=False, abort_after_s=1.5)
    dogs = [Watchdog(settings, dist.PrefixStore("t/", store), r, 2, tmp_path / "hang") for r in range(2)]
    dogs[1].writer.batch(6)
    dogs[1].writer.enter(hb.TRAINING_STEP)
    dogs[0].writer.batch(6)
    dogs[0].writer.enter(hb.BACKWARD)
    for dog in dogs:
        dog.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(d.verdict for d in dogs):
        time.sleep(0.05)
    for dog in reversed(dogs):  # rank 0 last: it waits for the others' "done" (its process holds the store)
        dog.stop()
    err = capfd.readouterr().err
    lines = watchdog_lines(err)  # one line, printed by each rank
    reports = watchdog_reports(err)  # at 0.3 s and 0.6 s, each printed by each rank (1.2 s: the end came first)
    assert sorted(r for r, _ in reports) in ([0, 0, 1, 1], [0, 0, 0, 1, 1, 1]), reports
    assert sorted(lines) == [0, 1], lines
    line = lines[0]
    assert line.startswith("SoloDDP watchdog: rank 1 has been in training_step for ")
    assert "; rank 0 waits in backward (DDP's gradient all-reduce) at step 6; ended after 1.5 s (watchdog " in line
    assert all(d.verdict is not None and d.verdict.line == line for d in dogs)
    for rank in (0, 1):
        assert line in (tmp_path / "hang" / f"rank{rank}.stacks.txt").read_text()
    # "done" published at stop: a peer reads it, and no longer counts the rank
    assert {r: b.phase for r, b in dogs[0].heartbeats().items()} == {0: hb.DONE, 1: hb.DONE}


@pytest.mark.parametrize(
    ("exception", "expected"),
    [
        (
            RuntimeError("[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:27055"),
            True,
        ),
        (RuntimeError("NCCL error in: ProcessGroupNCCL.cpp, remote process exited"), True),
        (torch.distributed.DistBackendError("watchdog caught collective operation timeout"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)"), False),
        (ValueError("Connection closed by peer"), False),  # not a collective's error type
        (KeyboardInterrupt(), False),
        (None, False),
    ],
)
def test_a_collectives_failure_waits_for_the_peer_to_show_as_ended(exception, expected):
    # Only these wait (up to PEER_EXIT_WAIT_S) for a killed peer's process to show as ended: a user's own error
    # ends the run at once.
    assert peer_failure(exception) is expected


def _first_verdict_after_stall(median_s: float, steps: int, settings: WatchdogSettings) -> float:
    """Two ranks' writers on a clock, ``steps`` batches of ``median_s`` each, then rank 1 stays in training_step
    while rank 0 waits in backward: the seconds after the stall at which a judge, looking every ``interval_s`` as
    the watchdog thread does, first gets a verdict."""
    clock = Clock()
    writers = [HeartbeatWriter(clock), HeartbeatWriter(clock)]
    for step in range(steps):
        for w in writers:
            w.batch(step)
        clock.t += median_s
    for w in writers:
        w.batch(steps)
    writers[0].enter(hb.BACKWARD)
    writers[1].enter(hb.TRAINING_STEP)
    stall = clock.t
    s = settings
    while True:
        clock.t += s.interval_s
        views = [
            RankView(r, beat, age_s=beat.age_s)
            for r, w in enumerate(writers)
            for beat in [w.snapshot(r, r, "h", 0, lambda p, w=w: w.allowance(p, s.factor, s.margin_s, s.first_s))]
        ]
        if judge(views, s.silent_s) is not None:
            return clock.t - stall


@pytest.mark.parametrize("median_s", [0.01, 1.0, 10.0])
def test_the_default_settings_name_a_stall_within_two_medians_and_a_minute(median_s):
    # The issue's bound: 2 x the median step + 60 s after the stall, the flight recorder's wait included (a busy
    # rank's report, or the end a proof brings).
    from lightning_solo.ddp.watchdog.watchdog import FLIGHT_RECORD_WAIT_S

    settings = WatchdogSettings()
    after = _first_verdict_after_stall(median_s, steps=10, settings=settings)
    assert after > settings.factor * median_s + settings.margin_s  # not before the allowance
    assert after + FLIGHT_RECORD_WAIT_S <= 2 * median_s + 60, after


def test_before_the_median_is_known_the_first_step_allowance_holds():
    # The bound's one exception, stated in WatchdogSettings: the first steps (no median yet: the first one is the
    # warm-up, then three samples) get first_s.
    settings = WatchdogSettings()
    after = _first_verdict_after_stall(1.0, steps=3, settings=settings)
    assert settings.first_s < after <= settings.first_s + settings.interval_s


def test_the_watchdog_thread_reads_the_hook_and_a_loaders_first_batch_from_the_stack():
    import sys

    import lightning as L
    from lightning.pytorch.trainer import call
    from torch.utils.data import DataLoader, Dataset

    from lightning_solo.ddp.watchdog.where import LOADER_START, where

    seen = []

    class Module(L.LightningModule):
        def on_train_epoch_end(self):
            seen.append(where(sys._getframe()))

        def training_step(self, batch, batch_idx):  # a step's own hook: the phase SoloDDP marked stands
            seen.append(where(sys._getframe()))

    class Data(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            seen.append(where(sys._getframe()))
            return i

    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    module = Module()
    call._call_lightning_module_hook(trainer, "on_train_epoch_end", pl_module=module)
    call._call_lightning_module_hook(trainer, "training_step", None, 0, pl_module=module)
    loader = iter(DataLoader(Data(), batch_size=2))
    next(loader), next(loader)
    assert seen == ["on_train_epoch_end", None, LOADER_START, LOADER_START, None, None]


def test_a_refined_phase_has_its_own_clock_and_allowance():
    from lightning_solo.ddp.watchdog.heartbeat import Observer

    clock = Clock()
    writer = HeartbeatWriter(clock)
    observer = Observer(writer, clock)
    settings = (2.0, 3.0, 30.0)  # factor, margin, first
    writer.batch(0)
    writer.leave(writer.enter(hb.OPTIMIZER_STEP), stepped=True)  # now "data wait"
    clock.t += 5.0
    beat = observer.snapshot(0, 1, "h", 0, settings, "on_train_epoch_end", first=True)
    assert (beat.phase, beat.age_s, beat.allowance_s) == ("on_train_epoch_end", 0.0, 30.0)
    clock.t += 4.0
    assert observer.snapshot(0, 1, "h", 0, settings, "on_train_epoch_end", first=True).age_s == 4.0
    beat = observer.snapshot(0, 1, "h", 0, settings)  # the hook returned: the writer's phase again, its clock
    assert (beat.phase, beat.age_s) == (hb.DATA_WAIT, 9.0)
    beat = observer.snapshot(0, 1, "h", 0, settings, "on_train_epoch_end", first=False)  # the next epoch's
    assert beat.allowance_s == 2.0 * 4.0 + 3.0  # the median of those seen (4 s) and the margin
    writer.collective("barrier")
    clock.t += 2.0
    assert observer.snapshot(0, 1, "h", 0, settings, "on_train_epoch_end").wait_s == 0.0  # first seen now
    clock.t += 2.0
    assert observer.snapshot(0, 1, "h", 0, settings, "on_train_epoch_end").wait_s == 2.0
