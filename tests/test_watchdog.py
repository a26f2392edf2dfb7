"""The watchdog (:mod:`lightning_solo.ddp.watchdog`) ends only proven hangs; tests/scripts/hang_fit.py makes each
fault, in 2-process runs (popen launcher, SoloDDP's defaults, small watchdog thresholds) started together
(tests/helpers/hang_runs.py) that end in about the time of the longest.

Hung: the run ends with ONE line naming the stuck rank and its phase, every live rank's Python stacks in
``<default_root_dir>/hang/``, and exit status 86. Proof of a hang (a rank's process ended, a collective mismatch)
ends it within seconds; a rank busy forever outside any collective (asleep in ``training_step``, a loader worker or
a checkpoint write that never returns) is reported at its allowance and the run ended at the collective timeout
(``SoloDDP(timeout=45 s)`` here) with that line instead of gloo's. Stock ``DDPStrategy`` waits the whole timeout
and names no rank.

Healthy but slow (``healthy``): a rank works 6 s, twice the scaled margin (the defaults' 55 s margin and 60-120 s of
work, scaled together), in eight places one after another: rank 0 behind ``is_global_zero`` in
``on_train_epoch_end``, ``on_validation_epoch_end`` and ``on_train_end``; rank 0's first checkpoint write; an
evaluation slow on one epoch; rank 1's loader worker, re-spawned each epoch, in ``worker_init_fn``; one
``training_step`` of rank 1 (a recompile); and one C call that holds the interpreter lock. Under ``SoloDDP()`` it
finishes as under stock ``DDPStrategy()`` (the two run side by side): exit 0, the same final weights, and a report
line (never an end) where the work outlasted its allowance. At the default thresholds (``slow``): 70 s in
``on_train_epoch_end`` is reported at ~55 s and the run finishes; a collective mismatch ends its run within
2 x median step + 60 s.

One file, so that one test process starts the fault runs once for both halves."""

from __future__ import annotations

import itertools
import json
import re
import subprocess

import pytest
import torch

from lightning_solo import SoloDDP
from lightning_solo.checkpoint import verify
from lightning_solo.checkpoint.select import find_latest_valid
from lightning_solo.ddp.watchdog import HANG_EXIT_CODE
from lightning_solo.ddp.watchdog.verdict import ENDS, REPORTED
from tests.helpers import REPO
from tests.helpers.hang_runs import TIMEOUT_S, fault_runs, finish_all, run, start
from tests.helpers.records import watchdog_lines, watchdog_reports

MARGIN_S = 3.0  # the script's watchdog margin (factor 2 x a ~15 ms median step adds little)
BOUND_S = 2 * 0.015 + 60  # the defaults' promise: 2 x median step + 60 s after the stall


@pytest.fixture(scope="module")
def hung(tmp_path_factory):
    """Every hung run, started together (their processes mostly sleep): mode -> (its dir, the result)."""
    return fault_runs(tmp_path_factory.mktemp("faults"))


def verdict_line(proc: subprocess.CompletedProcess, ranks: tuple[int, ...] = (0, 1)) -> str:
    """The one line, printed by each live rank (``ranks``: the stuck one too, from its watchdog thread)."""
    lines = watchdog_lines(proc.stdout + proc.stderr)
    assert sorted(lines) == sorted(ranks), proc.stdout[-4000:]
    return lines[ranks[0]]


def assert_stacks(out, ranks, frame: str) -> None:
    """Each live rank's stacks, every thread; the stuck rank's show where it stalled."""
    for rank in ranks:
        text = (out / "hang" / f"rank{rank}.stacks.txt").read_text()
        assert text.startswith(f"rank {rank} (pid ") and "Thread 0x" in text, text[:500]
    stuck = (out / "hang" / f"rank{ranks[0]}.stacks.txt").read_text()
    assert frame in stuck, stuck


