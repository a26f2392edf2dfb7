"""The flight recorder's clause in the watchdog's line (:func:`lightning_solo.ddp.watchdog.flight_recorder.clause`):
a table over summaries of real dumps (tests/scripts/fr_dumps.py: 2 gloo processes, one rank issuing a collective the
other never enters, on one group and then on two), and edge cases made from them (a rank with no record, a recorder
that is off, every rank waiting, NCCL's states)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lightning_solo.ddp.watchdog.flight_recorder import clause, summarize
from tests.helpers import REPO
from tests.helpers.records import watchdog_lines

MOMENTS = ("agree", "extra", "two_groups")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Every rank's dump (torch's JSON) at each moment of fr_dumps.py."""
    out = tmp_path_factory.mktemp("fr")
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "64", "PYTHONPATH": str(REPO)}
    script = REPO / "tests" / "scripts" / "fr_dumps.py"
    done = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return {m: {r: (out / f"rank{r}.{m}.json").read_bytes() for r in (0, 1)} for m in MOMENTS}


@pytest.fixture(scope="module")
def real(dumps):
    """Every rank's summary at each moment of fr_dumps.py."""
    return {m: {r: summarize(d) for r, d in by_rank.items()} for m, by_rank in dumps.items()}


def _with(summary, pg, **changes):
    return {**summary, pg: {**summary[pg], **changes}}


def _without(summary, pg):
    return {k: v for k, v in summary.items() if k != pg}


DEFAULT = "0"  # the default group's name; "1" is the "side" group fr_dumps.py makes
CASES = [
    # (name, summaries from the real ones, lead, the clause)
    ("every rank at the same collective", lambda s: s["agree"], (),
     "flight recorder: nothing in flight; every rank at gloo:broadcast #2 on default_pg"),
    ("one rank issued a collective the other never entered", lambda s: s["extra"], (1,),
     "flight recorder: rank 1 issued gloo:all_reduce #3 on default_pg, which rank 0 never entered "
     "(rank 0's last there: gloo:broadcast #2)"),
    ("one extra collective on each of two groups: the named rank's first", lambda s: s["two_groups"], (0,),
     "flight recorder: rank 0 issued gloo:all_reduce #2 on side, which rank 1 never entered "
     "(rank 1's last there: gloo:barrier #1); rank 1 issued gloo:all_reduce #3 on default_pg, which rank 0 never "
     "entered (rank 0's last there: gloo:broadcast #2)"),
    ("... and the other way round", lambda s: s["two_groups"], (1,),
     "flight recorder: rank 1 issued gloo:all_reduce #3 on default_pg, which rank 0 never entered "
     "(rank 0's last there: gloo:broadcast #2); rank 0 issued gloo:all_reduce #2 on side, which rank 1 never "
     "entered (rank 1's last there: gloo:barrier #1)"),
    ("a group one rank has no record of", lambda s: {0: s["two_groups"][0], 1: _without(s["two_groups"][1], "1")},
     (0,), "flight recorder: rank 0 issued gloo:all_reduce #2 on side, which rank 1 never entered (rank 1 has none "
     "recorded there); rank 1 issued gloo:all_reduce #3 on default_pg, which rank 0 never entered (rank 0's last "
     "there: gloo:broadcast #2)"),
    ("a rank with no dump (gone, silent)", lambda s: {0: None, 1: s["extra"][1]}, (1,),
     "flight recorder: rank 1 waits in gloo:all_reduce #3 on default_pg; no record from rank 0"),
    ("the waiting rank with no dump", lambda s: {0: s["extra"][0], 1: None}, (1,),
     "flight recorder: nothing in flight; rank 0 at gloo:broadcast #2 on default_pg; "
     "rank 0 at gloo:barrier #1 on side; no record from rank 1"),
    ("every rank waits in the same collective", lambda s: {0: s["extra"][1], 1: s["extra"][1]}, (),
     "flight recorder: every rank waits in gloo:all_reduce on default_pg (#3)"),
    ("every rank waits, at different numbers",
     lambda s: {0: _with(s["extra"][1], DEFAULT, seq=5), 1: s["extra"][1]}, (),
     "flight recorder: every rank waits in gloo:all_reduce on default_pg (rank 0 #5, rank 1 #3)"),
    ("every rank waits, in different collectives",
     lambda s: {0: _with(s["extra"][1], DEFAULT, op="gloo:broadcast"), 1: s["extra"][1]}, (),
     "flight recorder: the ranks wait in different collectives on default_pg: rank 0 gloo:broadcast #3, "
     "rank 1 gloo:all_reduce #3"),
    ("NCCL's state is said", lambda s: {0: s["extra"][0], 1: _with(s["extra"][1], DEFAULT, state="started")}, (1,),
     "flight recorder: rank 1 issued gloo:all_reduce #3 (started) on default_pg, which rank 0 never entered "
     "(rank 0's last there: gloo:broadcast #2)"),
    ("recorded nothing (buffer size 0)", lambda s: {0: {}, 1: {}}, (), None),
    ("no record from any rank", lambda s: {0: None, 1: None}, (), None),
]  # fmt: skip


