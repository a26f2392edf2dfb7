"""For tests, benchmarks and notebooks: :func:`run_ranks` and :class:`HostSyncRecorder`. See docs/testing.md."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import random
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from lightning_solo._compat.torch import DispatchMode

_PORTS = random.SystemRandom()


def free_port() -> int:
    """A free TCP port below Linux's ephemeral range, so that no port-0 bind takes it before the store listens."""
    for _ in range(200):
        port = _PORTS.randrange(20000, 32768)  # not the global RNG: seeded alike in every test process
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        # Plain pickle, not torch's shared-memory reduction: a tensor must outlive the rank that made it.
        result = pickle.dumps(fn(rank, world_size, *args))
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the traceback
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 120) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` forked gloo ranks; their results, index = rank."""
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = pickle.loads(payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world_size)]


class HostSyncRecorder:
    """Records, on any device, what would stall the host on a GPU: device reads, host uploads, all-reduces."""

    _READS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"})
    _FACTORIES = frozenset({"tensor", "as_tensor", "asarray"})

    def __init__(self, device: Any = "cpu", step: int | Callable[[], int] | None = None) -> None:
        self.device = torch.device(device)
        self.allreduces: list[tuple[str, int]] = []
        self.events: list[HostSync] = []
        self.step = step
        self._device_tensors: Any = WeakIdKeyDictionary()
        self._tracking = False
        self._reading = 0  # inside a read already recorded: its _local_scalar_dense is the same event
        self._modes = (_FunctionSide(self), _DispatchSide(self))

    @property
    def syncs(self) -> list[str]:
        return [e.op for e in self.events]

    def watch(self, *owners: Any) -> HostSyncRecorder:
        """Mark tensors (or every parameter and buffer of modules) as the device's; returns ``self``."""
        self._tracking = True
        for owner in owners:
            self._mark([*owner.parameters(), *owner.buffers()] if isinstance(owner, torch.nn.Module) else owner)
        return self

    def on_device(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and (not self._tracking or value in self._device_tensors)

    def __enter__(self) -> HostSyncRecorder:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def _record(self, kind: str, op: str) -> None:
        step = self.step() if callable(self.step) else self.step
        self.events.append(HostSync(kind, op, _call_site(), step))

    def _mark(self, value: Any) -> None:
        for item in _tensors(value):
            if isinstance(item, torch.Tensor):
                self._device_tensors[item] = True

    def _is_device(self, target: Any) -> bool:
        return isinstance(target, torch.device) and target.type == self.device.type


@dataclass(frozen=True)
class HostSync:
    """One event: ``kind`` ``"read"`` or ``"upload"``; ``site`` the innermost ``file:line`` outside torch."""

    kind: str
    op: str
    site: str
    step: int | None


class _Side:
    def __init__(self, rec: HostSyncRecorder) -> None:
        super().__init__()
        self.rec = rec


class _FunctionSide(_Side, TorchFunctionMode):
    """The Python-level calls that do not reach the dispatcher on the CPU (``.cpu()``, ``.to``, ``torch.tensor``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        rec, kwargs = self.rec, kwargs or {}
        name = getattr(func, "__name__", "")
        if name in rec._READS and args and rec.on_device(args[0]):
            rec._record("read", name)
            rec._reading += 1
            try:
                result = func(*args, **kwargs)
            finally:
                rec._reading -= 1
            return _host_copy(rec, args[0], result)
        if name == "to" and args:
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            if isinstance(target, str) and target.startswith("cpu") and rec.on_device(args[0]):
                rec._record("read", "to('cpu')")
                return _host_copy(rec, args[0], func(*args, **kwargs))
            if rec._is_device(target) and not rec.on_device(args[0]):
                rec._record("upload", "to(device)")
                result = func(*args, **kwargs)
                result = result.clone() if result is args[0] else result  # on a GPU: a new tensor
                rec._mark(result)
                return result
        result = func(*args, **kwargs)
        device = kwargs.get("device")
        if device is not None and (rec._is_device(device) or isinstance(device, str)):
            if name in rec._FACTORIES and not rec.on_device(args[0] if args else None):
                rec._record("upload", f"torch.{name}(..., device=)")
            if rec._is_device(device) or name in rec._FACTORIES:
                rec._mark(result)
        return result


class _DispatchSide(_Side, DispatchMode):
    """The ops: results of device tensors, reads the C++ side makes, host-device copies, all-reduces."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        rec, kwargs = self.rec, kwargs or {}
        name = func.name()
        short = name.split("::")[-1].split(".")[0]
        if name.startswith("c10d::allreduce"):
            rec.allreduces += [(str(t.dtype), t.numel()) for t in args[0]]
        elif short in ("_local_scalar_dense", "nonzero", "masked_select") and not rec._reading:
            if rec.on_device(args[0]):
                rec._record("read", name)
        elif short == "copy_" and rec._tracking:
            into, source = rec.on_device(args[0]), rec.on_device(args[1])
            non_blocking = kwargs.get("non_blocking", len(args) > 2 and args[2])
            if into != source and not (non_blocking and not into):  # into pinned memory: the host goes on
                rec._record("upload" if into else "read", name)
        result = func(*args, **kwargs)
        # Any op but a copy computes on the device from a device tensor.
        if rec._tracking and short != "copy_" and any(rec.on_device(t) for t in _tensors((args, kwargs))):
            rec._mark(result)
        return result


def _host_copy(rec: HostSyncRecorder, source: Any, result: Any) -> Any:
    """A read's result as a new host tensor, as on a GPU (on the CPU torch may return ``source`` itself)."""
    if result is source:  # called inside the function mode's handler: the mode is off here
        result = source.clone()
    if isinstance(result, torch.Tensor):  # a host tensor now, whatever op made it
        rec._device_tensors.pop(result, None)
    return result


def _tensors(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return [value]


def _call_site() -> str:
    """The innermost frame outside torch and this module, as ``path:line``."""
    skip = (os.path.dirname(torch.__file__), __file__)
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(skip):
            return f"{frame.filename}:{frame.lineno}"
    return "?"
