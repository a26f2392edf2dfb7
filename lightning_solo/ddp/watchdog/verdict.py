"""The verdict on a stalled run from every rank's heartbeat (pure): ``END`` (proof of a hang), ``REPORT`` (a busy rank)
or ``SUSPECT`` (every rank waits: the flight recorder judges). What each covers: :data:`ENDS`, :data:`REPORTED`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_solo.ddp.watchdog.heartbeat import BACKWARD, CHECKPOINT_WRITE, DONE, FAILED, ORDER, Heartbeat

DDP_ALL_REDUCE = "DDP's gradient all-reduce"
# The two lists docs/multi-node.md ("When a run hangs") states word for word, and the tests assert.
ENDS = (
    "a rank's process ended",
    "a collective mismatch: a rank waits in a collective another never entered while that one waits in another "
    "(the flight recorder's records, read once every rank has waited past a step's allowance)",
    "a rank finished its fit while another waits in a collective past a step's allowance (uneven data the "
    "uneven-data policy did not settle)",
    "a reported stall still there at the collective timeout (`SoloDDP(timeout=...)`, 30 minutes by default) while "
    "another rank waits in a collective, or after `abort_after_s` when set",
)
REPORTED = (
    "a rank busy outside any collective past its phase's allowance (a step, a hook, a loader's first batch, an "
    "evaluation, a checkpoint write), however long: again at 2x, 4x the allowance",
    "a silent heartbeat (the process alive, its watchdog thread unable to run: the interpreter lock held by a long "
    "C call), with the process's state from /proc",
    "every rank waiting in a collective with no mismatch in the flight recorder's records",
)
END, REPORT, SUSPECT = "end", "report", "suspect"
# Where a rank that finished its fit never is again: the others' waits there are no proof (on_train_end runs after).
_AFTER_TRAINING = frozenset({"on_train_end", "on_fit_end", "teardown"})


@dataclass(frozen=True)
class RankView:
    """One rank as the judge sees it: its latest heartbeat (``None``: none yet), ``age_s`` in that phase by now,
    ``silent_s`` since its heartbeat moved, whether it is ``gone``, ``proc``: its state in ``/proc`` once silent."""

    rank: int
    beat: Heartbeat | None
    age_s: float = 0.0
    silent_s: float = 0.0
    gone: bool = False
    proc: str | None = None

    @property
    def wait_s(self) -> float:
        """Seconds in the collective it waits in, by now."""
        beat = self.beat
        return beat.wait_s + (self.age_s - beat.age_s) if beat is not None and beat.wait_s > 0 else 0.0


@dataclass(frozen=True)
class Verdict:
    """``stuck``: the ranks named; ``over_s`` / ``allowance_s``: how long they have been there and their allowance;
    ``peers_wait_s``: the longest wait in a collective (the timeout runs on it); ``key``: the stall, at every look."""

    stuck: tuple[int, ...]
    line: str
    kind: str = END
    over_s: float = 0.0
    allowance_s: float = 0.0
    peers_wait_s: float = 0.0
    key: str = ""

    def level(self) -> int:
        """Reports come at 1x, 2x, 4x ... the allowance: the power of two reached."""
        if self.allowance_s <= 0 or self.over_s < self.allowance_s:
            return 0
        return int(math.log2(self.over_s / self.allowance_s))


def _waits(beat: Heartbeat) -> str | None:
    """The collective a rank waits in, if any is known."""
    if beat.collective is not None:
        return f"{beat.collective} (collective #{beat.seq}, in {beat.phase})"
    return f"{BACKWARD} ({DDP_ALL_REDUCE})" if beat.phase == BACKWARD else None


def _position(beat: Heartbeat) -> tuple[int, float]:
    # A collective runs inside its phase: after the phase's own work, before the next phase.
    return beat.step, ORDER.get(beat.phase, 0) + (0.5 if beat.collective is not None else 0.0)


def _describe_stuck(view: RankView, silent_after_s: float) -> str:
    beat = view.beat
    if beat is None:
        return f"rank {view.rank} has sent no heartbeat"
    where = f"{beat.phase} at step {beat.step}"
    if view.gone:
        return f"rank {view.rank} is gone (its process ended; its last heartbeat: {where})"
    proc = f"; its process is alive: {view.proc}" if view.proc else ""
    if view.silent_s > silent_after_s:
        return f"rank {view.rank} has been silent for {view.silent_s:.0f} s (last seen in {where}{proc})"
    silent = f" (its heartbeat silent for {view.silent_s:.0f} s{proc})" if proc else ""
    if (waits := _waits(beat)) is not None:
        return f"rank {view.rank} has been waiting in {waits} for {view.age_s:.0f} s at step {beat.step}{silent}"
    return f"rank {view.rank} has been in {beat.phase} for {view.age_s:.0f} s at step {beat.step}{silent}"


def _describe_other(view: RankView) -> str:
    beat = view.beat
    assert beat is not None
    if beat.phase == DONE:
        return f"rank {view.rank} finished training"
    if beat.phase == FAILED:
        return f"rank {view.rank} ended with an error (in {beat.collective})"
    if (where := _waits(beat)) is not None:
        return f"rank {view.rank} waits in {where} at step {beat.step}"
    return f"rank {view.rank} is in {beat.phase} at step {beat.step}"


def _verdict(
    views: Sequence[RankView], stuck: Sequence[RankView], kind: str, silent_after_s: float, over_s: float = 0.0,
    allowance_s: float = 0.0,
) -> Verdict:  # fmt: skip
    stuck_ranks = tuple(v.rank for v in stuck)
    parts = [_describe_stuck(v, silent_after_s) for v in stuck]
    others = [v for v in views if v.rank not in stuck_ranks and v.beat is not None]
    parts += [_describe_other(v) for v in others]
    peers = [v.wait_s for v in views if v.beat is not None and v.beat.phase not in (DONE, FAILED)]
    # A heartbeat that stopped moving is a stall of its own (a stale phase may have been reported already).
    key = ",".join(
        f"{v.rank}:{v.beat.phase}@{v.beat.step}{'/silent' if v.proc else ''}" if v.beat else f"{v.rank}:-"
        for v in stuck
    )
    return Verdict(stuck_ranks, "; ".join(parts), kind, over_s, allowance_s, max(peers, default=0.0), key)


def judge(views: Sequence[RankView], silent_after_s: float = float("inf")) -> Verdict | None:
    """The verdict, or ``None`` while no rank is past its allowance (or silent ``silent_after_s``) and none is gone."""
    views = sorted(views, key=lambda v: v.rank)
    active = [v for v in views if v.beat is None or v.beat.phase not in (DONE, FAILED)]
    if gone := [v for v in active if v.gone]:
        return _verdict(views, gone, END, silent_after_s)
    silent = [v for v in active if v.silent_s > silent_after_s or v.proc is not None]
    waiting = [v for v in active if v.beat is not None and _waits(v.beat) is not None and v not in silent]
    busy = [v for v in active if v.beat is not None and v not in waiting]
    late = [v for v in waiting if v.wait_s > v.beat.wait_allowance_s]  # type: ignore[union-attr]
    finished = [v for v in views if v.beat is not None and v.beat.phase in (DONE, FAILED)]
    if finished and (proof := [v for v in late if v.beat.phase not in _AFTER_TRAINING]):  # type: ignore[union-attr]
        return _verdict(views, proof, END, silent_after_s)
    if any(v.beat is not None and v.beat.phase == CHECKPOINT_WRITE for v in active):
        return None  # a rank waits for its background checkpoint write, the others for it: work, not a stall
    # A heartbeat published late (the interpreter lock held) tells of a phase that may be over: the next one says.
    late_beat = [v for v in busy if v.beat is not None and v.beat.late]
    if over := [
        v for v in busy
        if v.silent_s > silent_after_s or (v.age_s > v.beat.allowance_s and v not in late_beat)  # type: ignore[union-attr]
    ]:  # fmt: skip
        return _verdict(
            views, over, REPORT, silent_after_s, max(v.age_s for v in over),
            min(v.beat.allowance_s for v in over),  # type: ignore[union-attr]
        )  # fmt: skip
    if busy or not late:  # (busy: the others wait for a rank still within its own allowance)
        return None
    if missing := [v for v in active if v.beat is None]:
        return _verdict(views, missing, REPORT, silent_after_s, max(v.wait_s for v in late),
                        min(v.beat.wait_allowance_s for v in late))  # type: ignore[union-attr]  # fmt: skip
    if len(late) < len(active):
        return None
    first = min(_position(v.beat) for v in active)  # type: ignore[arg-type]
    stuck = [v for v in active if _position(v.beat) == first]  # type: ignore[arg-type]
    return _verdict(
        views, stuck, SUSPECT, silent_after_s, max(v.wait_s for v in stuck),
        min(v.beat.wait_allowance_s for v in stuck),  # type: ignore[union-attr]
    )  # fmt: skip
