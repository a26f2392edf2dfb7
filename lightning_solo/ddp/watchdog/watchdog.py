"""The watchdog thread: publishes this rank's heartbeat, judges every rank's (ranks 0 and W-1), reports a busy rank
and ends a run proven hung (dumps, one line, exit status :data:`HANG_EXIT_CODE`). See docs/multi-node.md."""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import json
import multiprocessing
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch.distributed
from lightning.fabric.utilities.rank_zero import rank_prefixed_message

from lightning_solo.core.checks import check_number
from lightning_solo.ddp.watchdog import flight_recorder
from lightning_solo.ddp.watchdog.heartbeat import DONE, FAILED, REFINABLE, Heartbeat, HeartbeatWriter, Observer
from lightning_solo.ddp.watchdog.verdict import END, REPORT, SUSPECT, RankView, Verdict, judge
from lightning_solo.ddp.watchdog.where import ONCE_HOOKS, thread_frame, where

HANG_EXIT_CODE = 86  # distinct from Python's 1, a signal's 128+n and SLURM's requeue codes
PEER_EXIT_WAIT_S = 3.0  # a SIGKILLed peer's sockets close a moment before /proc shows its process ended
PARENT_EXIT_WAIT_S = 10.0  # how long a rank started by another rank waits for that rank to exit first
_VERDICT, _FINAL, _SIGNAL = "verdict", "verdict/final", "signal"  # signal: counts every verdict, report, request
FLIGHT_RECORD_WAIT_S = 3.0  # the judge's wait for the live ranks' flight records: within 2 x median step + 60 s
_fits = itertools.count(1)


def next_store_prefix() -> str:
    """Each fit's keys in the store (a script may fit twice in one process group): every rank runs the same fits."""
    return f"lightning_solo/watchdog/{next(_fits)}/"


@dataclass(frozen=True)
class WatchdogSettings:
    """A phase's allowance is ``factor`` × its median + ``margin_s`` (``first_s`` the first time); ``interval_s``:
    heartbeat period; ``silent_s``, ``grace_s``, ``abort``, ``abort_after_s``: docs/multi-node.md ("Tuning")."""

    factor: float = 2.0
    margin_s: float = 55.0
    first_s: float = 600.0
    interval_s: float = 1.0
    silent_s: float = 120.0
    grace_s: float = 10.0
    abort: bool = True
    abort_after_s: float | None = None

    @classmethod
    def from_option(cls, option: bool | Mapping[str, Any]) -> WatchdogSettings | None:
        """``SoloDDP(watchdog=...)``: ``True`` (these defaults), ``False``/``None`` (off) or a mapping of fields."""
        if option is None or option is False:
            return None
        if option is True:
            return cls()
        known = [f.name for f in fields(cls)]
        if not isinstance(option, Mapping):
            raise ValueError(f"watchdog must be True, False or a mapping of {known}, got {option!r}")
        if unknown := set(option) - set(known):
            raise ValueError(f"unknown watchdog setting(s) {sorted(unknown)}; known: {sorted(known)}")
        values = {
            k: v if k == "abort" or (k == "abort_after_s" and v is None) else check_number(f"watchdog.{k}", v)
            for k, v in option.items()
        }
        return cls(**values)


_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible wait", "T": "stopped", "t": "traced"}


