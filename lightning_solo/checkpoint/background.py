"""Background checkpoint writes: the state is copied into host memory at the save (a snapshot), and one thread
writes it (and then the save's removals and link, in order) while training goes on. See docs/checkpoints.md.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_solo.core.decision import Decision

log = logging.getLogger(__name__)


class HostStaging:
    """Host copies of a checkpoint's tensors, storage by storage (views stay views), in buffers reused from one save
    to the next (pinned, filled without blocking, on GPU). At most one snapshot is held."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}
        self._group: dict[tuple[str, int, int], tuple[Any, torch.UntypedStorage]] = {}
        self._held: list[torch.UntypedStorage] = []
        self.event: Any = None
        self.nbytes = 0

    def release(self) -> None:
        """The previous snapshot is written: its buffers may be refilled."""
        for host in self._held:
            self._free.setdefault((host.nbytes(), host.is_pinned()), []).append(host)
        self._held, self.event, self.nbytes = [], None, 0

    def close_group(self) -> None:
        """The snapshot is complete: drop the sources and the unused buffers; on GPU, an event ends the copies."""
        self._held = [host for _, host in self._group.values()]
        on_gpu = any(str(key[0]).startswith("cuda") for key in self._group)
        self._group, self._free = {}, {}
        if on_gpu and torch.cuda.is_available():  # not run on this project's CPU machines
            self.event = torch.cuda.Event()
            self.event.record()

    def snapshot(self, obj: Any) -> Any:
        """A deep copy of ``obj`` whose tensors live in the host buffers; shared objects stay shared."""
        memo: dict[int, Any] = {}  # each tensor's staged copy, found through dicts, lists and tuples
        stack, seen = [obj], set()
        while stack:
            item = stack.pop()
            if id(item) not in seen:
                seen.add(id(item))
                if isinstance(item, torch.Tensor):
                    memo[id(item)] = self._tensor(item)
                elif isinstance(item, (dict, list, tuple)):
                    stack.extend(item.values() if isinstance(item, dict) else item)
        return copy.deepcopy(obj, memo)

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        plain = type(tensor) in (torch.Tensor, torch.nn.Parameter)
        if not plain or tensor.layout != torch.strided or tensor.device.type not in ("cpu", "cuda"):
            return tensor.detach().to("cpu", copy=True)  # an unusual tensor: a plain blocking copy
        storage = tensor.untyped_storage()
        key = (str(storage.device), storage.data_ptr(), storage.nbytes())
        if key not in self._group:
            self._group[key] = (storage, self._fill(storage))
        host = self._group[key][1]
        out = torch.empty(0, dtype=tensor.dtype).set_(host, tensor.storage_offset(), tensor.size(), tensor.stride())
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=tensor.requires_grad)
        return out.requires_grad_(tensor.requires_grad)

    def _fill(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        on_gpu = storage.device.type == "cuda"
        pool = self._free.get((storage.nbytes(), on_gpu))
        if pool:
            host = pool.pop()
        elif on_gpu:  # pinned, so the copy can run while the next step is queued
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True).untyped_storage()
        else:
            host = torch.UntypedStorage(storage.nbytes())
        host.copy_(storage, non_blocking=on_gpu)
        self.nbytes += storage.nbytes()
        return host


class BackgroundWriter:
    """One group of operations (a save's writes, removals, link) in flight at a time, run in order by one thread;
    one that fails stops the group and is raised at the next wait. ``stats``: saves, waits, staged bytes."""

    def __init__(self) -> None:
        self.staging = HostStaging()
        self._ops: list[tuple[str, Callable[[], None]]] = []
        self._thread: threading.Thread | None = None
        self._pending: str | None = None
        self._error: BaseException | None = None
        self._cancel = threading.Event()
        self.stats: dict[str, Any] = dict.fromkeys(("saves", "waits", "staged_bytes_max"), 0)
        self.stats.update(wait_s_total=0.0, wait_s_max=0.0, write_s_last=None)

    @property
    def in_flight(self) -> str | None:
        """What the running group writes, or ``None``."""
        return self._pending if self._thread is not None and self._thread.is_alive() else None

    def stage(self, io: Any, checkpoint: dict[str, Any], path: str, manifest: dict[str, Any]) -> None:
        """Snapshot ``checkpoint`` now; write it to ``path`` (``io.write_file``) when the group runs."""
        self.wait(None, "the next save reuses its buffers")
        snap = self.staging.snapshot(checkpoint)
        self.stats["staged_bytes_max"] = max(self.stats["staged_bytes_max"], self.staging.nbytes)
        self.add(lambda: io.write_file(snap, path, manifest), label=path)

    def add(self, op: Callable[[], None], label: str | None = None) -> None:
        """Run ``op`` after everything added before it (in this group) succeeded."""
        self._ops.append((label or "", op))

    def submit(self) -> None:
        """Start writing the operations added since the last submit, on one thread."""
        if not self._ops:
            return
        self.wait(None, "a second group")  # never two in flight (the stage above normally waited already)
        ops, self._ops = self._ops, []
        self._cancel.clear()
        self.staging.close_group()
        event, self._error = self.staging.event, None
        self._pending = ", ".join(label for label, _ in ops if label) or "rotation"
        self.stats["saves"] += 1

        def run() -> None:
            start = time.perf_counter()
            try:
                if event is not None:
                    event.synchronize()
                for _, op in ops:
                    if self._cancel.is_set():
                        raise RuntimeError("cancelled: a wait for it timed out")
                    op()
            except BaseException as err:  # noqa: BLE001 - raised at the next wait
                self._error = err
            finally:
                ops.clear()  # the snapshot's dicts; the buffers stay for the next save
                self.stats["write_s_last"] = time.perf_counter() - start

        self._thread = threading.Thread(target=run, name="solo-checkpoint-writer", daemon=False)
        self._thread.start()

    def wait(self, timeout_s: float | None, why: str) -> bool:
        """Wait for the group in flight (measured, logged); ``False`` if it is still running after ``timeout_s``
        (it is then told to stop before its next operation). Raises the error of a group that failed."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            start = time.perf_counter()
            thread.join(timeout_s)
            waited = time.perf_counter() - start
            self.stats["waits"] += 1
            self.stats["wait_s_total"] += waited
            self.stats["wait_s_max"] = max(self.stats["wait_s_max"], waited)
            (log.warning if waited >= 1.0 else log.info)(
                "waited %.2f s for the background checkpoint write of %s (%s)", waited, self._pending, why
            )
            if thread.is_alive():
                self._cancel.set()
                return False
        if thread is not None:
            self._thread = None
            self.staging.release()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"the background checkpoint write of {self._pending} failed: {error}") from error
        return True


def decide_async_save(save_s: float, step_s: float) -> Decision:
    """``async_save="auto"``: write in the background when the first save blocked training for more than two steps."""
    measured = f"the first save blocked {save_s:.2f} s, one step takes {step_s:.3f} s"
    if save_s > 2 * step_s:
        return Decision("async_save", True, f"auto: {measured}; later saves are written in the background")
    return Decision("async_save", False, f"auto: {measured}; saves stay synchronous")
