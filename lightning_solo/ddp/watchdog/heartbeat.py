"""What a rank is doing (step, phase, named collective, how long), published by its watchdog thread. The training
thread assigns one tuple per transition (about a microsecond a step); the watchdog thread does the rest."""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

# Phases, in the order a training batch runs them (the verdict compares ranks' progress with it).
SETUP = "setup"
DATA_WAIT = "data wait"
BATCH_START = "batch start"
TRAINING_STEP = "training_step"
BACKWARD = "backward"
OPTIMIZER_STEP = "optimizer step"
VALIDATION = "validation"
SANITY_CHECK = "sanity check"  # Lightning's validation before training: not a sample of a validation's time
CHECKPOINT_SAVE = "checkpoint save"
CHECKPOINT_WRITE = "background checkpoint write"  # waiting for its own (where.py): work the others wait for
DONE = "done"
FAILED = "failed"  # the fit ended with an exception on this rank
ORDER = {SETUP: -1, SANITY_CHECK: -1, VALIDATION: 0, CHECKPOINT_SAVE: 0, DATA_WAIT: 1, BATCH_START: 2, TRAINING_STEP: 3,
         BACKWARD: 4, OPTIMIZER_STEP: 5, DONE: 9, FAILED: 9}  # fmt: skip
# Where a phase's time is judged against: a whole batch, a whole validation, a whole save.
_GROUP = {VALIDATION: "validation", CHECKPOINT_SAVE: "checkpoint"}
_WINDOW = 64  # durations kept per group: the median of the recent ones


@dataclass(frozen=True)
class Heartbeat:
    """One rank's published state: ``age_s`` in ``phase`` (the writer's, or read on the training thread's stack), which
    may last ``allowance_s``; ``collective`` it waits in, ``seq`` its number; ``beats``: moves at every publication."""

    rank: int
    pid: int
    host: str
    step: int
    phase: str
    age_s: float
    allowance_s: float
    collective: str | None = None
    seq: int = 0
    beats: int = 0
    median_step_s: float | None = None
    phase_s: dict[str, float] = field(default_factory=dict)  # seconds in each phase so far (TrainingDoctor reads it)
    wait_s: float = 0.0  # seconds in the collective it waits in (0: none)
    wait_allowance_s: float = 0.0  # how long a wait may go on before the verdict looks (a step's allowance)
    late: bool = False  # its thread could not run for a while: the phase it tells of may be over

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Heartbeat:
        return cls(**json.loads(data))


class HeartbeatWriter:
    """The training thread's side: phase transitions (cheap), batch times; :meth:`snapshot` for the thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # (step, phase, since, collective, seq): one tuple, assigned whole, so the thread never reads a torn state.
        self.state: tuple[int, str, float, str | None, int] = (0, SETUP, clock(), None, 0)
        self._durations: dict[str, deque[float]] = {"step": deque(maxlen=_WINDOW)}
        self._batch_started: float | None = None
        self._batch_other = 0.0  # time inside this batch's validations and saves: not a step's
        self._totals = dict.fromkeys(ORDER, 0.0)  # every key made now: the thread copies it while it changes
        self._mark = self.state[2]

    def _now(self) -> float:
        """The clock now; the time since the last transition goes to the phase that held it."""
        now = self._clock()
        self._totals[self.state[1]] += now - self._mark
        self._mark = now
        return now

    def batch(self, step: int) -> None:
        """A training batch starts: the time since the previous one, less its validations and saves, is a step's."""
        now = self._now()
        if self._batch_started is not None:
            self._durations["step"].append(now - self._batch_started - self._batch_other)
        self._batch_started, self._batch_other = now, 0.0
        self.state = (step, BATCH_START, now, None, self.state[4])

    def enter(self, phase: str, step: int | None = None) -> tuple[str, float]:
        """Enter ``phase``; returns what :meth:`leave` puts back."""
        step_now, previous, since, _, seq = self.state
        now = self._now()
        self.state = (step_now if step is None else step, phase, now, None, seq)
        return previous, since

    def leave(self, outer: tuple[str, float], stepped: bool = False) -> None:
        """Back to the phase around this one (the data wait after a batch's work); ``stepped``: an optimizer step."""
        step, phase, since, _, seq = self.state
        step += stepped
        previous, previous_since = outer
        now = self._now()
        if (group := _GROUP.get(phase)) is not None:
            self._durations.setdefault(group, deque(maxlen=_WINDOW)).append(now - since)
            if previous not in _GROUP:  # a save inside a validation is counted once, with the validation
                self._batch_other += now - since
        if previous in (BATCH_START, SETUP) and phase in (TRAINING_STEP, BACKWARD, OPTIMIZER_STEP):
            self.state = (step, DATA_WAIT, now, None, seq)
        elif previous == OPTIMIZER_STEP:  # the closure's training_step and backward ran: the step's own work now
            self.state = (step, previous, now, None, seq)
        elif previous in (TRAINING_STEP, BACKWARD, VALIDATION, SANITY_CHECK, SETUP):
            # Inside a step (manual optimization) or a validation: the outer phase's clock goes on.
            self.state = (step, previous, previous_since, None, seq)
        else:
            self.state = (step, previous, now, None, seq)

    def collective(self, name: str | None) -> None:
        """A named collective starts (``name``) or ends (``None``), numbered on this rank."""
        step, phase, since, _, seq = self.state
        self.state = (step, phase, since, name, seq + (name is not None))

    def end(self, failed: bool = False) -> None:
        """The fit ended (``failed``: with an exception, recording where)."""
        step, phase, _, _, seq = self.state
        now = self._now()
        self.state = (step, FAILED, now, f"{phase} at step {step}", seq) if failed else (step, DONE, now, None, seq)

    def median(self, group: str) -> float | None:
        """The median of ``group``'s recent durations; ``None`` before enough (the first step, a warm-up, excluded)."""
        samples = list(self._durations.get(group, ()))
        if group == "step":
            samples = samples[1:]
        return statistics.median(samples) if len(samples) >= 3 or (group != "step" and samples) else None

    def allowance(self, phase: str, factor: float, margin_s: float, first_s: float) -> float:
        median = self.median(_GROUP.get(phase, "step"))
        untimed = (SETUP, SANITY_CHECK, DONE, FAILED)
        return first_s if median is None or phase in untimed else factor * median + margin_s

    def snapshot(self, rank: int, pid: int, host: str, beats: int, allowance: Callable[[str], float]) -> Heartbeat:
        step, phase, since, collective, seq = self.state
        now, mark = self._clock(), self._mark
        totals = dict(self._totals)
        totals[phase] += now - mark
        return Heartbeat(
            rank=rank, pid=pid, host=host, step=step, phase=phase, age_s=now - since,
            allowance_s=allowance(phase), collective=collective, seq=seq, beats=beats,
            median_step_s=self.median("step"), phase_s=totals,
        )  # fmt: skip


