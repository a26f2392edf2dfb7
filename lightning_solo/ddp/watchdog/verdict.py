"""The verdict on a stalled run, from every rank's heartbeat: pure (no clock, no store), table-tested.

Example::

    views = [RankView(0, beat0, age_s=95.0), RankView(1, beat1, age_s=94.0)]
    verdict = judge(views)          # None while every rank is within its allowance
    print(verdict.line)             # rank 1 has been in training_step for 94 s at step 6; rank 0 waits in ...

Who is named: a rank whose process ended or that fell silent; else the ranks not waiting in a collective (a rank
in ``backward`` waits in DDP's gradient all-reduce); else, every rank waiting in one, those least far along
(step, then phase: a collective one rank issued and the others did not waits behind the others' next one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_solo.ddp.watchdog.heartbeat import BACKWARD, DONE, FAILED, ORDER, Heartbeat

DDP_ALL_REDUCE = "DDP's gradient all-reduce"


@dataclass(frozen=True)
class RankView:
    """One rank as the judge sees it: its latest heartbeat (``None``: none yet), how long it has been in that
    phase by now (``age_s``), how long its heartbeat has not moved (``silent_s``), whether its process ended."""

    rank: int
    beat: Heartbeat | None
    age_s: float = 0.0
    silent_s: float = 0.0
    gone: bool = False


@dataclass(frozen=True)
class Verdict:
    stuck: tuple[int, ...]
    line: str


def _waits(beat: Heartbeat) -> str | None:
    """The collective a rank waits in, if any is known."""
    if beat.collective is not None:
        return f"{beat.collective} (collective #{beat.seq}, in {beat.phase})"
    return f"{BACKWARD} ({DDP_ALL_REDUCE})" if beat.phase == BACKWARD else None


def _position(beat: Heartbeat) -> tuple[int, float]:
    # A collective runs inside its phase: after the phase's own work, before the next phase.
    return beat.step, ORDER.get(beat.phase, 0) + (0.5 if beat.collective is not None else 0.0)


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _describe_stuck(view: RankView, silent_after_s: float) -> str:
    beat = view.beat
    if beat is None:
        return f"rank {view.rank} has sent no heartbeat"
    where = f"{beat.phase} at step {beat.step}"
    if view.gone:
        return f"rank {view.rank} is gone (its process ended; its last heartbeat: {where})"
    if view.silent_s > silent_after_s:
        return f"rank {view.rank} has been silent for {view.silent_s:.0f} s (last seen in {where})"
    if (waits := _waits(beat)) is not None:
        return f"rank {view.rank} has been waiting in {waits} for {view.age_s:.0f} s at step {beat.step}"
    return f"rank {view.rank} has been in {beat.phase} for {view.age_s:.0f} s at step {beat.step}"


def _describe_other(view: RankView) -> str:
    beat = view.beat
    assert beat is not None
    if beat.phase == DONE:
        return f"rank {view.rank} finished training"
    if beat.phase == FAILED:
        return f"rank {view.rank} ended with an error (in {beat.collective})"
    where = _waits(beat)
    return (
        f"rank {view.rank} waits in {where} at step {beat.step}"
        if where is not None
        else f"rank {view.rank} is in {beat.phase} at step {beat.step}"
    )


def judge(views: Sequence[RankView], silent_after_s: float = float("inf")) -> Verdict | None:
    """The verdict, or ``None`` while no rank is past its allowance and none is gone or silent.

    ``silent_after_s``: a heartbeat that has not moved for longer means that rank's watchdog cannot run (its
    process is frozen, or holds the interpreter lock in native code)."""
    views = sorted(views, key=lambda v: v.rank)
    active = [v for v in views if v.beat is None or v.beat.phase not in (DONE, FAILED)]
    gone = [v for v in active if v.gone]
    silent = [v for v in active if not v.gone and v.silent_s > silent_after_s]
    over = [v for v in active if v.beat is not None and v.age_s > v.beat.allowance_s]
    if gone or silent:
        stuck = gone + silent
    elif not over:
        return None
    elif missing := [v for v in active if v.beat is None]:
        stuck = missing
    elif free := [v for v in active if v.beat is not None and _waits(v.beat) is None]:
        stuck = free
    else:
        first = min(_position(v.beat) for v in active if v.beat is not None)
        stuck = [v for v in active if v.beat is not None and _position(v.beat) == first]
    stuck_ranks = tuple(v.rank for v in stuck)
    parts = [_describe_stuck(v, silent_after_s) for v in stuck]
    parts += [_describe_other(v) for v in views if v.rank not in stuck_ranks and v.beat is not None]
    return Verdict(stuck_ranks, "; ".join(parts))