def assert_hang(hung, mode: str, expected: str, frame: str, stuck: int = 1, report: bool = True, lead: str = "") -> str:
    """``report``: a busy rank, reported at its allowance and ended at the collective timeout; else proof, ended
    at once."""
    out, (proc, elapsed, stall) = hung[mode]
    assert proc.returncode == HANG_EXIT_CODE, proc.stdout[-4000:]
    line = verdict_line(proc)
    assert stall["rank"] == stuck and line.startswith(f"SoloDDP watchdog: {lead}rank {stuck} {expected}"), line
    assert (out / "hang" / "verdict.txt").read_text().strip() in line
    assert_stacks(out, [stuck, 1 - stuck], frame)
    reports = watchdog_reports(proc.stdout)
    if report:  # reported at the allowance (1x, 2x, 4x), ended at the timeout with the diagnosis, before gloo's
        assert f"; ended at the collective timeout ({TIMEOUT_S:g} s)" in line, line
        # Each rank printed each report once; the first at the allowance (3 s and a median), then at 2x, 4x ...
        texts = [text for rank, text in reports if rank == stuck]
        assert sorted(texts) == sorted(text for rank, text in reports if rank != stuck), reports
        head = f"SoloDDP watchdog report: rank {stuck} {expected} "
        seconds = [int(text.removeprefix(head).split(" s ", 1)[0]) for text in texts]
        assert all(t.startswith(head) for t in texts) and 3 <= seconds[0] <= 8, texts
        assert all(1.6 < b / a < 2.5 for a, b in itertools.pairwise(seconds)) and len(seconds) >= 3, seconds
        assert TIMEOUT_S - 8 < elapsed < TIMEOUT_S + 12, (elapsed, line)
    else:  # proof: within the margin (and the promise of the defaults)
        assert not reports, reports
        assert MARGIN_S < elapsed < min(MARGIN_S + 12, BOUND_S), (elapsed, line)
    print(f"{mode}: ended {elapsed:.1f} s after the stall: {line}")  # pytest -s: benchmarks/RESULTS.md's table
    return line


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_rank_asleep_in_training_step(hung):
    line = assert_hang(hung, "sleep", "has been in training_step for", "in training_step")
    assert "at step 6; rank 0 waits in backward (DDP's gradient all-reduce) at step 6" in line
    assert "; flight recorder: rank 0 issued gloo:all_reduce #" in line and "which rank 1 never entered" in line


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_the_job_exits_86_when_the_rank_that_started_the_others_is_slow_to_exit(hung):
    # Rank 1 waits for rank 0, its parent, to exit first: had it exited first, Lightning's process observer in
    # rank 0 would have seen a child end with an error and SIGKILLed rank 0 (exit status -9).
    _, (proc, _, stall) = hung["slow_exit"]
    assert proc.returncode == HANG_EXIT_CODE, proc.stdout[-4000:]
    assert stall["rank"] == 1 and verdict_line(proc).startswith("SoloDDP watchdog: rank 1 has been in training_step")
    assert "Forcefully terminating" not in proc.stdout, proc.stdout[-4000:]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_loader_worker_blocked_in_getitem(hung):
    line = assert_hang(hung, "loader", "has been in data wait for", "_next_data")
    assert "rank 0 waits in backward (DDP's gradient all-reduce)" in line


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_rank_issuing_one_extra_collective(hung):
    line = assert_hang(
        hung, "extra", "has been waiting in all_gather (collective #", "all_gather", report=False,
        lead="collective mismatch: ",
    )  # fmt: skip
    assert "in training_step) for" in line
    assert "rank 0 waits in backward (DDP's gradient all-reduce)" in line
    # The flight recorder's evidence, first for the rank named: its extra collective, which rank 0 never entered.
    assert "; flight recorder: rank 1 issued gloo:all_gather #1 on extra, which rank 0 never entered (" in line
    assert "rank 0 issued gloo:all_reduce #" in line  # DDP's, which rank 1 never reached
    out = hung["extra"][0]
    for rank in (0, 1):
        record = json.loads((out / "hang" / f"rank{rank}.fr.json").read_text())
        assert record["entries"] and "hang/rank*.fr.json" in line


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_stalled_checkpoint_write_leaves_the_newest_verified_checkpoint(hung):
    line = assert_hang(hung, "checkpoint", "has been in checkpoint save for", "__reduce__", stuck=0)
    assert "at step 6; rank 1 waits in barrier 'Trainer.save_checkpoint'" in line
    # The stalled write left its temporary file only; resume=auto continues from step 4's, which verifies.
    ckpt = hung["checkpoint"][0] / "ckpt"
    assert not (ckpt / "step=6.ckpt").exists() and any("solo-tmp" in p.name for p in ckpt.iterdir()), list(
        ckpt.iterdir()
    )
    assert find_latest_valid(ckpt) == str(ckpt / "step=4.ckpt")
    verify(ckpt / "step=4.ckpt")


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_rank_that_finished_its_fit_while_another_waits_in_a_training_collective(hung):
    # Uneven data the policy does not settle (uneven_data=False, map-style loaders of 8 and 16 batches): rank 1
    # finished its fit and went on, rank 0 waits in its ninth step's all-reduce. Proof: ended at a step's allowance.
    out, (proc, elapsed, _) = hung["uneven"]
    assert proc.returncode == HANG_EXIT_CODE, proc.stdout[-4000:]
    line = verdict_line(proc, ranks=(0,))  # rank 1's watchdog ended with its fit
    assert line.startswith(
        "SoloDDP watchdog: rank 0 has been waiting in backward (DDP's gradient all-reduce) for "
    ) and line.split("; flight recorder")[0].endswith("at step 8; rank 1 finished training"), line
    assert_stacks(out, [0], "backward")
    assert MARGIN_S < elapsed < min(MARGIN_S + 12, BOUND_S), (elapsed, line)
    print(f"uneven: ended {elapsed:.1f} s after the stall: {line}")


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_a_rank_killed_with_sigkill(hung):
    # gloo fails rank 0's all-reduce at once ("Connection closed by peer", no rank named); the line names rank 1.
    out, (proc, elapsed, _) = hung["kill"]
    assert proc.returncode in (1, HANG_EXIT_CODE), proc.stdout[-4000:]
    line = verdict_line(proc, ranks=(0,))
    assert line.startswith("SoloDDP watchdog: rank 1 is gone (its process ended; its last heartbeat: "), line
    assert "rank 0 waits in backward (DDP's gradient all-reduce) at step 6" in line
    assert_stacks(out, [0], "Thread 0x")
    assert elapsed < 20, elapsed  # about 5 s alone; the other runs share the two cores
    print(f"kill: ended {elapsed:.1f} s after the stall: {line}")


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_stock_ddp_waits_the_whole_timeout_and_names_no_rank(tmp_path):
    # DDPStrategy(timeout=8 s), rank 1 asleep 12 s in training_step: rank 0 fails only after the timeout.
    proc, _, stall = run(tmp_path, "stock")
    end = json.loads((tmp_path / "end.json").read_text())
    assert proc.returncode != 0 and end["ended"] == "RuntimeError", end
    assert end["t"] - stall["t"] >= 8, (end, stall)
    assert "rank 1" not in end["message"] and "Rank 1" not in end["message"], end["message"]


