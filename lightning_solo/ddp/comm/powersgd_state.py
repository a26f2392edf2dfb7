"""PowerSGD's state per parameter name across DDP's bucket rebuilds and checkpoints. See docs/comm-hooks.md."""

# No `from __future__ import annotations`: DDP inspects hook annotations at registration.
import warnings
from collections.abc import Container
from math import prod
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from lightning_solo._compat import torch as torch_compat
from lightning_solo.checkpoint import rank_shards
from lightning_solo.core.rng import numpy_state, set_numpy_state

_WATCH_ITERATIONS = 3  # DDP rebuilds its buckets once, early (later with static_graph): follow the layout this long


class _PowerSGDState(powersgd.PowerSGDState):
    """torch's PowerSGD state, plus what moves it between bucket layouts."""

    __slots__ = ("layout", "names", "pending", "seen", "serial", "shapes", "watch")
    layout: dict[int, tuple[int, ...]]  # bucket index -> the ids of its parameters
    names: dict[int, str]  # parameter id -> name
    shapes: dict[int, torch.Size]  # parameter id -> shape
    pending: dict[str, dict[str, torch.Tensor]]  # "error" / "q" -> parameter name -> its state
    seen: set[int]  # bucket indices handed over in this iteration
    watch: int  # iterations left to follow the layout
    serial: bool  # finish each bucket before the next (gloo)


def resumable_powerSGD_hook(state: _PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook``, following DDP's bucket layout for its first iterations."""
    if state.watch:
        _follow_layout(state, bucket)
    fut = powersgd.powerSGD_hook(state, bucket)
    if state.serial:
        fut.wait()  # gloo: callbacks issue the later all-reduces; one bucket at a time keeps the ranks' order
    return fut


def new_state(rank: int, start_iter: int) -> _PowerSGDState:
    """A fresh PowerSGD state, holding nothing yet per parameter."""
    state = _PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter)
    state.pending = {}
    return state


def follow(state: _PowerSGDState, module: torch.nn.Module) -> None:
    """Name ``module``'s parameters in ``state`` and follow DDP's bucket layout for its next iterations."""
    named = list(module.named_parameters())
    state.names = {id(p): name for name, p in named}
    state.shapes = {id(p): p.shape for _, p in named}
    state.layout, state.seen, state.watch = {}, set(), _WATCH_ITERATIONS


def state_dict(state: _PowerSGDState, checkpoint_path: Any = None) -> dict[str, Any]:
    """``CommHook.state_dict`` for PowerSGD (a collective): error feedback into this rank's shard beside
    ``checkpoint_path`` (without one: every rank's, gathered)."""
    live = _per_parameter(state, state.layout)
    errors = {**state.pending.get("error", {}), **live["error"]}
    qs = {**state.pending.get("q", {}), **live["q"]}
    mine = {name: t.detach().cpu().clone() for name, t in errors.items()}
    saved = {
        "hook": "powersgd",
        "world_size": dist.get_world_size(),
        "iter": state.iter,
        "rng": numpy_state(state.rng),
        "stats": [state.total_numel_before_compression, state.total_numel_after_compression, state.next_stats_report],
        "q": {name: t.detach().cpu().clone() for name, t in qs.items()},
    }
    if checkpoint_path is None:  # for a notebook's next fit: every rank's, gathered
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return {**saved, "error": gathered}
    return {**saved, "shards": rank_shards.write(checkpoint_path, "powersgd", mine)}


def apply_saved(state: _PowerSGDState, saved: dict[str, Any]) -> None:
    """:func:`state_dict`'s result back into ``state``, for the buckets to come."""
    state.iter = saved["iter"]
    set_numpy_state(state.rng, saved["rng"])
    state.total_numel_before_compression, state.total_numel_after_compression, state.next_stats_report = saved["stats"]
    state.error_dict.clear()
    state.p_memory_dict.clear()
    state.q_memory_dict.clear()
    state.pending = {"q": dict(saved["q"]), "error": dict(saved.get("error") or {})}
    state.layout, state.seen, state.watch = {}, set(), _WATCH_ITERATIONS


