"""``find_unused_parameters="auto"``'s fast path kept exact: the step completed as ``True`` would when a gradient
did not arrive (:class:`FastPathStep`), which gradients arrived and the step's usage row (:class:`_Arrivals`), and
an ``all_gather`` whose backward all-reduces on a side group (:func:`all_gather_grad_on`).
See docs/unused-parameters.md."""

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

    The usage row has a value per parameter (``named``'s order): 2 for one this rank missed with no gradient, 1 for
    one missed with a gradient from an earlier micro-batch or an excluded one (``ignored``) that got a gradient;
    summed over ranks, ``2 * world`` means no rank used it. It travels as the gradient of ``sentinel`` in DDP's last
    bucket (at ``sentinel_index`` of ``ddp``'s reducer), or over the gloo ``group`` without one. ``signal_early``:
    nothing excluded, so the sentinel is fed as the last ``synced`` gradient arrives and, unless this rank missed a
    parameter, read one step late."""

    def __init__(self, named: tuple[tuple[str, Parameter], ...], synced: list[int], ignored: list[int], group: Any,
                 *, signal_early: bool, sentinel: Parameter | None = None, ddp: DistributedDataParallel | None = None,
                 sentinel_index: int = -1) -> None:  # fmt: skip
        self.named, self.synced, self.ignored, self.sentinel = named, synced, ignored, sentinel
        self.arrivals = arrivals = _Arrivals(named, synced, group)
        self.late = _LateRead(sentinel) if signal_early and sentinel is not None else None
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

    def complete(self, ddp: DistributedDataParallel, step: int) -> tuple[int, list[str]] | None:
        """Right after backward, on every rank: finish DDP's reduction as ``True`` would. Returns the step and the
        names of the parameters that went without a gradient on some rank, as every rank learns them alike: this
        step's, or on the late path the previous step's (``None``: no event)."""
        arrivals = self.arrivals
        earlier = self.pending()
        missing = [i for i in self.synced if not arrivals.seen[i]]
        dropped = [i for i in self.ignored if self.named[i][1].grad is not None]
        if missing or dropped:
            arrivals.map[dropped] = 1
            arrivals.flag = True
        self._release(missing, feed_sentinel=arrivals.on_last is None, step=step)
        world = ddp.process_group.size()
        if self.sentinel is not None:
            # Every rank feeds the sentinel in backward, and DDP's last bucket reduces it: never None here.
            grad, self.sentinel.grad = self.sentinel.grad, None
            if grad is None:
                raise RuntimeError(f"SoloDDP: step {step}: the unused-parameter sentinel got no gradient")
            if self.late is not None:
                self.late.start(grad, step)
                if not arrivals.flag:  # every parameter got its gradient here: none can be unused on every rank
                    arrivals.armed = False
                    return earlier
            counts = grad.mul(world).round_().to("cpu", torch.int32)  # the ranks' rows, averaged by DDP
            arrivals.armed = False
        else:
            counts = arrivals.receive()
        self._fix(ddp, counts, world)
        if self.late is not None:
            return earlier  # this step's events come with the late read, alike on every rank
        return _events(self.named, counts, step) or earlier

    def pending(self) -> tuple[int, list[str]] | None:
        """The late read not yet taken: the previous step's events (also at the end of fit)."""
        taken = self.late.take() if self.late is not None else None
        return None if taken is None else _events(self.named, taken[1], taken[0])

    def _fix(self, ddp: DistributedDataParallel, counts: torch.Tensor, world: int) -> None:
        values = counts.tolist()
        for i in self.synced:
            if values[i] == 2 * world:
                self.named[i][1].grad = None  # no rank used it: leave it alone, as True does
        for i in self.ignored:  # same order on every rank
            if values[i] > 0:
                param = self.named[i][1]
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                dist.all_reduce(grad, group=ddp.process_group)
                param.grad = grad.div_(world)

    def _release(self, missing: list[int], feed_sentinel: bool, step: int) -> None:
        """Feed zero gradients to the parameters this rank missed, so DDP's held-back buckets all-reduce in order
        (``feed_sentinel``: the sentinel too, with this rank's row)."""
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
            self.arrivals.map[i] = 1 + int(p.grad is None)
        grads = [torch.zeros_like(p) for p in params]
        if self.sentinel is not None and feed_sentinel:
            params.append(self.sentinel)
            grads.append(self._row(self.sentinel))
        if params:
            torch.autograd.backward(params, grads)

    def _row(self, sentinel: Parameter) -> torch.Tensor:
        # All zeros on a step without an event: made on the device, nothing copied from the host.
        if not self.arrivals.flag:
            return torch.zeros_like(sentinel)
        return self.arrivals.map.to(sentinel.device, sentinel.dtype)

    def _signal(self, ddp: DistributedDataParallel, sentinel: Parameter, index: int) -> None:
        # Inside backward: the sentinel gets this rank's row and is marked ready, as its own hook would
        sentinel.grad = self._row(sentinel)
        torch_compat.mark_ready(ddp, index)


def _events(named: tuple[tuple[str, Parameter], ...], counts: torch.Tensor, step: int) -> tuple[int, list[str]] | None:
    names = [named[i][0] for i in counts.nonzero().flatten().tolist()]
    return (step, names) if names else None


class _LateRead:
    """The sentinel's reduced row, copied to the host without waiting, and read one step later."""

    def __init__(self, sentinel: Parameter) -> None:
        cuda = sentinel.is_cuda
        self.host = torch.empty(sentinel.shape, dtype=sentinel.dtype, pin_memory=cuda)
        self.ready = torch.cuda.Event() if cuda else None
        self.step: int | None = None

    def start(self, grad: torch.Tensor, step: int) -> None:
        self.host.copy_(grad, non_blocking=True)  # into pinned memory on a GPU
        if self.ready is not None:
            self.ready.record()
        self.step = step

    def take(self) -> tuple[int, torch.Tensor] | None:
        if self.step is None:
            return None
        if self.ready is not None:
            self.ready.synchronize()  # recorded a whole step ago
        step, self.step = self.step, None
        return step, self.host


class _Arrivals:
    """Whose gradients arrived in the synchronised backward, whether this rank had an event, and its usage row
    (all-reduced on ``group`` without a sentinel). ``on_last``: called as the last synchronised gradient arrives."""

    def __init__(self, named: tuple[tuple[str, Parameter], ...], synced: list[int], group: Any):
        self.seen = bytearray(len(named))
        self.map = torch.zeros(len(named), dtype=torch.int32)
        self.group, self.synced = group, set(synced)
        self.on_last: Callable[[], None] | None = None
        self.left, self.armed, self.flag = 0, False, False
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
        self.left, self.armed, self.work, self.flag = len(self.synced), True, None, False

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
