"""The watchdog ends only proven hangs: the fault suite's healthy half (tests/test_watchdog.py holds the hung half).

Healthy but slow (tests/scripts/hang_fit.py ``healthy``): one 2-process gloo run in which a rank works 6 s, twice
the scaled margin (the defaults' 55 s margin and 60-120 s of work, scaled together), in eight places one after
another: rank 0 behind ``is_global_zero`` in ``on_train_epoch_end``, ``on_validation_epoch_end`` and
``on_train_end``; rank 0's first checkpoint write; an evaluation slow on one epoch; rank 1's loader worker,
re-spawned each epoch, in ``worker_init_fn``; one ``training_step`` of rank 1 (a recompile); and one C call that
holds the interpreter lock. Under ``SoloDDP()`` it finishes as under stock ``DDPStrategy()`` (the two run side by
side): exit 0, the same final weights, and a report line (never an end) where the work outlasted its allowance.
At the default thresholds (``slow``): 70 s in ``on_train_epoch_end`` is reported at ~55 s and the run finishes;
a collective mismatch ends its run within 2 x median step + 60 s."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_solo.ddp.watchdog import HANG_EXIT_CODE
from lightning_solo.ddp.watchdog.verdict import ENDS, REPORTED
from tests.helpers import REPO
from tests.helpers.hang_runs import fault_runs, finish_all, start
from tests.helpers.records import watchdog_lines, watchdog_reports
from tests.test_watchdog import BOUND_S, verdict_line

# What each slow place is reported as (the first report's words), and the places whose first occurrence gets the
# first-time allowance (30 s scaled) and so is not reported. Each case's list in docs/multi-node.md: REPORTED.
REPORTED_AS = {
    "a training step (a recompile)": r"rank 1 has been in training_step for (\d+) s at step 20; rank 0 waits in "
    r"backward \(DDP's gradient all-reduce\)",
    "rank 0 in on_train_epoch_end": r"rank 0 has been in on_train_epoch_end for (\d+) s at step 32; rank 1 waits in",
    "rank 0 in on_validation_epoch_end": r"rank 0 has been in on_validation_epoch_end for (\d+) s at step 32; "
    r"rank 1 waits in",
    "a long evaluation": r"rank [01] has been in validation for (\d+) s at step 48",
    "a loader worker's start": r"rank 1 has been in loader start for (\d+) s at step 48; rank 0 waits in backward",
    # The phase is the last heartbeat's (the thread cannot run while the C call holds the lock)
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
def test_slow_but_healthy_runs_finish_as_under_stock_with_a_report_where_work_outlasted_its_allowance(
    tmp_path_factory,
):
    # Started with test_watchdog.py's hung runs, once they have stalled (helpers/hang_runs.py).
    runs = fault_runs(tmp_path_factory.mktemp("faults"))
    (out_stock, (stock, _, _)), (out_solo, (solo, _, _)) = runs["stock"], runs["solo"]
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
@pytest.mark.timeout(300)
def test_at_the_default_thresholds(tmp_path):
    # 70 s in on_train_epoch_end: reported at ~55 s, finished as under stock; a collective mismatch: ended in time.
    env = {"DEFAULTS": "1", "EVENTS": "epoch_end"}
    runs = {name: (tmp_path / name, start(tmp_path / name, mode, env=env))
            for name, mode in (("stock", "healthy_stock"), ("solo", "healthy"), ("extra", "extra"))}  # fmt: skip
    results = finish_all(runs, 260)
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
