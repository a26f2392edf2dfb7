"""SoloSyncBatchNorm's five kernels: torch's CUDA ones (:data:`NATIVE`) and CPU-capable ones with the CUDA source's
dtypes and arithmetic (:data:`PORTABLE`). See docs/syncbn.md (Kernels)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


class Kernels(NamedTuple):
    stats: Callable[..., Any]  # (x, eps) -> (mean, invstd)
    gather_stats_with_counts: Callable[..., Any]  # (x, mean, invstd, run_mean, run_var, momentum, eps, counts)
    elemt: Callable[..., Any]  # (x, weight, bias, mean, invstd, eps) -> y
    backward_reduce: Callable[..., Any]  # (dy, x, mean, invstd, weight, input_g, weight_g, bias_g) -> 4
    backward_elemt: Callable[..., Any]  # (dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count) -> dx


def acc_dtype(x: Tensor) -> torch.dtype:
    """The accumulation dtype of torch's BN kernels: fp64 for fp64 inputs, fp32 for all others."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _view(t: Tensor, x: Tensor) -> Tensor:
    return t.view(1, -1, *([1] * (x.dim() - 2)))


def _stats(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Per-channel mean and 1/sqrt(biased var + eps), in the accumulation dtype."""
    channels, acc = x.shape[1], acc_dtype(x)
    # Scratch running buffers: fp32 statistics of fp16/bf16 input (without them, rounded to the input's dtype)
    mean, var = torch.batch_norm_update_stats(x, x.new_zeros(channels, dtype=acc), x.new_ones(channels, dtype=acc), 0.0)
    return mean, var.add_(eps).rsqrt_()


def _gather_stats_with_counts(x, mean_all, invstd_all, running_mean, running_var, momentum, eps, counts):
    """Mean and invstd of the union of the rows' batches (row j: ``counts[j]`` values); the running statistics
    updated in place with the unbiased variance (both given: SoloSyncBatchNorm calls it only then)."""
    counts = counts.to(mean_all.dtype).unsqueeze(1)
    n = counts.sum(0)
    mean = (mean_all * counts).sum(0) / n
    var_n = ((invstd_all.pow(-2) - eps) * counts + (mean_all - mean).square() * counts).sum(0)
    running_mean.copy_(running_mean * (1 - momentum) + mean * momentum)
    running_var.copy_(running_var * (1 - momentum) + var_n / (n - 1) * momentum)
    return mean, (var_n / n + eps).rsqrt()


def _elemt(x, weight, bias, mean, invstd, eps):
    """(x - mean)·invstd·weight + bias: eval-mode batch_norm with var = invstd⁻² and eps float32's smallest normal."""
    return F.batch_norm(x, mean, invstd.pow(-2), weight, bias, False, 0.0, _TINY)


_TINY = torch.finfo(torch.float32).tiny


def _backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
    """Σdy and Σdy·(x - mean) per channel (``None`` unless ``input_g``), and the weight and bias gradients Σdy·x̂
    and Σdy (``None`` unless asked): the fused BN backward's weight/bias gradients with weight 1."""
    _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
        dy, x, torch.ones_like(mean), None, None, mean, invstd, True, 0.0, [False, True, True]
    )
    return (
        sum_dy if input_g else None,
        sum_dy_xhat / invstd if input_g else None,
        sum_dy_xhat.to(weight.dtype) if weight_g else None,
        sum_dy.to(weight.dtype) if bias_g else None,
    )


def _backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    """(dy - Σdy/n - (x - mean)·invstd²·Σdy(x-mean)/n)·invstd·weight, n = Σcount, rounded once (docs/syncbn.md)."""
    norm = count.sum().to(mean.dtype).reciprocal()
    proj = invstd.square() * sum_dy_xmu * norm
    scale = invstd if weight is None else invstd * weight
    # dy·scale + x·a + c (per-channel a, c)
    a, c = -proj * scale, (mean * proj - sum_dy * norm) * scale
    grad = torch.addcmul(_view(c, x), x, _view(a, x))
    return grad.addcmul_(dy, _view(scale, x)).to(x.dtype)


NATIVE = Kernels(
    torch.batch_norm_stats,
    torch.batch_norm_gather_stats_with_counts,
    torch.batch_norm_elemt,
    torch.batch_norm_backward_reduce,
    torch.batch_norm_backward_elemt,
)
PORTABLE = Kernels(_stats, _gather_stats_with_counts, _elemt, _backward_reduce, _backward_elemt)


def for_device(device: torch.device) -> Kernels:
    """torch's own kernels on CUDA (ROCm included), the portable ones everywhere else."""
    return NATIVE if device.type == "cuda" else PORTABLE