@pytest.mark.multiproc
@pytest.mark.timeout(90)
@pytest.mark.parametrize(("name", "summaries", "lead", "expected"), CASES, ids=[c[0] for c in CASES])
def test_the_clause(real, name, summaries, lead, expected):
    assert clause(summaries(real), lead=lead) == expected


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_a_summary_keeps_each_groups_last_collective_and_whether_it_is_in_flight(real):
    assert real["extra"][1][DEFAULT] == {
        "desc": "default_pg", "seq": 3, "op": "gloo:all_reduce", "state": "scheduled", "pending": True,
    }  # fmt: skip
    assert real["extra"][0][DEFAULT]["pending"] is False


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_the_watchdog_adds_the_clause_and_writes_each_ranks_record(dumps, tmp_path, capfd):
    # Two ranks' watchdogs in one process on a real store (abort=False: nothing exits), each reading its rank's
    # real dump at the "two_groups" moment (each rank in a collective the other never entered): rank 1 waits in
    # training_step's all_gather, rank 0 in backward. Every rank waits: the judge reads the records, finds the
    # mismatch and ends the run.
    import time

    import torch.distributed as dist

    from lightning_solo.ddp.watchdog import Watchdog, WatchdogSettings
    from lightning_solo.ddp.watchdog import heartbeat as hb

    store = dist.HashStore()
    settings = WatchdogSettings(margin_s=0.3, first_s=0.3, interval_s=0.05, grace_s=2, abort=False)
    dogs = [
        Watchdog(
            settings,
            dist.PrefixStore("t/", store),
            r,
            2,
            tmp_path / "hang",
            lambda r=r: dumps["two_groups"][r],
        )
        for r in range(2)
    ]
    dogs[1].writer.enter(hb.TRAINING_STEP)
    dogs[1].writer.collective("all_gather")
    dogs[0].writer.enter(hb.BACKWARD)
    for dog in dogs:
        dog.start()
    deadline = time.monotonic() + 10
    # verdict.txt comes last: after the printing judge had the other's summary
    while time.monotonic() < deadline and not (tmp_path / "hang" / "verdict.txt").exists():
        time.sleep(0.05)
    for dog in reversed(dogs):
        dog.stop()
    lines = watchdog_lines(capfd.readouterr().err)
    assert sorted(lines) == [0, 1], lines  # each rank printed the whole line, flight recorder included
    line = lines[0]
    assert line.startswith("SoloDDP watchdog: collective mismatch: rank 1 has been waiting in all_gather"), line
    words = clause({r: summarize(dumps["two_groups"][r]) for r in (0, 1)}, lead=(1,))
    assert words is not None and f"; {words}. Python stacks: " in line, line
    assert line.endswith("flight recorder: " + str(tmp_path / "hang") + "/rank*.fr.json."), line
    assert (tmp_path / "hang" / "verdict.txt").read_text().strip() == line
    for rank in (0, 1):
        assert (tmp_path / "hang" / f"rank{rank}.fr.json").read_bytes() == dumps["two_groups"][rank]
