"""SoloSyncBatchNorm (BatchNorm over every rank's batch, any backend) and :func:`convert` / :func:`revert`.
See docs/syncbn.md."""

from __future__ import annotations

import copyreg
import inspect
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.lazy import LazyModuleMixin
from typing_extensions import override

from lightning_solo._compat.torch import BatchNormBase
from lightning_solo.core import ranks
from lightning_solo.ddp.syncbn import kernels
from lightning_solo.ddp.syncbn.wait import SYNCBN_WAIT

_ORIGINAL_CLS = "_solo_original_cls"
_FLOAT = (torch.float32, torch.float64)


def _memory_format(x: Tensor) -> torch.memory_format:
    """The layout the kernels take ``x`` in: channels-last as it is (they have kernels for it), else contiguous."""
    layout = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    if layout is not None and not x.is_contiguous() and x.is_contiguous(memory_format=layout):
        return layout
    return torch.contiguous_format


def _all_reduce(t: Tensor, group: Any) -> None:
    mark = SYNCBN_WAIT.start(t.device)  # for TrainingDoctor: the wait is communication, not compute
    dist.all_reduce(t, group=group)
    SYNCBN_WAIT.stop(mark, t.device)


def _check_count(stats: Tensor, local: int) -> None:
    """Native BatchNorm's error for one value per channel, raised by every rank alike (only a small rank reads)."""
    if local <= 1 and (total := int(stats[-1].item())) <= 1:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got {total} over all ranks (this rank: {local})"
        )


def _update_running(k, x, stats, mean_invstd, running_mean, running_var, factor, eps) -> None:
    """Running statistics from the global ones: torch's kernel when it takes them, else ``lerp_``."""
    if running_mean is None or running_var is None:
        return
    total, dtype = stats[-1:], running_mean.dtype
    if isinstance(factor, float) and dtype in _FLOAT and dtype == mean_invstd.dtype:
        counts = total.to(dtype)
        k.gather_stats_with_counts(x, mean_invstd[:1], mean_invstd[1:], running_mean, running_var, factor, eps, counts)
        return
    mean, var = _moments(stats)
    factor = factor.to(dtype) if isinstance(factor, Tensor) else factor
    running_mean.lerp_(mean.to(dtype), factor)
    running_var.lerp_((var * (total / (total - 1).clamp_min(1))).to(dtype), factor)


def _moments(stats: Tensor) -> tuple[Tensor, Tensor]:
    """Global mean and biased variance (float64) from the all-reduced sums (n·mean, n·(var + mean²), n)."""
    moments = stats[:-1].view(2, -1) / stats[-1:]
    return moments[0], moments[1].addcmul_(moments[0], moments[0], value=-1).clamp_min_(0)


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch-norm over the batch of all ranks in ``group``, each holding its slice (docs/syncbn.md)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, group):
        k = kernels.for_device(x.device)
        x = x.contiguous(memory_format=_memory_format(x))
        channels, count = x.shape[1], x.numel() // x.shape[1]
        acc = kernels.acc_dtype(x)
        with torch.autocast(x.device.type, enabled=False):  # the kernels handle mixed dtypes natively
            if count:
                mean, invstd = k.stats(x, eps)
            else:  # an empty slice still takes part in the collectives, with a count of 0
                mean, invstd = x.new_zeros(channels, dtype=acc), x.new_ones(channels, dtype=acc)
            # float64 sums (n·mean, n·(var + mean²), n): one all-reduce of a fixed size, uneven batches weighted
            stats = torch.cat([mean, invstd, invstd.new_ones(1)]).double()
            stats[channels:-1].pow_(-2).sub_(eps).addcmul_(stats[:channels], stats[:channels])  # var + mean²
            stats.mul_(count)
            _all_reduce(stats, group)
            _check_count(stats, count)
            g_mean, g_var = _moments(stats)
            mean_invstd = torch.stack([g_mean, g_var.add_(eps).rsqrt_()]).to(acc)
            _update_running(k, x, stats, mean_invstd, running_mean, running_var, factor, eps)
            mean, invstd = mean_invstd
            w = weight.to(acc) if weight is not None else None
            b = bias.to(acc) if bias is not None else None
            y = k.elemt(x, w, b, mean, invstd, eps) if count else torch.empty_like(x)
        ctx.save_for_backward(x, weight, mean, invstd, stats[-1:].to(torch.int32))
        ctx.group = group
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, weight, mean, invstd, total = ctx.saved_tensors
        k = kernels.for_device(x.device)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        w = weight.to(mean.dtype) if weight is not None else None
        with torch.autocast(x.device.type, enabled=False):
            if x.numel():
                dy = grad_out.contiguous(memory_format=_memory_format(x))
                sum_dy, sum_dy_xmu, grad_w, grad_b = k.backward_reduce(
                    dy, x, mean, invstd, w, need_x, need_w and w is not None, need_b and w is not None
                )
            else:
                sum_dy = sum_dy_xmu = mean.new_zeros(mean.numel())
                grad_w = grad_b = mean.new_zeros(mean.numel()) if w is not None else None
            grad_x = None
            # Every rank has the same graph: all or none take part. Weight/bias gradients: DDP averages them.
            if need_x:
                sums = torch.cat([sum_dy, sum_dy_xmu])
                _all_reduce(sums, ctx.group)
                sum_dy, sum_dy_xmu = sums.view(2, -1)
                # d/dx of the loss of all ranks, in the statistics' dtype, rounded once to x's
                grad_x = (
                    k.backward_elemt(dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, total)
                    if x.numel()
                    else torch.zeros_like(x)
                )
        grad_weight = grad_w.to(weight.dtype) if need_w and grad_w is not None else None
        grad_bias = grad_b.to(weight.dtype) if need_b and grad_b is not None else None
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def sync_batch_norm(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    eps: float,
    factor: float | Tensor,
    group: Any = None,
) -> Tensor:
    """Training-mode batch norm over every rank's batch. ``factor``: the momentum, or a device tensor."""
    return _SyncBatchNormFunction.apply(x, weight, bias, running_mean, running_var, eps, factor, group)


