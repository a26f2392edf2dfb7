"""``find_unused_parameters="auto"``'s exact fast path (:class:`FastPathStep`) and :func:`all_gather_grad_on`.
See docs/unused-parameters.md (Fast path)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import Parameter
from torch.nn.parallel import DistributedDataParallel

from lightning_solo._compat import torch as torch_compat


class FastPathStep:
    """One DDP wrapper's fast path (``find_unused_parameters=False``), made exact step by step: each rank's usage
    row rides as the gradient of ``sentinel`` in DDP's last bucket, or over the gloo ``group`` without one
    (docs/unused-parameters.md, Fast path)."""

    def __init__(self, named: tuple[tuple[str, Parameter], ...], synced: list[int], ignored: list[int], group: Any,
                 *, signal_early: bool, sentinel: Parameter | None = None, ddp: DistributedDataParallel | None = None,
                 sentinel_index: int = -1) -> None:  # fmt: skip
        self.named, self.synced, self.ignored, self.sentinel, self.group = named, synced, ignored, sentinel, group
        self.seen, self.row = bytearray(len(named)), torch.zeros(len(named), dtype=torch.int32)
        self.left, self.armed, self.flag = 0, False, False
        self.work: Any = None
        self.on_last: Callable[[], None] | None = None
        if signal_early:
            self.on_last = self._send if sentinel is None else functools.partial(self._signal, ddp, sentinel_index)
        self.late = signal_early and sentinel is not None
        if sentinel is not None and self.late:
            self.host = torch.empty(sentinel.shape, dtype=sentinel.dtype, pin_memory=sentinel.is_cuda)
            self.ready = torch.cuda.Event() if sentinel.is_cuda else None
        self.late_step: int | None = None
        synced_set = set(synced)
        self.handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._arrived, i, i in synced_set))
            for i, (_, p) in enumerate(named)
        ]

    def _arrived(self, i: int, synced: bool, _: Parameter) -> None:
        if self.armed and not self.seen[i]:
            self.seen[i] = 1
            if synced:
                self.left -= 1
                if self.left == 0 and self.on_last is not None:
                    self.on_last()

    def arm(self) -> None:
        self.seen[:] = bytes(len(self.seen))
        self.row.zero_()
        self.left, self.armed, self.work, self.flag = len(self.synced), True, None, False

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.on_last = None  # it may hold the DDP wrapper, which a re-wrap is about to drop

    def complete(self, ddp: DistributedDataParallel, step: int) -> tuple[int, list[str]] | None:
        """Right after backward, on every rank: finish DDP's reduction as ``True`` would. Returns (step, names) of
        the parameters without a gradient on some rank: this step's, or on the late path the previous step's."""
        earlier = self.pending()
        missing = [i for i in self.synced if not self.seen[i]]
        dropped = [i for i in self.ignored if self.named[i][1].grad is not None]
        if missing or dropped:
            self.row[dropped] = 1
            self.flag = True
        self._release(missing, feed_sentinel=self.on_last is None, step=step)
        world = ddp.process_group.size()
        self.armed = False
        if self.sentinel is not None:
            grad, self.sentinel.grad = self.sentinel.grad, None
            if grad is None:
                raise RuntimeError(f"SoloDDP: step {step}: the unused-parameter sentinel got no gradient")
            if self.late:
                self.host.copy_(grad, non_blocking=True)  # into pinned memory on a GPU
                if self.ready is not None:
                    self.ready.record()
                self.late_step = step
                if not self.flag:  # every parameter got its gradient here: none can be unused on every rank
                    return earlier
            counts = grad.mul(world).round_().to("cpu", torch.int32)  # the ranks' rows, averaged by DDP
        else:
            if self.work is None:
                self._send()
            self.work.wait()
            counts, self.work = self.row, None
        self._fix(ddp, counts.tolist(), world)
        if self.late:
            return earlier  # this step's events come with the late read, alike on every rank
        return _events(self.named, counts, step) or earlier

    def pending(self) -> tuple[int, list[str]] | None:
        """The late read not yet taken: the previous step's events (also at the end of fit)."""
        if self.late_step is None:
            return None
        if self.ready is not None:
            self.ready.synchronize()  # recorded a whole step ago
        step, self.late_step = self.late_step, None
        return _events(self.named, self.host, step)

    def _fix(self, ddp: DistributedDataParallel, counts: list[int], world: int) -> None:
        for i in self.synced:
            if counts[i] == 2 * world:
                self.named[i][1].grad = None  # no rank used it: leave it alone, as True does
        for i in self.ignored:  # same order on every rank
            if counts[i] > 0:
                param = self.named[i][1]
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                dist.all_reduce(grad, group=ddp.process_group)
                param.grad = grad.div_(world)

    def _release(self, missing: list[int], feed_sentinel: bool, step: int) -> None:
        """Zero gradients for the parameters this rank missed, releasing DDP's held buckets (and the sentinel's row)."""
        params = [self.named[i][1] for i in missing]
        frozen = [self.named[i][0] for i, p in zip(missing, params) if not p.requires_grad]
        if frozen:
            raise RuntimeError(
                f"SoloDDP: {', '.join(frozen)} stopped requiring grad during step {step} (inside the "
                "forward or backward), after DDP was built with them. Change requires_grad at a batch boundary "
                "(a callback's on_train_batch_start or on_train_epoch_start, as BaseFinetuning does): SoloDDP "
                "re-wraps DDP there."
            )
        for i, p in zip(missing, params):
            self.row[i] = 1 + int(p.grad is None)
        grads = [torch.zeros_like(p) for p in params]
        if self.sentinel is not None and feed_sentinel:
            params.append(self.sentinel)
            grads.append(self._sentinel_row(self.sentinel))
        if params:
            torch.autograd.backward(params, grads)

    def _sentinel_row(self, sentinel: Parameter) -> torch.Tensor:
        return self.row.to(sentinel.device, sentinel.dtype) if self.flag else torch.zeros_like(sentinel)

    def _send(self) -> None:
        self.work = dist.all_reduce(self.row, group=self.group, async_op=True)

    def _signal(self, ddp: Any, index: int) -> None:
        assert self.sentinel is not None
        self.sentinel.grad = self._sentinel_row(self.sentinel)
        torch_compat.mark_ready(ddp, index)


def _events(named: tuple[tuple[str, Parameter], ...], counts: torch.Tensor, step: int) -> tuple[int, list[str]] | None:
    names = [named[i][0] for i in counts.nonzero().flatten().tolist()]
    return (step, names) if names else None


def all_gather_grad_on(tensor: torch.Tensor, group: Any, grad_group: Any) -> torch.Tensor:
    """``all_gather(tensor, sync_grads=True)`` as Lightning returns it, whose backward all-reduces on the gloo
    ``grad_group``, apart from DDP's buckets (docs/unused-parameters.md)."""
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
        total = grad.detach().to("cpu", copy=True)
        dist.all_reduce(total, group=ctx.grad_group)
        return total[ctx.rank].to(grad.device), None, None
