"""Post-local-SGD's parameter averaging: in place (parameters keep their memory layout), over all ranks, and
the ranks of each node for its intra-node gradient all-reduce."""

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from lightning_solo.core import cpu_malloc


def node_groups(nodes: list[Any]) -> list[list[int]]:
    """The ranks of each node, given each rank's node (``nodes[rank]``), in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for rank, node in enumerate(nodes):
        groups.setdefault(node, []).append(rank)
    return list(groups.values())


def average_in_place(params: list[torch.Tensor], group: Any = None) -> None:
    """Average ``params`` over ``group`` (a collective) into each parameter's own storage, through flat buffers
    under ``CHUNK_BYTES`` (a large contiguous one in place). See docs/comm-hooks.md."""
    world = dist.get_world_size(group)
    for chunk in _chunks(params):
        in_place = len(chunk) == 1 and chunk[0].is_contiguous()
        flat = chunk[0].detach() if in_place else torch.cat([p.detach().reshape(-1) for p in chunk])
        flat /= world
        dist.all_reduce(flat, group=group)
        if not in_place:
            for p, part in zip(chunk, flat.split([p.numel() for p in chunk])):
                p.detach().copy_(part.view(p.shape))  # copy_ honours p's strides


CHUNK_BYTES = cpu_malloc.MMAP_THRESHOLD // 2


def _chunks(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` in order, in groups under ``CHUNK_BYTES`` each (a larger parameter alone)."""
    chunks: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if not chunks or size + nbytes > CHUNK_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += nbytes
    return chunks


class InPlaceAverager(PeriodicModelAverager):
    """torch's ``PeriodicModelAverager`` (same ``period``/``warmup_steps``/``step``) averaging with
    :func:`average_in_place`, so parameters keep their memory layout."""

    def average_parameters(self, params) -> None:
        if self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0:
            average_in_place(list(params), self.process_group)
        self.step += 1