def _follow_layout(state: _PowerSGDState, bucket: dist.GradBucket) -> None:
    index, params = bucket.index(), bucket.parameters()
    ids = tuple(id(p) for p in params)
    if state.layout.get(index, ids) != ids:
        to_pending(state, keep=state.seen)
    if index not in state.layout:
        state.layout[index] = ids
        if state.pending:
            buffer = bucket.buffer()
            _assemble(state, index, ids, buffer.device, buffer.dtype)
    state.seen.add(index)
    if bucket.is_last():
        state.seen = set()
        state.watch -= 1
        if state.watch == 0:
            left = sorted(set(state.pending.get("error", {})) | set(state.pending.get("q", {})))
            if left:
                warnings.warn(f"PowerSGD state for {left} matched no DDP bucket and was dropped", stacklevel=2)
            state.pending = {}  # the layout is final now: kept for state_dict()


def _q_order(shapes: list[torch.Size], state: powersgd.PowerSGDState) -> list[tuple[int, int, int]]:
    """(position in bucket, Q length, P length) of the tensors PowerSGD compresses, in ``powerSGD_hook``'s order."""
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for pos, shape in enumerate(shapes):
        n, m = shape[0], prod(shape) // shape[0]
        rank = min(n, m, state.matrix_approximation_rank)
        if torch_compat.should_compress(n, m, rank, state.min_compression_rate):
            groups.setdefault((n, m), []).append((pos, m * rank, n * rank))
    return [item for group in groups.values() for item in group]


def _per_parameter(state: _PowerSGDState, layout: dict[int, tuple[int, ...]]) -> dict[str, dict[str, torch.Tensor]]:
    """The live per-bucket state, split per parameter name (views, no copies)."""
    out: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}
    for index, ids in layout.items():
        names = [state.names[i] for i in ids]
        shapes = [state.shapes[i] for i in ids]
        if index in state.error_dict:
            chunks = state.error_dict[index].split([prod(s) for s in shapes])
            out["error"].update(zip(names, chunks))
        if index in state.q_memory_dict:
            order = _q_order(shapes, state)
            q = state.q_memory_dict[index]
            if sum(length for _, length, _ in order) != q.numel():  # torch changed its Q layout: restart warm start
                continue
            chunks = q.split([length for _, length, _ in order])
            out["q"].update((names[pos], chunk) for (pos, _, _), chunk in zip(order, chunks))
    return out


def to_pending(state: _PowerSGDState, keep: Container[int] = frozenset()) -> None:
    """Move the per-bucket state (except buckets ``keep``) into per-parameter ``pending``."""
    moving = {index: ids for index, ids in state.layout.items() if index not in keep}
    for kind, tensors in _per_parameter(state, moving).items():
        state.pending.setdefault(kind, {}).update((name, t.clone()) for name, t in tensors.items())
    for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
        for index in [i for i in memory if i not in keep]:
            del memory[index]
    state.layout = {index: ids for index, ids in state.layout.items() if index in keep}


def _assemble(state: _PowerSGDState, index: int, ids: tuple[int, ...], device, dtype) -> None:
    names = [state.names[i] for i in ids]
    shapes = [state.shapes[i] for i in ids]
    errors = state.pending.get("error", {})
    if any(name in errors for name in names):
        parts = [errors.pop(name) if name in errors else torch.zeros(s) for name, s in zip(names, shapes)]
        state.error_dict[index] = torch.cat([part.reshape(-1).to(device, dtype) for part in parts])
    qs = state.pending.get("q", {})
    order = _q_order(shapes, state)
    found = [qs.pop(names[pos], None) for pos, _, _ in order]
    fitting = [q for q, (_, length, _) in zip(found, order) if q is not None and q.numel() == length]
    if order and len(fitting) == len(order):
        state.q_memory_dict[index] = torch.cat([q.reshape(-1) for q in fitting]).to(device, dtype)
        # P only has to exist (it is overwritten before it is read) for torch to warm-start from Q.
        p_length = sum(p for _, _, p in order)
        state.p_memory_dict[index] = torch.empty(p_length, device=device, dtype=dtype)
