"""How long SoloSyncBatchNorm's collectives hold the step up, for TrainingDoctor, while a reader listens.
See docs/syncbn.md (TrainingDoctor)."""

from __future__ import annotations

import time
import weakref
from typing import Any

import torch


class CollectiveWait:
    """Sums the time between :meth:`start` and :meth:`stop` around each collective while someone listens."""

    def __init__(self) -> None:
        self._listeners: weakref.WeakSet[Any] = weakref.WeakSet()
        self._seconds = 0.0  # host-clock waits since the last take
        self._events: list[tuple[Any, Any]] = []  # CUDA (start, end) events since the last take
        self.event = torch.cuda.Event  # the CUDA marks (a test may pass its own)

    def listen(self, reader: Any) -> None:
        """Start timing, for as long as ``reader`` lives or until :meth:`unlisten`."""
        self._listeners.add(reader)

    def __contains__(self, reader: Any) -> bool:
        return reader in self._listeners

    def unlisten(self, reader: Any) -> None:
        self._listeners.discard(reader)
        if not self._listeners:
            self.take()

    def start(self, device: torch.device) -> Any:
        """A mark before a collective (``None`` when nobody listens)."""
        if not self._listeners:
            return None
        if device.type != "cuda":
            return time.perf_counter()
        event = self.event(enable_timing=True)
        event.record()  # on the current stream: the one the collective's wait is enqueued on
        return event

    def stop(self, mark: Any, device: torch.device) -> None:
        """Close the interval opened by :meth:`start`."""
        if mark is None:
            return
        if device.type != "cuda":
            self._seconds += time.perf_counter() - mark
            return
        event = self.event(enable_timing=True)
        event.record()
        self._events.append((mark, event))

    def take(self) -> tuple[float, list[tuple[Any, Any]]]:
        """The host-clock seconds and the CUDA event pairs since the last call."""
        taken = (self._seconds, self._events)
        self._seconds, self._events = 0.0, []
        return taken


SYNCBN_WAIT = CollectiveWait()  # the one clock every SoloSyncBatchNorm layer of this process reports to