def test_the_watchdog_is_a_decision_with_a_switch():
    assert SoloDDP().decisions["watchdog"].value is True
    off = SoloDDP(watchdog=False)
    assert off.decisions["watchdog"].value is False and off.heartbeats() == {}
    assert "median of its phase + 5 s" in SoloDDP(watchdog={"margin_s": 5}).decisions["watchdog"].reason
    assert "after 60 s (abort_after_s)" in SoloDDP(watchdog={"abort_after_s": 60}).decisions["watchdog"].reason


# The healthy half. What each slow place is reported as (the first report's words), and the places whose first
# occurrence gets the first-time allowance (30 s scaled) and so is not reported. Each case's list in
# docs/multi-node.md: REPORTED.
REPORTED_AS = {
    "a training step (a recompile)": r"rank 1 has been in training_step for (\d+) s at step 20; rank 0 waits in "
    r"backward \(DDP's gradient all-reduce\)",
    "rank 0 in on_train_epoch_end": r"rank 0 has been in on_train_epoch_end for (\d+) s at step 32; rank 1 waits in",
    "rank 0 in on_validation_epoch_end": r"rank 0 has been in on_validation_epoch_end for (\d+) s at step 32; "
    r"rank 1 waits in",
    "a long evaluation": r"rank [01] has been in validation for (\d+) s at step 48",
    "a loader worker's start": r"rank 1 has been in loader start for (\d+) s at step 48; rank 0 waits in backward",
    # The phase is the last heartbeat's (the thread cannot run while the C call holds the lock); reported once
    # the heartbeat has stopped for a few periods: the seconds are the silence's.
    "a C call holding the GIL": r"rank 1 has been (?:in|waiting in) [^;]+? for \d+ s at step \d+ \(its heartbeat "
    r"silent for (\d+) s; its process is alive: state S \(sleeping\)",
}
NOT_REPORTED = ("on_train_end", "checkpoint save")  # first occurrences: 6 s is within first_s


