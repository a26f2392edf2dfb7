"""``find_unused_parameters="auto"``'s fast path kept exact: the step completed as ``True`` would when a gradient
did not arrive (:class:`FastPathStep`), with collectives apart from DDP's: which gradients arrived in the
synchronised backward and the step's usage map (:class:`_Arrivals`), and an ``all_gather`` whose backward
all-reduces on a side group (:func:`all_gather_grad_on`)."""

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
    """One DDP wrapper's fast path (``find_unused_parameters=False``), made exact step by step.

    Args:
        named: the trainable ``(name, parameter)`` pairs at bind time ("our" indices).
        synced: our indices of the parameters DDP synchronises, in the reducer's order.
        ignored: our indices of the parameters excluded from synchronisation.
        group: a gloo group apart from DDP's.
        signal_early: every event shows by the end of backward (nothing excluded): signal as soon as the last
            synchronised gradient arrives, so DDP's last bucket leaves on time.
        ddp, sentinel_index: the wrapper and the sentinel's reducer index, when there is a sentinel.

    See docs/unused-parameters.md."""

    def __init__(self, named: tuple[tuple[str, Parameter], ...], synced: list[int], ignored: list[int], group: Any,
                 *, signal_early: bool, sentinel: Parameter | None = None, ddp: DistributedDataParallel | None = None,
                 sentinel_index: int = -1) -> None:  # fmt: skip
        self.named, self.synced, self.ignored, self.sentinel = named, synced, ignored, sentinel
        self.arrivals = arrivals = _Arrivals(named, synced, group)
        if sentinel is not None and ddp is None:
            raise ValueError("FastPathStep: a sentinel is marked ready in its DDP wrapper: pass `ddp`")
        if signal_early:
            arrivals.on_last = (
                arrivals.send
                if sentinel is None or ddp is None
                else functools.partial(self._signal, ddp, sentinel, sentinel_index)
            )

    def arm(self) -> None:
        self.arrivals.arm()

    def remove(self) -> None:
        self.arrivals.remove()
        self.arrivals.on_last = None  # it may hold the DDP wrapper, which a re-wrap is about to drop

    def complete(self, ddp: DistributedDataParallel, step: int) -> list[str]:
        """Right after backward, on every rank: finish DDP's reduction as ``True`` would. Returns the names of
        the parameters that went without a gradient on some rank (empty: nothing happened)."""
        arrivals = self.arrivals
        missing = [i for i in self.synced if not arrivals.seen[i]]
        dropped = [i for i in self.ignored if self.named[i][1].grad is not None]
        if missing or dropped:
            arrivals.map[2, dropped] = 1
            arrivals.flag = 1.0
        self._release(missing, arrivals.map, feed_sentinel=arrivals.on_last is None, step=step)
        if self.sentinel is not None:
            # Every rank feeds the sentinel in backward, and DDP's last bucket reduces it: never None here.
            if self.sentinel.grad is None:
                raise RuntimeError(f"SoloDDP: step {step}: the unused-parameter sentinel got no gradient")
            anyone = bool(self.sentinel.grad.item() > 0)  # the ranks' flags, averaged by DDP
            self.sentinel.grad = None
            if not anyone:
                arrivals.armed = False
                return []
        counts = arrivals.receive()
        if not counts.any():
            return []
        world = ddp.process_group.size()
        for i in (counts[1] == world).nonzero().flatten().tolist():
            self.named[i][1].grad = None  # no rank used it: leave it alone, as True does
        for i in counts[2].nonzero().flatten().tolist():  # same order on every rank
            param = self.named[i][1]
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            dist.all_reduce(grad, group=ddp.process_group)
            param.grad = grad.div_(world)
        events = ((counts[0] > 0) | (counts[2] > 0)).nonzero().flatten().tolist()
        return [self.named[i][0] for i in events]

    def _release(self, missing: list[int], usage: torch.Tensor, feed_sentinel: bool, step: int) -> None:
        """Feed zero gradients to the parameters whose gradient did not arrive on this rank: DDP's hooks fire,
        the held-back buckets all-reduce in order, and the reduction finishes (``feed_sentinel``: with the
        sentinel, held back on every rank, given this rank's event flag)."""
        if not missing and not feed_sentinel:
            return
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
            usage[0, i] = 1
            usage[1, i] = int(p.grad is None)
        grads = [torch.zeros_like(p) for p in params]
        if self.sentinel is not None and feed_sentinel:
            params.append(self.sentinel)
            grads.append(torch.full_like(self.sentinel, self.arrivals.flag))
        if params:
            torch.autograd.backward(params, grads)

    def _signal(self, ddp: DistributedDataParallel, sentinel: Parameter, index: int) -> None:
        # Inside backward, from the hook of the last gradient to arrive: give the sentinel this rank's flag
        # and mark it ready, as its own gradient hook would.
        sentinel.grad = torch.full_like(sentinel, self.arrivals.flag)
        torch_compat.mark_ready(ddp, index)


class _Arrivals:
    """Fast path: whose gradients arrived in the synchronised backward, this rank's event flag, and the
    step's usage map ``[missing | unused | dropped]``, all-reduced on ``group`` (:meth:`send`, :meth:`receive`).
    ``on_last`` runs in the hook of the last synchronised gradient to arrive."""

    def __init__(self, named: tuple[tuple[str, Parameter], ...], synced: list[int], group: Any):
        self.seen = bytearray(len(named))
        self.map = torch.zeros(3, len(named), dtype=torch.int32)
        self.group, self.synced = group, set(synced)
        self.on_last: Callable[[], None] | None = None
        self.left, self.armed, self.flag = 0, False, 0.0
        self.work: Any = None
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
