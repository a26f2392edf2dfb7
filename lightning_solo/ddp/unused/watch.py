"""What DDP's unused-parameter search cannot see, watched while "auto" has it searching: reentrant checkpointing,
collectives inside backward; and DDP's note that it found nothing, kept quiet. See docs/unused-parameters.md."""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import checkpoint as torch_checkpoint

from lightning_solo._compat.patch import Patches

_substitutions: list[Callable[[], None]] = []  # the active blocks' callbacks, innermost last


def _search_safe_apply(
    cls: type[torch_checkpoint.CheckpointFunction], function: Callable[..., Any], preserve_rng_state: bool, *args: Any
) -> Any:
    if _substitutions and torch.is_grad_enabled() and any(torch.is_tensor(a) and a.requires_grad for a in args):
        _substitutions[-1]()
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state)
    return super(torch_checkpoint.CheckpointFunction, cls).apply(function, preserve_rng_state, *args)


@contextmanager
def search_safe_checkpointing(on_substitute: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Within the block, reentrant checkpoint calls with a grad-requiring input run non-reentrantly, each calling
    ``on_substitute``."""
    with Patches() as patches:
        if not _substitutions:  # the outermost block patches torch's class
            patches.set(torch_checkpoint.CheckpointFunction, "apply", classmethod(_search_safe_apply))
        _substitutions.append(on_substitute)
        try:
            yield
        finally:
            _substitutions.pop()


# Called through the module (`dist.all_reduce(...)`), as torch.distributed.nn and user code do.
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list", "reduce",
    "gather", "scatter", "barrier", "send", "recv", "isend", "irecv",
)  # fmt: skip


@contextmanager
def watch_collectives(note: Callable[[str], None]) -> Iterator[None]:
    """Within the block, each ``torch.distributed`` collective calls ``note("torch.distributed.<name>")`` first."""

    def watched(name: str, collective: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(collective)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not _from_comm_hook():
                note(f"torch.distributed.{name}")
            return collective(*args, **kwargs)

        return call

    with Patches() as patches:
        for module in (dist, dist.distributed_c10d):
            for name in COLLECTIVES:
                if hasattr(module, name):
                    patches.set(module, name, watched(name, getattr(module, name)))
        yield


# DDP's comm hooks (torch's, the pack's ddp/comm/) are DDP's own bucket communication, issued in bucket order.
_COMM_HOOK_FILES = ("ddp_comm_hooks", os.path.join("lightning_solo", "ddp", "comm"))


def _from_comm_hook() -> bool:
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in _COMM_HOOK_FILES):
            return True
        frame = frame.f_back
    return False


_NOTE = b"did not find any unused parameters"
_noted = False


def quiet_search_note(group: Any) -> None:
    """Once per process, on every rank of the gloo ``group``: DDP's once-per-process note that ``True`` found
    nothing unused, given by a one-parameter CPU wrapper while stderr is held, written back without it."""
    global _noted
    if _noted or group is None:
        return
    _noted = True
    with torch.random.fork_rng(devices=[]):  # the layer's initialisation leaves the user's random stream alone
        layer = torch.nn.Linear(1, 1)
    tiny = torch.nn.parallel.DistributedDataParallel(
        layer, process_group=group, find_unused_parameters=True, init_sync=False
    )
    sys.stderr.flush()
    with tempfile.TemporaryFile() as held:
        saved = os.dup(2)
        os.dup2(held.fileno(), 2)
        try:
            tiny(torch.zeros(1, 1))  # DDP searches at the end of forward
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        held.seek(0)
        kept = b"".join(line for line in held.read().splitlines(keepends=True) if _NOTE not in line)
    if kept:
        os.write(2, kept)