class SoloSyncBatchNorm(BatchNormBase):
    """BatchNorm with the global batch's training statistics, on any backend; ``torch.nn.BatchNorm{1,2,3}d``'s
    arguments, buffers and keys, plus ``process_group`` (default: all)."""

    # Read by find_unused_parameters="auto" (lightning_solo.ddp.unused.policy): its backward all-reduces.
    communicates_in_backward = True

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        self.process_group = process_group

    @override
    def _check_input_dim(self, input: Tensor) -> None:  # a converted layer runs its own class's check
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @override
    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if input.shape[1] == 0:
            raise ValueError("SoloSyncBatchNorm number of input channels should be non-zero")
        group = getattr(self, "process_group", None)
        # As torch's SyncBatchNorm: eval mode never communicates.
        synced = self.training and ranks.world_size(group) > 1
        factor: float | Tensor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average; synced, its weight stays on the device
                tracked = self.num_batches_tracked
                factor = tracked.reciprocal() if synced else 1.0 / float(tracked)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        pass_buffers = not self.training or self.track_running_stats
        running_mean = self.running_mean if pass_buffers else None
        running_var = self.running_var if pass_buffers else None
        if not synced:
            local = float(factor)  # already a float: the factor stays a tensor only when synced
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, use_batch_stats, local, self.eps
            )
        return sync_batch_norm(input, self.weight, self.bias, running_mean, running_var, self.eps, factor, group)


_SYNC_CLASSES = (nn.SyncBatchNorm, SoloSyncBatchNorm)