def _state_letter(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def proc_state(pid: int) -> str | None:
    """A live process's state from ``/proc``: ``"state S (sleeping), wchan hrtimer_nanosleep"``; ``None``: unknown."""
    if (state := _state_letter(pid)) is None:
        return None
    text = f"state {state}" + (f" ({_STATES[state]})" if state in _STATES else "")
    with contextlib.suppress(OSError):
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
        if wchan and wchan != "0":
            text += f", wchan {wchan}"
    return text


def _gone(beat: Heartbeat | None, host: str) -> bool:
    """A rank on this host whose process has ended (a zombie counts: its parent has not reaped it yet)."""
    if beat is None or beat.host != host:
        return False
    if (state := _state_letter(beat.pid)) is not None:
        return state in ("Z", "X")
    try:
        os.kill(beat.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass
    return False


def _running(view: RankView) -> bool:
    return not view.gone and (view.beat is None or view.beat.phase not in (DONE, FAILED))


def peer_failure(exception: BaseException | None) -> bool:
    """Whether ``exception`` is a collective's failure a peer's end may explain (``DistError``, gloo's, NCCL's)."""
    if isinstance(exception, torch.distributed.DistError):
        return True
    text = str(exception) if isinstance(exception, RuntimeError) else ""
    return any(mark in text for mark in ("Connection closed by peer", "Connection reset by peer", "gloo", "NCCL"))


class Watchdog:
    """One fit's watchdog on one rank. ``store``: a prefix store over a clone of the group's; ``flight_record``: this
    process's dump; ``timeout_s``: the collective timeout; ``epoch``: the current one; ``writer``: the hooks' phases."""

    def __init__(
        self,
        settings: WatchdogSettings,
        store: Any,
        rank: int,
        world_size: int,
        dump_dir: str | os.PathLike,
        flight_record: Callable[[], bytes | str] | None = None,
        timeout_s: float = 1800.0,
        epoch: Callable[[], int] | None = None,
    ) -> None:
        self.settings = settings
        self._flight_record = flight_record
        self._timeout_s, self._epoch = timeout_s, epoch
        self.first_epoch = epoch() if epoch is not None else 0
        self.writer = HeartbeatWriter()
        self._observer = Observer(self.writer)
        self._training_thread: int | None = None
        self._signal = 0  # the store's signal counter last seen
        self._reports_read = self._requests_answered = 0
        self._reported: dict[str, int] = {}  # a stall's key -> the report level printed
        self._checked: set[tuple[str, int]] = set()  # (key, level) whose flight records were read
        self.rank, self.world_size = rank, world_size
        self.dump_dir = Path(dump_dir)
        self.verdict: Verdict | None = None
        self._store = store
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._judge = rank in (0, world_size - 1)
        self._beats = 0
        self._seen: dict[int, tuple[int, float, Heartbeat]] = {}  # rank -> (beats, when seen, heartbeat)
        self._stop = threading.Event()
        self._acted = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._training_thread = threading.get_ident()
        self._publish()
        self._thread = threading.Thread(target=self._run, name="lightning_solo-watchdog", daemon=True)
        self._thread.start()

    def stop(self, failed: bool = False) -> None:
        """The fit ended (``failed``: with an exception): say so at once, so no peer takes this rank's exit for a
        death. Rank 0 (the store's server) waits up to ``grace_s`` for the others to say so too."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            # First: a heartbeat the thread is still writing must not land over "done".
            self._thread.join(timeout=2 * self.settings.interval_s + 1)
        self._thread = None
        if failed or self.writer.state[1] != FAILED:
            self.writer.end(failed)
        with contextlib.suppress(Exception):  # the store's host may be gone already: nothing left to tell
            self._publish()
            if self.rank == 0:
                deadline = time.monotonic() + self.settings.grace_s
                while time.monotonic() < deadline and any(map(_running, self._views())):
                    time.sleep(0.05)

    def on_exception(self, exception: BaseException | None = None) -> Verdict | None:
        """The fit failed here: name a peer whose process ended (looked for up to ``PEER_EXIT_WAIT_S`` after a
        :func:`peer_failure`), with this rank's stacks; then stop. Returns the verdict, if any."""
        verdict = None
        thread = self._thread
        if self._acted.locked() and thread is not None and thread is not threading.current_thread():
            # The thread acts on a verdict: its line and exit status are the run's.
            thread.join(timeout=self.settings.grace_s + FLIGHT_RECORD_WAIT_S + 5)
        if self.verdict is None:
            deadline = time.monotonic() + (PEER_EXIT_WAIT_S if peer_failure(exception) else 0.0)
            while True:
                try:
                    views = self._views()
                except Exception:  # noqa: BLE001 - the store is gone with its host
                    views = []
                if not views or any(v.gone for v in views) or time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            if any(v.gone for v in views):
                verdict = judge(views, self.settings.silent_s)
                if verdict is not None:
                    self._act(verdict, abort=False)
        self.stop(failed=True)
        return verdict or self.verdict

    def heartbeats(self) -> dict[int, Heartbeat]:
        """Every rank's latest heartbeat read here (this rank's own, fresh): ranks 0 and W-1 read all."""
        s = self.settings
        own = self.writer.snapshot(
            self.rank, self._pid, self._host, self._beats,
            lambda phase: self.writer.allowance(phase, s.factor, s.margin_s, s.first_s),
        )  # fmt: skip
        seen = dict(self._seen)  # one copy: the thread adds to it
        return {**{r: beat for r, (_, _, beat) in seen.items()}, self.rank: own}

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.settings.interval_s):
            # A late look (the interpreter lock held by native code) judges nothing: what it read may be stale.
            late, last = time.monotonic() - last > 2 * self.settings.interval_s + 0.5, time.monotonic()
            try:
                self._publish(late)
                if (signal := int(self._store.add(_SIGNAL, 0))) != self._signal:
                    self._signal = signal
                    if self._store.check([_VERDICT]):
                        line = self._store.get(_VERDICT).decode().split("|", 1)[1]
                        self._act(Verdict((), line), print_it=False)
                        return
                    self._answer()
                if not self._judge or late:
                    continue
                verdict = judge(self._views(), self.settings.silent_s)
                if verdict is not None and not self._stop.is_set() and self._consider(verdict):
                    return
            except Exception:  # noqa: BLE001 - the store's host ended (the run is over): nothing to judge
                return

    def _answer_request(self) -> None:
        """Another rank asked for this rank's flight-recorder summary (a stall is suspected): publish it."""
        if (wanted := int(self._store.add("fr/want", 0))) > self._requests_answered:
            self._requests_answered = wanted
            self._store.set(f"fr/{wanted}/{self.rank}", json.dumps(self._flight_summary()[1]))

    def _answer(self) -> None:
        """Another rank asked for flight records, or printed a report: answer, dump, print."""
        self._answer_request()
        reports = int(self._store.add("report/count", 0))
        while self._reports_read < reports:
            self._reports_read += 1
            line = self._store.get(f"report/{self._reports_read}").decode()
            self._dump_stacks(line)
            with contextlib.suppress(Exception):
                sys.stderr.write(rank_prefixed_message(line, self.rank) + "\n")
                sys.stderr.flush()

    def _consider(self, verdict: Verdict) -> bool:
        """End the run on proof, at the collective timeout or ``abort_after_s`` (True); else report at 1x, 2x, 4x ..."""
        if verdict.kind == END:
            self._act(verdict)
            return True
        level = verdict.level()
        if verdict.kind == SUSPECT:
            if (verdict.key, level) not in self._checked:
                self._checked.add((verdict.key, level))
                summaries = self._ask_flight_records()
                if flight_recorder.deadlock(summaries) is not None:
                    self._act(Verdict(verdict.stuck, f"collective mismatch: {verdict.line}", END))
                    return True
            verdict = replace(verdict, kind=REPORT)
            if self._store.check([_VERDICT]):  # the other judge's verdict came first: the next look acts on it
                return False
        if (why := self._ends(verdict)) is not None:
            self._act(replace(verdict, line=f"{verdict.line}; {why}"))
            return True
        if self._reported.get(verdict.key, -1) < level:
            self._reported[verdict.key] = level
            self._report(verdict)
        return False

    def _ends(self, verdict: Verdict) -> str | None:
        """Why a reported stall ends now, if it does: the collective timeout nears, or ``abort_after_s`` passed."""
        s = self.settings
        if s.abort_after_s is not None and verdict.over_s >= s.abort_after_s:
            return f"ended after {s.abort_after_s:g} s (watchdog abort_after_s)"
        lead = min(5.0, 0.1 * self._timeout_s) + 2 * s.interval_s
        if verdict.peers_wait_s > 0 and verdict.peers_wait_s >= self._timeout_s - lead:
            return f"ended at the collective timeout ({self._timeout_s:g} s)"
        return None

    def _report(self, verdict: Verdict) -> None:
        """One line for a busy rank, printed once by every rank (each dumps its stacks)."""
        s = self.settings
        until = []
        if verdict.peers_wait_s > 0:
            until.append(f"the collective timeout ({self._timeout_s:g} s)")
        if s.abort_after_s is not None:
            until.append(f"abort_after_s ({s.abort_after_s:g} s)")
        ends = f" ends it at {' or '.join(until)}" if until else " does not end it"
        line = (
            f"SoloDDP watchdog report: {verdict.line}. Python stacks: {self.dump_dir}/rank*.stacks.txt. Reported, not "
            f"ended: a busy rank is no proof of a hang (reported again at 2x, 4x its allowance); the watchdog{ends}."
        )
        try:
            claim = f"report/claim/{verdict.key}/{verdict.level()}"
            if self._store.compare_set(claim, "", str(self.rank)).decode() != str(self.rank):
                return  # the other judge reported it
            number = int(self._store.add("report/count", 1))
            self._store.set(f"report/{number}", line)
            self._store.add(_SIGNAL, 1)
        except Exception:  # noqa: BLE001 - no store: this rank alone reports
            self._dump_stacks(line)
        with contextlib.suppress(OSError):
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            with open(self.dump_dir / "reports.txt", "a") as f:
                f.write(line + "\n")

    def _ask_flight_records(self) -> dict[int, Any]:
        """Every live rank's flight-recorder summary, asked for through the store: only when a stall is suspected."""
        wanted = int(self._store.add("fr/want", 1))
        self._requests_answered = max(self._requests_answered, wanted)
        self._store.add(_SIGNAL, 1)
        keys = {r: f"fr/{wanted}/{r}" for r in range(self.world_size) if r != self.rank}
        mine = self._flight_summary()[1]
        return {self.rank: mine, **self._collect(keys, time.monotonic() + FLIGHT_RECORD_WAIT_S, self._verdict_came)}

    def _verdict_came(self) -> bool:
        """Answer the other judge's request (it may be asking at the same time); whether a verdict came."""
        self._answer_request()
        return bool(self._store.check([_VERDICT]))

    def _wait_for(self, keys: list[str], deadline: float, stop: Callable[[], bool] | None = None) -> bool:
        """Whether the store holds ``keys`` before ``deadline`` (``stop``: asked at each wait, True gives up)."""
        while not self._store.check(keys):
            if time.monotonic() >= deadline or (stop is not None and stop()):
                return False
            time.sleep(0.05)
        return True

    def _collect(self, keys: dict[int, str], deadline: float, stop: Callable[[], bool] | None = None) -> dict[int, Any]:
        """The summaries the ranks published under ``keys``, waited for until ``deadline`` (``None``: not there)."""
        self._wait_for(list(keys.values()), deadline, stop)
        return {r: json.loads(self._store.get(k)) if self._store.check([k]) else None for r, k in keys.items()}

    def _snapshot(self) -> Heartbeat:
        s = self.settings
        refined, first = None, False
        if self.writer.state[1] in REFINABLE:
            with contextlib.suppress(Exception):  # the stack changed under the look: the writer's phase stands
                refined = where(thread_frame(self._training_thread))
            if refined is not None:
                epoch = self._epoch() if self._epoch is not None else self.first_epoch
                first = refined in ONCE_HOOKS or epoch == self.first_epoch
        return self._observer.snapshot(
            self.rank, self._pid, self._host, self._beats, (s.factor, s.margin_s, s.first_s), refined, first
        )

    def _publish(self, late: bool = False) -> None:
        self._beats += 1
        beat = self._snapshot()
        self._store.set(f"beat/{self.rank}", (replace(beat, late=True) if late else beat).encode())

    def _views(self) -> list[RankView]:
        keys = [f"beat/{r}" for r in range(self.world_size)]
        if self._store.check(keys):
            raw: list[bytes | None] = list(self._store.multi_get(keys))
        else:  # before every rank's first heartbeat
            raw = [self._store.get(k) if self._store.check([k]) else None for k in keys]
        now = time.monotonic()
        views = []
        for rank, data in enumerate(raw):
            if rank == self.rank:  # fresh, after the store's answer: never older than the others'
                own = self._snapshot()
                views.append(RankView(rank, own, age_s=own.age_s))
                continue
            beat = Heartbeat.decode(data) if data else None
            if beat is None:
                views.append(RankView(rank, None))
                continue
            seen = self._seen.get(rank)
            if seen is None or seen[0] != beat.beats:
                self._seen[rank] = seen = (beat.beats, now, beat)
            since = now - seen[1]
            gone = _gone(beat, self._host)
            quiet = since > 2 * self.settings.interval_s + 1 and beat.host == self._host and not gone
            proc = proc_state(beat.pid) if quiet else None
            views.append(RankView(rank, beat, beat.age_s + since, since, gone, proc))
        return views

    def _line(self, verdict_line: str, words: str | None = None) -> str:
        fr = f", flight recorder: {self.dump_dir}/rank*.fr.json" if words else ""
        return (
            f"SoloDDP watchdog: {verdict_line}{'; ' + words if words else ''}. "
            f"Python stacks: {self.dump_dir}/rank*.stacks.txt{fr}."
        )

    def _flight_summary(self) -> tuple[bytes | str | None, dict[str, Any] | None]:
        """This rank's flight-recorder dump and its summary (``None``: no recorder, or it failed)."""
        if self._flight_record is None:
            return None, None
        try:
            dump = self._flight_record()
            return dump, flight_recorder.summarize(dump)
        except Exception:  # noqa: BLE001 - evidence only: it must not keep the run from ending
            return None, None

    def _dump_stacks(self, line: str) -> str:
        """This rank's heartbeat, ``line`` and every thread's stack into ``rank<r>.stacks.txt``; returns any problem."""
        try:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            with open(self.dump_dir / f"rank{self.rank}.stacks.txt", "w") as f:
                beat = json.dumps(asdict(self._snapshot()))
                f.write(f"rank {self.rank} (pid {self._pid}, {self._host}): {beat}\n{line}\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as err:  # an unwritable run directory must not keep the run from ending
            return f" (no stack dump: {err})"
        return ""

    def _record_flight(self) -> dict[str, Any] | None:
        """Write this rank's flight-recorder dump and publish its summary (``None``: no recorder, or it failed)."""
        dump, summary = self._flight_summary()
        if dump is not None and summary:
            with contextlib.suppress(OSError):
                self.dump_dir.mkdir(parents=True, exist_ok=True)
                (self.dump_dir / f"rank{self.rank}.fr.json").write_bytes(
                    dump if isinstance(dump, bytes) else dump.encode()
                )
        with contextlib.suppress(Exception):  # the store's host ended first
            self._store.set(f"fr/{self.rank}", json.dumps(summary))
        return summary

    def _flight_words(self, verdict: Verdict, mine: dict[str, Any] | None, started: float) -> str | None:
        """The flight recorder's clause from every live rank's summary (a rank gone or silent is not waited for)."""
        if self._flight_record is None:
            return None
        summaries: dict[int, Any] = {self.rank: mine}
        try:
            views = self._views()
            silent = [v.rank for v in views if v.gone or v.silent_s > self.settings.silent_s]
            live = [v.rank for v in views if v.rank != self.rank and v.rank not in silent and _running(v)]
            summaries.update(dict.fromkeys(silent))
            deadline = started + min(FLIGHT_RECORD_WAIT_S, self.settings.grace_s)
            summaries.update(self._collect({r: f"fr/{r}" for r in live}, deadline))
        except Exception:  # noqa: BLE001 - the store's host ended: this rank's own record only
            pass
        return flight_recorder.clause(summaries, lead=verdict.stuck)

    def _act(self, verdict: Verdict, print_it: bool = True, abort: bool | None = None) -> None:
        if not self._acted.acquire(blocking=False):
            return
        started = time.monotonic()
        line = verdict.line  # another rank's, as it printed it
        if print_it:
            line = self._line(verdict.line)  # the first verdict only: one line for the whole run
            mine = f"{self.rank}|{line}"  # two judges may word the same line: the rank tells whose it is
            try:
                won = self._store.compare_set(_VERDICT, "", mine).decode() == mine
                if won:
                    self._store.add(_SIGNAL, 1)
            except Exception:  # noqa: BLE001 - no store: this rank is alone to speak
                won = True
            if not won:
                line, print_it = self._store.get(_VERDICT).decode().split("|", 1)[1], False
        self.verdict = Verdict(verdict.stuck, line)
        abort = self.settings.abort if abort is None else abort
        problem = self._dump_stacks(line)
        summary = self._record_flight()
        if print_it:
            line = self._line(verdict.line, self._flight_words(verdict, summary, started)) + problem
            self.verdict = Verdict(verdict.stuck, line)
            with contextlib.suppress(Exception):  # the others read the whole line after their dumps
                self._store.set(_FINAL, line)
            with contextlib.suppress(OSError):
                (self.dump_dir / "verdict.txt").write_text(line + "\n")
        else:  # the whole line read before this rank says "dumped" (rank 0's exit takes the store with it)
            with contextlib.suppress(Exception):
                if self._wait_for([_FINAL], started + self.settings.grace_s):
                    self.verdict = Verdict(verdict.stuck, self._store.get(_FINAL).decode())
        # Every rank's stderr carries the line, printed before "dumped" (on which the others, and a launcher, end).
        end = f" Ending the run (exit status {HANG_EXIT_CODE})." if abort else ""
        with contextlib.suppress(Exception):
            sys.stderr.write(rank_prefixed_message(f"{self.verdict.line}{end}", self.rank) + "\n")
            sys.stderr.flush()
        try:
            self._store.set(f"dumped/{self.rank}", "1")
            if abort:  # the store's host must outlive the others' dumps
                live = [f"dumped/{v.rank}" for v in self._views() if _running(v)]
                self._wait_for(live, started + self.settings.grace_s)
        except Exception:  # noqa: BLE001 - the store's host ended first
            pass
        if abort:
            # Its own children (loader workers; one may be the stuck one) would outlive it.
            for child in multiprocessing.active_children():
                with contextlib.suppress(Exception):
                    child.kill()
            self._let_the_parent_rank_exit_first()
            os._exit(HANG_EXIT_CODE)

    def _let_the_parent_rank_exit_first(self) -> None:
        """Wait (at most PARENT_EXIT_WAIT_S) for a parent that is a rank of this job (Lightning's popen launcher) to
        exit first: its process observer would SIGKILL the job on this child's exit, making its status -9."""
        parent = os.getppid()
        ranks = [beat for _, _, beat in self._seen.values() if beat.host == self._host]
        if not any(beat.pid == parent for beat in ranks):
            return
        deadline = time.monotonic() + PARENT_EXIT_WAIT_S
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.02)
