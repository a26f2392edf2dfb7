"""SoloDDP's watchdog across its fits: the setting and its Decision, the flight recorder's environment, each fit's
:class:`Watchdog` and the phases the hooks mark. Every method does nothing while no watchdog runs."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed

from lightning_solo._compat import torch as torch_compat
from lightning_solo.core.decision import Decision
from lightning_solo.ddp.watchdog import heartbeat as hb
from lightning_solo.ddp.watchdog.flight_recorder import decide_flight_recorder
from lightning_solo.ddp.watchdog.heartbeat import Heartbeat
from lightning_solo.ddp.watchdog.watchdog import Watchdog, WatchdogSettings, next_store_prefix


class WatchdogSession:
    """``option``: ``SoloDDP(watchdog=...)``, as :meth:`WatchdogSettings.from_option` reads it."""

    def __init__(self, option: bool | Mapping[str, Any]) -> None:
        self.settings = WatchdogSettings.from_option(option)
        self._dog: Watchdog | None = None  # each fit's, on every rank alike
        self._validation_outer: tuple[str, float] | None = None
        self._trainer: Any = None
        self._environ: dict[str, str | None] = {}  # what prepare_environment changed: each variable's value before

    @property
    def decision(self) -> Decision:
        s = self.settings
        return Decision(
            "watchdog",
            s is not None,
            "a proven hang (a rank's process ended, a collective mismatch the flight recorder shows, a rank "
            "finished while another waits in a collective) ends the run at once with one line naming the rank and "
            f"every rank's stacks; a rank busy past {s.factor:g} x the median of its phase + {s.margin_s:g} s "
            f"({s.first_s:g} s the first time) is only reported (again at 2x, 4x), and ended at the collective "
            "timeout" + (f" or after {s.abort_after_s:g} s (abort_after_s)" if s.abort_after_s is not None else "")
            if s is not None
            else "set by the user: a hang waits for the collective timeout",
        )

    def prepare_environment(self, backend: str) -> Decision | None:
        """Switch torch's flight recorder on for ``backend`` unless the user set it; its Decision (None: off)."""
        if self.settings is None:
            return None
        recorder, env = decide_flight_recorder(backend, os.environ)
        for key, value in env.items():
            self._environ.setdefault(key, os.environ.get(key))
            os.environ[key] = value
        return recorder

    def restore_environment(self) -> None:
        """Every variable :meth:`prepare_environment` set back as it was."""
        for key, value in self._environ.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._environ = {}

    def start(self, trainer: Any, rank: int, world_size: int, timeout: timedelta | None = None) -> None:
        """This fit's watchdog, dumping into ``<default_root_dir>/hang/``; ``timeout``: the collective timeout."""
        prefix = next_store_prefix()  # every rank's process runs the same fits: the same prefix
        self._validation_outer, self._trainer = None, trainer
        if self.settings is None or world_size < 2 or not torch.distributed.is_initialized():
            return
        store = torch.distributed.PrefixStore(prefix, torch_compat.default_store().clone())
        # The record of DDP's own collectives: NCCL's under NCCL (its gloo side groups are in gloo's), else gloo's.
        nccl = "nccl" in str(torch.distributed.get_backend())
        record = functools.partial(torch_compat.flight_recorder_json, nccl)
        timeout_s = (timeout or timedelta(minutes=30)).total_seconds()
        hang, epoch = Path(trainer.default_root_dir) / "hang", lambda: int(trainer.current_epoch)
        self._dog = Watchdog(self.settings, store, rank, world_size, hang, record, timeout_s, epoch)
        self._dog.start()

    def heartbeats(self) -> dict[int, Heartbeat]:
        """See :meth:`SoloDDP.heartbeats <lightning_solo.ddp.strategy.SoloDDP.heartbeats>`."""
        return self._dog.heartbeats() if self._dog is not None else {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """The block runs in phase ``name`` (an optimizer step that completes counts as a step)."""
        if self._dog is None:
            yield
            return
        outer = self._dog.writer.enter(name)
        yield
        self._dog.writer.leave(outer, stepped=name == hb.OPTIMIZER_STEP)

    @contextlib.contextmanager
    def collective(self, name: str) -> Iterator[None]:
        """The block waits in the collective ``name`` (numbered by the heartbeat)."""
        if self._dog is None:
            yield
            return
        self._dog.writer.collective(name)
        yield
        self._dog.writer.collective(None)

    def step_hooks(self) -> dict[str, Callable[..., Any]]:
        """The training-step moments it takes part in (:mod:`lightning_solo.ddp.component`)."""
        if self._dog is None:
            return {}
        return {"batch": lambda trainer: self.batch(trainer.global_step),
                "step": lambda strategy: self.phase(hb.TRAINING_STEP), "backward": lambda: self.phase(hb.BACKWARD),
                "optimizer_step": lambda: self.phase(hb.OPTIMIZER_STEP), "collective": self.collective}  # fmt: skip

    def data_wait(self, step: int) -> None:
        """Training starts: waiting for the first batch."""
        if self._dog is not None:
            self._dog.first_epoch = int(self._trainer.current_epoch)  # after a resume's restore
            self._dog.writer.enter(hb.DATA_WAIT, step=step)

    def batch(self, step: int) -> None:
        """A training batch arrived (Lightning moves it to the device)."""
        if self._dog is not None:
            self._dog.writer.batch(step)

    def validation_start(self, sanity: bool) -> None:
        """``sanity``: the sanity check before training, judged with the first-step allowance."""
        if self._dog is not None:
            self._validation_outer = self._dog.writer.enter(hb.SANITY_CHECK if sanity else hb.VALIDATION)

    def validation_end(self) -> None:
        if self._dog is not None and self._validation_outer is not None:
            self._dog.writer.leave(self._validation_outer)
        self._validation_outer = None

    def stop(self) -> None:
        """The fit ended: "done" at once, so no peer takes this rank's exit for a death."""
        if self._dog is not None:
            self._dog.stop()

    def on_exception(self, exception: BaseException) -> None:
        """Names a peer whose process ended (the collective's error names none), then stops."""
        if self._dog is not None:
            self._dog.on_exception(exception)

    def teardown(self) -> None:
        """The fit, validate, test or predict ended: the watchdog stopped, the environment restored."""
        self.stop()
        self._dog, self._trainer = None, None
        self.restore_environment()
