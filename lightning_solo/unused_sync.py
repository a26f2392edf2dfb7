"""The collectives of ``find_unused_parameters="auto"``'s fast path, apart from DDP's: which gradients arrived in
the synchronised backward and the step's usage map (:class:`_Arrivals`), and an ``all_gather`` whose backward
all-reduces on a side group (:func:`all_gather_grad_on`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import Parameter


class _Arrivals:
    """Fast path: whose gradients arrived in the synchronised backward, this rank's event flag, and the
    step's usage map ``[missing | unused | dropped]``, all-reduced on ``group`` (:meth:`send`, :meth:`receive`).
    ``on_last`` runs in the hook of the last synchronised gradient to arrive."""

    def __init__(self, named: tuple[tuple[str, Parameter], ...], synced: list[int], group: Any):
        self.seen = bytearray(len(named))
        self.map = torch.zeros(3, len(named), dtype=torch.int32)
        self.group, self.synced = group, set(synced)
        self.on_last: Callable[[], None] | None = None
        self.left, self.armed, self.work, self.flag = 0, False, None, 0.0
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, (_, p) in enumerate(named)]

    def _hook(self, i: int):
        synced = i in self.synced

        def arrived(_: Parameter) -> None:
            if self.armed and not self.seen[i]:
                self.seen[i] = 1
                if synced:
                    self.left -= 1
                    if self.left == 0 and self.on_last is not None:
                        self.on_last()

        return arrived

    def arm(self) -> None:
        self.seen[:] = bytes(len(self.seen))
        self.map.zero_()
        self.left, self.armed, self.work, self.flag = len(self.synced), True, None, 0.0

    def send(self) -> None:
        self.work = dist.all_reduce(self.map, group=self.group, async_op=True)

    def receive(self) -> torch.Tensor:
        if self.work is None:
            self.send()
        self.work.wait()
        self.armed, self.work = False, None
        return self.map

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def all_gather_grad_on(tensor: torch.Tensor, group: Any, grad_group: Any) -> torch.Tensor:
    """``all_gather(tensor, sync_grads=True)`` as Lightning returns it (shape ``(world, *tensor.shape)``), whose
    backward all-reduces on ``grad_group``, a gloo group apart from DDP's, so that on the fast path it cannot
    pair with a bucket DDP holds back on another rank (gloo matches collectives per group)."""
    return _AllGatherGradOn.apply(tensor.contiguous(), group, grad_group)


class _AllGatherGradOn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any, grad_group: Any) -> torch.Tensor:
        ctx.rank, ctx.grad_group = dist.get_rank(group), grad_group
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, tensor, group=group)
        return torch.stack(gathered)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # Every rank's loss depends on every rank's tensor: this rank's gradient is the sum of their slices.
        total = grad.detach().to("cpu", copy=True)
        dist.all_reduce(total, group=ctx.grad_group)
        return total[ctx.rank].to(grad.device), None, None