def _calls_super_forward(fn: Any) -> bool:
    """Whether ``fn`` calls ``super().forward``, read from its code's names."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return code is not None and {"super", "forward"} <= set(code.co_names)


_MADE: dict[tuple[type, type], type | str] = {}  # synced_class's answers, one per class and target


def synced_class(cls: type, target: type[nn.Module] = SoloSyncBatchNorm) -> type | str:
    """The class ``class cls'(cls, target)`` a layer of ``cls`` takes while synchronised, made once, or why there is
    none (a ``str``). See docs/syncbn.md (Conversion)."""
    if (cls, target) not in _MADE:
        _MADE[cls, target] = _make(cls, target)
    return _MADE[cls, target]


def _make(cls: type, target: type[nn.Module]) -> type | str:
    chain = [c for c in cls.__mro__[: cls.__mro__.index(BatchNormBase)] if "forward" in vars(c)]
    replace = len(chain) == 1 and chain[0] in _SYNC_CLASSES
    if not replace:
        if any(c in _SYNC_CLASSES for c in chain):
            return f"its forward reaches {next(c for c in chain if c in _SYNC_CLASSES).__name__}.forward"
        if bad := [c for c in chain if not _calls_super_forward(vars(c)["forward"])]:
            return f"{bad[0].__name__}.forward does not call super().forward"
    body = {"__reduce_ex__": _reduce_ex, **({"forward": target.forward} if replace else {})}
    try:  # under another name while made: __init_subclass__ registries keep the user's class
        made = types.new_class(f"_Synced{cls.__name__}", (cls, target), exec_body=lambda ns: ns.update(body))
    except Exception as err:  # noqa: BLE001 - a class that refuses the subclass is left alone, not a crash
        return f"its class cannot be subclassed ({type(err).__name__}: {err})"
    made.__name__, made.__qualname__, made.__module__ = cls.__name__, cls.__qualname__, cls.__module__
    made.__doc__ = cls.__doc__
    return made


_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]  # what object.__reduce_ex__ rebuilds an object with


def _reduce_ex(self: nn.Module, protocol: Any) -> Any:
    """Pickling and deepcopy of a converted layer: the made class comes back from its two bases."""
    made = type(self)
    reduced = super(made, self).__reduce_ex__(protocol)
    if isinstance(reduced, tuple) and reduced[0] is _NEWOBJ and reduced[1][0] is made:
        return (_remake, (*made.__bases__, *reduced[1][1:]), *reduced[2:])
    return reduced


def _remake(cls: type, target: type, *args: Any) -> nn.Module:
    made = synced_class(cls, target)
    assert isinstance(made, type), made  # it was made before the layer was pickled
    return made.__new__(made, *args)


def _is_convertible(module: nn.Module, target: type) -> bool:
    if not isinstance(module, BatchNormBase) or isinstance(module, target) or hasattr(module, _ORIGINAL_CLS):
        return False
    # Lazy layers take their real class on the first forward; their parameters do not exist yet.
    return not (isinstance(module, LazyModuleMixin) and module.has_uninitialized_params())


def convert(model: nn.Module, native: bool = False, process_group: Any = None) -> nn.Module:
    """Make every BatchNorm layer of ``model`` synchronised, in place (their class :func:`synced_class` of their own;
    ``torch.nn.SyncBatchNorm`` beneath with ``native=True``); returns ``model``."""
    target = nn.SyncBatchNorm if native else SoloSyncBatchNorm
    for module in model.modules():
        if not _is_convertible(module, target) or isinstance(made := synced_class(type(module), target), str):
            continue
        if not native and isinstance(module, nn.SyncBatchNorm) and _on_cpu(module):
            made = SoloSyncBatchNorm
        original = type(module)
        module.__class__ = made
        setattr(module, _ORIGINAL_CLS, original)
        if not hasattr(module, "process_group") or process_group is not None:
            module.process_group = process_group
    return model


def _on_cpu(module: nn.Module) -> bool:
    tensor = next(iter([*module.parameters(recurse=False), *module.buffers(recurse=False)]), None)
    return tensor is None or tensor.device.type == "cpu"


def left_alone(model: nn.Module, native: bool = False) -> list[str]:
    """The BatchNorm layers :func:`convert` leaves as they are, each as ``"name (Class: why)"``."""
    target = nn.SyncBatchNorm if native else SoloSyncBatchNorm
    return [
        f"{name or '(the model)'} ({type(m).__name__}: {made})"
        for name, m in model.named_modules()
        if _is_convertible(m, target) and isinstance(made := synced_class(type(m), target), str)
    ]


def revert(model: nn.Module) -> nn.Module:
    """Give every layer converted by :func:`convert` its original class back, in place; returns ``model``."""
    for module in model.modules():
        original = module.__dict__.pop(_ORIGINAL_CLS, None)
        if original is None:
            continue
        if not issubclass(original, _SYNC_CLASSES):
            module.__dict__.pop("process_group", None)
        module.__class__ = original
    return model


def backward_collectives(module: nn.Module) -> list[str]:
    """Names of the submodules that issue collectives inside backward: SyncBatchNorm, and any whose class sets
    ``communicates_in_backward = True``."""
    return [
        name or type(module).__name__
        for name, m in module.named_modules()
        if isinstance(m, nn.SyncBatchNorm) or getattr(m, "communicates_in_backward", False)
    ]