def _weights(out):
    return torch.load(out / "weights.pt", weights_only=True)


def assert_same_run(stock, solo, out_stock, out_solo) -> None:
    for proc in (stock, solo):
        assert proc.returncode == 0, proc.stdout[-4000:]
    assert watchdog_lines(solo.stdout) == {}, solo.stdout[-4000:]  # nothing ended
    a, b = _weights(out_stock), _weights(out_solo)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_slow_but_healthy_runs_finish_as_under_stock_with_a_report_where_work_outlasted_its_allowance(hung):
    # Started with the hung runs, once they have stalled (helpers/hang_runs.py).
    (out_stock, (stock, _, _)), (out_solo, (solo, _, _)) = hung["stock"], hung["solo"]
    assert_same_run(stock, solo, out_stock, out_solo)
    printed = watchdog_reports(solo.stdout)
    reports = sorted({text for _, text in printed})  # each printed by each rank still in its fit
    assert len(printed) == len(set(printed)) and len(printed) >= 2 * len(reports) - 2, printed
    seconds = {}
    for case, pattern in REPORTED_AS.items():
        found = [m for text in reports if (m := re.search("SoloDDP watchdog report: " + pattern, text))]
        assert found, (case, reports)
        seconds[case] = int(found[0].group(1))
        low = 1 if case == "a C call holding the GIL" else 3  # its allowance (3 s, or a median more)
        assert low <= seconds[case] <= 6, (case, found[0].group(0))
    assert all("not ended" in text for text in reports)
    assert not [text for text in reports for place in NOT_REPORTED if f"has been in {place}" in text], reports
    print(f"healthy: stock and SoloDDP exit 0, same weights; reported after {seconds}")


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_at_the_default_thresholds(tmp_path):
    # 70 s in on_train_epoch_end: reported at ~55 s, finished as under stock; a collective mismatch: ended in time.
    env = {"DEFAULTS": "1", "EVENTS": "epoch_end"}
    runs = {name: (tmp_path / name, start(tmp_path / name, mode, env=env))
            for name, mode in (("stock", "healthy_stock"), ("solo", "healthy"), ("extra", "extra"))}  # fmt: skip
    results = finish_all(runs, 420)  # ~90 s alone; a loaded machine's margin
    assert_same_run(results["stock"][0], results["solo"][0], tmp_path / "stock", tmp_path / "solo")
    reports = watchdog_reports(results["solo"][0].stdout)
    assert reports and reports[0][1].startswith("SoloDDP watchdog report: rank 0 has been in on_train_epoch_end for 5")
    proc, elapsed, _ = results["extra"]
    assert proc.returncode == HANG_EXIT_CODE, proc.stdout[-4000:]
    assert verdict_line(proc).startswith("SoloDDP watchdog: collective mismatch: rank 1 has been waiting in all_gather")
    assert 55 < elapsed < BOUND_S, elapsed
    print(f"defaults: on_train_epoch_end reported: {reports[0][1][:120]}; mismatch ended {elapsed:.1f} s after")


def test_the_two_lists_what_ends_a_run_and_what_is_only_reported_are_the_docs():
    docs = (REPO / "docs" / "multi-node.md").read_text()
    section = docs.split("## When a run hangs", 1)[1].split("\n## ", 1)[0]
    for heading, items in (("What ends a run", ENDS), ("What is only reported", REPORTED)):
        assert f"| {heading}" in section or f"{heading}" in section, heading
        for item in items:
            assert item in section, item
    # The cases of the fault suite, each on its list.
    assert "a rank's process ended" in ENDS and "a collective mismatch" in ENDS[1]
    assert any("busy outside any collective" in item for item in REPORTED)
    assert any("silent heartbeat" in item for item in REPORTED)