# The phases in which the watchdog thread looks at the training thread's stack (where.py) for what it really does.
REFINABLE = frozenset({SETUP, DATA_WAIT, BATCH_START, OPTIMIZER_STEP, VALIDATION, SANITY_CHECK})


class Observer:
    """The watchdog thread's side of a heartbeat: a phase read on the training thread's stack, and collective waits."""

    def __init__(self, writer: HeartbeatWriter, clock: Callable[[], float] = time.monotonic) -> None:
        self.writer, self._clock = writer, clock
        self._refined: tuple[tuple[int, str, float], str, float, bool] | None = None  # (writer key, name, since, first)
        self._wait: tuple[object, float] | None = None  # (what it waits in, since)
        self._durations: dict[str, deque[float]] = {}

    def _close(self, now: float) -> None:
        if self._refined is not None:
            _, name, since, _ = self._refined
            self._durations.setdefault(name, deque(maxlen=_WINDOW)).append(now - since)
            self._refined = None

    def allowance(self, name: str, first: bool, factor: float, margin_s: float, first_s: float) -> float:
        """A refined phase's: ``first_s`` the first time, then ``factor`` x the median of those seen + ``margin_s``."""
        if first:
            return first_s
        seen = self._durations.get(name)
        return factor * (statistics.median(seen) if seen else 0.0) + margin_s

    def snapshot(
        self, rank: int, pid: int, host: str, beats: int, settings: tuple[float, float, float],
        refined: str | None = None, first: bool = False,
    ) -> Heartbeat:  # fmt: skip
        """This rank's heartbeat now; ``settings``: (factor, margin_s, first_s); ``refined``: the phase read on the
        training thread's stack (``None``: the writer's); ``first``: its first occurrence (``first_s`` applies)."""
        factor, margin_s, first_s = settings
        step, phase, since, collective, seq = self.writer.state
        now = self._clock()
        key = (step, phase, since)
        if refined is not None and phase in REFINABLE:
            if self._refined is None or self._refined[:2] != (key, refined):
                self._close(now)
                self._refined = (key, refined, now, first)
            _, _, refined_since, refined_first = self._refined
            allowance = self.allowance(refined, refined_first, factor, margin_s, first_s)
        else:
            self._close(now)
            allowance = self.writer.allowance(phase, factor, margin_s, first_s)
        waits = (collective, seq) if collective is not None else (since if phase == BACKWARD else None)
        if waits is None:
            self._wait = None
        elif self._wait is None or self._wait[0] != waits:
            self._wait = (waits, since if collective is None else now)
        beat = self.writer.snapshot(rank, pid, host, beats, lambda _: allowance)
        if refined is not None and self._refined is not None:
            beat = replace(beat, phase=refined, age_s=now - refined_since)
        return replace(
            beat,
            wait_s=now - self._wait[1] if self._wait is not None else 0.0,
            wait_allowance_s=self.writer.allowance(TRAINING_STEP, factor, margin_s, first_s),
        )
