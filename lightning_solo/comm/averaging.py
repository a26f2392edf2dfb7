"""Post-local-SGD's parameter averaging: in place (parameters keep their memory layout), over all ranks, and
the ranks of each node for its intra-node gradient all-reduce."""

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager


def node_groups(nodes: list[Any]) -> list[list[int]]:
    """The ranks of each node, given each rank's node (``nodes[rank]``), in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for rank, node in enumerate(nodes):
        groups.setdefault(node, []).append(rank)
    return list(groups.values())


def average_in_place(params: list[torch.Tensor], group: Any = None) -> None:
    """Average ``params`` over ``group`` (a collective), writing into each parameter's own storage.

    torch's ``average_parameters`` makes every ``p.data`` a view of one flat buffer: ``channels_last`` weights
    turn contiguous, convolutions re-layout on every call and DDP warns about mismatched strides.
    """
    if not params:
        return
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # one all-reduce; reshape copies each once
    flat /= dist.get_world_size(group)
    dist.all_reduce(flat, group=group)
    for p, chunk in zip(params, flat.split([p.numel() for p in params])):
        p.detach().copy_(chunk.view(p.shape))  # copy_ honours p's strides


class InPlaceAverager(PeriodicModelAverager):
    """torch's ``PeriodicModelAverager`` (same ``period``/``warmup_steps``/``step``) averaging with
    :func:`average_in_place`, so parameters keep their memory layout."""

    def average_parameters(self, params) -> None:
        if self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0:
            average_in_place(list(params), self.process_group)
        self.step += 1
