"""SoloSyncBatchNorm: BatchNorm synchronised over any process-group backend (gloo on CPU, nccl on GPU), and
:func:`convert` / :func:`revert`, which swap a model's BatchNorm layers to it and back to their original classes.

* :class:`SoloSyncBatchNorm`: statistics all-reduced over the global batch in forward (one all-reduce
  of ``2C + 1`` float64 values), exact gradients in backward (one all-reduce of ``2C`` float64 values),
  running statistics identical to BatchNorm over the concatenated batch, uneven or empty per-rank batches
  weighted by their element counts, no communication in eval mode. The same code on CPU and CUDA: no host
  sync, no copy of fp16/bf16 activations, same collectives on every rank whatever its autocast dtype.
* :func:`convert` / :func:`revert`: in place, same objects, same state-dict keys, so checkpoints stay
  torchvision-compatible.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.lazy import LazyModuleMixin
from typing_extensions import override

from lightning_solo._compat import torch as torch_compat
from lightning_solo._compat.torch import BatchNormBase
from lightning_solo.core import ranks

# Set on a converted layer: the class to restore at revert.
_ORIGINAL_CLS = "_solo_original_cls"


def _channel_view(t: Tensor, x: Tensor) -> Tensor:
    return t.view(1, -1, *([1] * (x.dim() - 2)))


def _stats_dtype(x: Tensor) -> torch.dtype:
    # Statistics of fp16/bf16 activations are kept in fp32, as torch's BN does; the activations never are.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch-norm over the batch of all ranks in ``group``; each rank holds its own slice of it.

    The same code runs on CPU/gloo and CUDA/nccl, with three properties a GPU run needs:

    * no host sync: the global count stays a device tensor (shapes alone choose the branches);
    * no copy of the activations in another dtype: torch's BN kernels take fp16/bf16 activations with
      fp32 statistics and parameters and accumulate in fp32 themselves;
    * every rank sends the same collectives, whatever its batch (empty included) or autocast dtype:
      ``2C + 1`` float64 values forward, ``2C`` backward.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, group):
        channels, count = x.shape[1], x.numel() // x.shape[1]
        dtype = _stats_dtype(x)
        with torch.autocast(x.device.type, enabled=False):  # the kernels below handle mixed dtypes natively
            if count:
                # The fused statistics kernel; scratch running buffers (momentum 0) make it return fp32 stats
                # of fp16/bf16 input on CPU as well (without them the CPU kernel rounds them to bf16).
                scratch = x.new_zeros(channels, dtype=dtype), x.new_ones(channels, dtype=dtype)
                mean, var = torch.batch_norm_update_stats(x, *scratch, 0.0)
            else:  # an empty slice still takes part in the collectives
                mean = var = x.new_zeros(channels, dtype=dtype)
            # Combined as float64 sums (n·mean, n·(var + mean²), n): exact enough, one all-reduce of a fixed
            # size and dtype whatever the world size, and uneven batches weighted by their counts.
            mean64, var64 = mean.double(), var.double()
            stats = torch.cat(
                [mean64 * count, (var64 + mean64.square()) * count, mean64.new_full((1,), count)]
            )
            dist.all_reduce(stats, group=group)
            total = stats[-1:]
            # A device-side check: on CUDA it fails the step later rather than sync now.
            torch_compat.assert_async(
                total > 1, "Expected more than 1 value per channel when training, in all ranks"
            )
            g_mean = stats[:channels] / total
            g_var = (stats[channels:-1] / total - g_mean.square()).clamp_min_(0)
            if running_mean is not None:
                running_mean.mul_(1 - factor).add_(g_mean.to(running_mean.dtype), alpha=factor)
            if running_var is not None:
                unbiased = g_var * total / (total - 1).clamp_min(1)
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
            mean, var = g_mean.to(dtype), g_var.to(dtype)
            w = weight.to(dtype) if weight is not None else None
            b = bias.to(dtype) if bias is not None else None
            # Normalising with given statistics is batch_norm in eval mode: one fused kernel, output in x's dtype.
            y = F.batch_norm(x, mean, var, w, b, training=False, momentum=0.0, eps=eps)
        ctx.save_for_backward(x, weight, mean, var, total)
        ctx.eps, ctx.group = eps, group
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, weight, mean, var, total = ctx.saved_tensors
        channels = mean.numel()
        with torch.autocast(x.device.type, enabled=False):
            invstd = torch.rsqrt(var + ctx.eps)
            if x.numel():
                # The fused BN backward kernel's weight/bias gradients are exactly the per-channel sums
                # Σ dy·x̂ and Σ dy; its input gradient (local-batch formula) is not asked for.
                _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                    grad_out,
                    x,
                    torch.ones_like(mean),
                    None,
                    None,
                    mean,
                    invstd,
                    True,
                    0.0,
                    [False, True, True],
                )
            else:
                sum_dy_xhat = sum_dy = mean.new_zeros(channels)
            grad_weight = sum_dy_xhat.to(weight.dtype) if ctx.needs_input_grad[1] else None
            grad_bias = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
            grad_x = None
            # Every rank has the same graph, so either all of them or none take part in this all-reduce.
            # Weight/bias gradients stay local: DDP averages them like any other parameter's.
            if ctx.needs_input_grad[0]:
                sums = torch.cat([sum_dy, sum_dy_xhat]).double()
                dist.all_reduce(sums, group=ctx.group)
                means = (sums / total).to(mean.dtype)
                scale = invstd if weight is None else invstd * weight.to(mean.dtype)
                # d/dx of the loss of all ranks (the batch statistics couple every rank's inputs):
                #   scale·(dy - mean(dy)) - scale·mean(dy·x̂)·x̂,  x̂ = (x - μ)·invstd,  means over the global batch.
                # The x̂ term is batch_norm in eval mode (weight -scale·mean(dy·x̂), bias -scale·mean(dy)): fused,
                # x - μ in fp32, output in x's dtype; then dy·scale is added in that dtype.
                grad_x = F.batch_norm(
                    x, mean, var, -scale * means[channels:], -scale * means[:channels], False, 0.0, ctx.eps
                )
                grad_x.addcmul_(grad_out, _channel_view(scale.to(grad_out.dtype), x))
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SoloSyncBatchNorm(BatchNormBase):
    """BatchNorm whose training statistics are those of the global batch, on any backend.

    Same arguments, parameters, buffers and state-dict keys as ``torch.nn.BatchNorm{1,2,3}d``; accepts
    inputs of any rank ≥ 2 (a layer made by :func:`convert` keeps its original class's input check).
    Without an initialised process group, or with a world of one, it is plain BatchNorm; in eval mode
    it uses the running statistics and never communicates.

    Example::

        bn = SoloSyncBatchNorm(64)                    # or syncbn.convert(model) for a whole model
        y = bn(torch.randn(8, 64, 16, 16))            # statistics over the batch of every rank

    Args:
        process_group: the ranks whose batches form the global batch (default: all).
    """

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
    def _check_input_dim(self, input: Tensor) -> None:
        original = getattr(self, _ORIGINAL_CLS, None)
        if original is not None:
            torch_compat.batchnorm_check_input_dim(original, self, input)
        elif input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    @override
    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if input.shape[1] == 0:
            raise ValueError("SoloSyncBatchNorm number of input channels should be non-zero")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        # Buffers are read in eval mode and updated in training mode only when tracked.
        pass_buffers = not self.training or self.track_running_stats
        running_mean = self.running_mean if pass_buffers else None
        running_var = self.running_var if pass_buffers else None

        # Like torch's SyncBatchNorm, only training-mode statistics are synchronised: eval mode never
        # communicates (with track_running_stats=False it normalises with the local batch's statistics).
        group = getattr(self, "process_group", None)
        if not (self.training and ranks.world_size(group) > 1):
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, use_batch_stats, factor, self.eps
            )
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor, group
        )


def _is_convertible(module: nn.Module) -> bool:
    if not isinstance(module, BatchNormBase) or hasattr(module, _ORIGINAL_CLS):
        return False
    # Lazy layers take their real class on the first forward; their parameters do not exist yet.
    return not (isinstance(module, LazyModuleMixin) and module.has_uninitialized_params())


def convert(model: nn.Module, native: bool = False, process_group: Any = None) -> nn.Module:
    """Make every BatchNorm layer of ``model`` synchronised, in place; returns ``model``.

    The layers keep their identity, parameters, buffers, hooks and state-dict keys: only their class
    changes (to :class:`SoloSyncBatchNorm`, or ``torch.nn.SyncBatchNorm`` with ``native=True``, which
    works on CUDA only), and the original class is remembered for :func:`revert`. Swapping the class
    rather than building new modules keeps references held elsewhere (optimizers, EMA copies,
    hooks) valid and lets revert restore the user's exact class with all its attributes.
    """
    target = nn.SyncBatchNorm if native else SoloSyncBatchNorm
    for module in model.modules():
        if not _is_convertible(module) or (native and isinstance(module, nn.SyncBatchNorm)):
            continue
        original = type(module)
        module.__class__ = target
        setattr(module, _ORIGINAL_CLS, original)
        if not hasattr(module, "process_group") or process_group is not None:
            module.process_group = process_group
    return model


def revert(model: nn.Module) -> nn.Module:
    """Give every layer converted by :func:`convert` its original class back, in place; returns ``model``."""
    for module in model.modules():
        original = module.__dict__.pop(_ORIGINAL_CLS, None)
        if original is None:
            continue
        if not issubclass(original, (nn.SyncBatchNorm, SoloSyncBatchNorm)):
            module.__dict__.pop("process_group", None)
        module.__class__ = original
    return model


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, BatchNormBase) for m in model.modules())


def backward_collectives(module: nn.Module) -> list[str]:
    """Names of the submodules that issue collectives inside backward: SyncBatchNorm, and any module whose
    class sets ``communicates_in_backward = True`` (lightning_solo's SyncBN does; so can yours)."""
    return [
        name or type(module).__name__
        for name, m in module.named_modules()
        if isinstance(m, nn.SyncBatchNorm) or getattr(m, "communicates_in_backward", False)
    ]
