"""Checks of SoloSyncBatchNorm on the device: the conversion in a fit, the autograd function against fp64, two
ranks with an empty one."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.gpu_checks.common import fit_solo, now, one_rank_group, rel_err
from lightning_solo.ddp import syncbn
from lightning_solo.ddp.syncbn import kernels
from lightning_solo.testing import HostSyncRecorder, run_ranks


def check_syncbn_cuda(device: str) -> tuple[bool, str]:
    """``SoloDDP(sync_batchnorm=True)`` on the device synchronises BatchNorm for the fit (a BatchNorm2d still, with
    SoloSyncBatchNorm's forward) and reverts it to the original class after."""
    from torch import nn

    during: dict = {}

    class WithBN(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1),
                nn.BatchNorm2d(8),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(8, 4),
            )

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_start(self):
            bn = self.net[1]
            synced = " synced" if isinstance(bn, syncbn.SoloSyncBatchNorm) else ""
            during.update(cls=type(bn).__name__ + synced, device=bn.running_mean.device.type)

    g = torch.Generator().manual_seed(0)

    data = TensorDataset(torch.randn(32, 3, 8, 8, generator=g) + 2.0, torch.randint(4, (32,), generator=g))
    module = WithBN()
    trainer = fit_solo(device, module, DataLoader(data, batch_size=8), steps=3, sync_batchnorm=True)
    bn = module.net[1]
    decision = trainer.strategy.decisions["sync_batchnorm"]
    ok = (
        during.get("cls") == "BatchNorm2d synced"
        and during.get("device") == device
        and type(bn) is nn.BatchNorm2d
        and bn.running_mean.abs().sum().item() > 0
        and decision.value is True
    )
    return ok, (
        f"during fit: {during.get('cls')} on {during.get('device')}; after: {type(bn).__name__}, running_mean "
        f"moved {bn.running_mean.abs().sum().item() > 0}; decision {decision.value!r} ({decision.reason[:60]})"
    )


def _syncbn_rank(rank: int, world_size: int, device: str) -> dict:

    from torch import nn

    from lightning_solo.ddp import syncbn

    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks on the one GPU
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Conv2d(16, 4, 1)).to(device)
    net.to(memory_format=torch.channels_last)
    mine = syncbn.convert(copy.deepcopy(net))
    x = torch.randn(8, 3, 16, 16, device=device) + 3.0
    local = x[: 0 if rank == 0 else 8].clone().requires_grad_()
    recorder = HostSyncRecorder()
    with torch.autocast(device, dtype=torch.bfloat16), recorder:
        y = mine(local)
        y.float().square().sum().backward()
    ref_x = x.clone().requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        ref_y = net(ref_x)
        ref_y.float().square().sum().backward()

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()

    out = {
        "syncs": recorder.syncs,
        "allreduces": recorder.allreduces,
        "dtype": str(y.dtype),
        "running_var": rel(mine[1].running_var, net[1].running_var),
    }
    if rank == 1:
        out.update(y=rel(y.detach(), ref_y.detach()), grad_x=rel(local.grad, ref_x.grad))
    return out


def check_syncbn(device: str) -> tuple[bool, str]:
    """2 processes on the GPU, rank 0's batch empty, bf16 autocast: output, input gradient and running statistics
    against BatchNorm over the joined batch; no host sync on the full rank; identical collectives."""
    empty, full = run_ranks(_syncbn_rank, 2, device)
    ok = (
        full["syncs"] == []
        and len(empty["syncs"]) == 1  # the empty rank reads the global count (a clear error, not an assert)
        and empty["allreduces"] == full["allreduces"]
        and full["dtype"] == "torch.bfloat16"
        and max(empty["running_var"], full["running_var"]) <= 1e-4
        and full["y"] <= 2e-2
        and full["grad_x"] <= 3e-2
    )
    return ok, (
        f"rel. err y {full['y']:.2g}, grad_x {full['grad_x']:.2g}, running_var {full['running_var']:.2g}; "
        f"host syncs {len(empty['syncs']) + len(full['syncs'])}; all-reduces {full['allreduces']} on both ranks"
    )


EPS = 1e-5
_KINDS = {torch.float32: ("random", "cancel"), torch.bfloat16: ("random", "cancel"),
          torch.float16: ("random", "cancel", "scaled")}  # fmt: skip


def _shapes(device: str) -> dict[str, tuple[tuple[int, ...], torch.memory_format]]:
    n, c, hw = (32, 64, 16) if device == "cuda" else (8, 6, 5)
    return {
        "1d": ((n, c), torch.contiguous_format),
        "2d": ((n, c, hw, hw), torch.contiguous_format),
        "2d channels_last": ((n, c, hw, hw), torch.channels_last),
        "3d": ((n // 4, c, 4, hw // 2, hw // 2), torch.contiguous_format),
        "3d channels_last": ((n // 4, c, 4, hw // 2, hw // 2), torch.channels_last_3d),
    }


def _inputs(shape, layout, dtype, kind: str, device: str, g: torch.Generator):
    """x and dy rounded to ``dtype``; dy = 1 + 2·x̂ + 0.01·ε (cancel) nearly cancels in the input gradient, and
    ``scaled`` is that under a GradScaler's 65536 (a 1/16 gradient) with invstd ~30: dy·invstd > fp16's max."""
    dims = [0, *range(2, len(shape))]
    std, offset = (0.03, 0.0) if kind == "scaled" else (1.0, 3.0)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * std + offset).to(device, dtype)
    x64 = x.double()
    xhat = (x64 - x64.mean(dims, keepdim=True)) * (x64.var(dims, unbiased=False, keepdim=True) + EPS).rsqrt()
    noise = torch.randn(shape, generator=g, dtype=torch.float64).to(device)
    dy = noise if kind == "random" else (1 + 2 * xhat + 0.01 * noise) * (65536 / 16 if kind == "scaled" else 1)
    return x.contiguous(memory_format=layout), dy.to(dtype).contiguous(memory_format=layout)


def _bn(x, dy, w, b, group=None):
    """Output and input (and weight) gradient of training-mode BN: native with ``group=None``, else the sync
    function on ``group`` with running statistics updated (fp32 buffers, momentum 0.1)."""
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_() if w is not None else None
    if group is None:
        y = nn.functional.batch_norm(x, None, None, w, b, True, 0.0, EPS)
    else:
        c = x.shape[1]
        running = torch.zeros(c, device=x.device), torch.ones(c, device=x.device)
        y = syncbn.sync_batch_norm(x, w, b, *running, EPS, 0.1, group)
    y.backward(dy.to(x.dtype))
    return y.detach(), x.grad, None if w is None else w.grad


@contextmanager
def _kernels(chosen: kernels.Kernels):
    """The sync function with ``chosen`` kernels (the portable ones on CUDA tensors, to compare the two sets)."""
    original = kernels.for_device
    kernels.for_device = lambda device: chosen
    try:
        yield
    finally:
        kernels.for_device = original


def _sweep(device: str, group) -> tuple[list[str], float, int]:
    """Every shape, layout, dtype, affine and dy kind: the sync function's error against fp64 beside native BN's.
    Returns the failing cases, the worst share of its bound (factor × native's error + 1e-6) and the case count."""
    g, bad, worst, cases = torch.Generator().manual_seed(0), [], 0.0, 0
    for name, (shape, layout) in _shapes(device).items():
        for dtype, kinds in _KINDS.items():
            for affine in (True, False):
                for kind in kinds:
                    x, dy = _inputs(shape, layout, dtype, kind, device, g)
                    c = shape[1]
                    w, b = ((torch.linspace(0.5, 1.5, c, device=device), torch.linspace(-0.5, 0.5, c, device=device))
                            if affine else (None, None))  # fmt: skip
                    ref = _bn(x.double(), dy.double(), *(t.double() if t is not None else None for t in (w, b)))
                    native = _bn(x, dy, w, b)
                    with _no_host_sync(device):
                        ours = _bn(x, dy, w, b, group)
                    factor = 4 if dtype is torch.float32 else 2
                    for what, o, n, r in zip(("y", "grad_x", "grad_w"), ours, native, ref):
                        if r is None:
                            continue
                        e_ours, e_native = rel_err(o, r), rel_err(n, r)
                        bound = factor * e_native + 1e-6
                        worst = max(worst, e_ours / bound)
                        if e_ours > bound:
                            case = f"{name} {dtype} affine={affine} {kind} {what}"
                            bad.append(f"{case}: {e_ours:.2g} vs native {e_native:.2g}")
                    cases += 1
    return bad, worst, cases


@contextmanager
def _no_host_sync(device: str):
    """On CUDA any host sync inside raises (``set_sync_debug_mode("error")``)."""
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")


def _cost(device: str, group) -> str:
    """Forward + backward of one 2d channels_last bf16 layer: ms (median of 20) and kernels (aten ops on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    shape = (32, 64, 56, 56) if device == "cuda" else (8, 16, 8, 8)
    x, dy = _inputs(shape, torch.channels_last, torch.bfloat16, "random", device, torch.Generator().manual_seed(1))
    w, b = torch.ones(shape[1], device=device), torch.zeros(shape[1], device=device)
    out = []
    for who, grp in (("sync", group), ("native", None)):
        times = []
        for _ in range(25):
            start = now(device)
            _bn(x, dy, w, b, grp)
            times.append(now(device) - start)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as prof:
            _bn(x, dy, w, b, grp)
            if device == "cuda":
                torch.cuda.synchronize()
        if device == "cuda":
            count = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
            unit = "kernels"
        else:
            count = sum(1 for e in prof.events() if e.name.startswith("aten::"))
            unit = "aten ops"
        out.append(f"{who} {sorted(times)[len(times) // 2] * 1e3:.3f} ms, {count} {unit}")
    return f"one layer {tuple(shape)} bf16 channels_last fwd+bwd: " + ", ".join(out)


def check_syncbn_fn(device: str) -> tuple[bool, str]:
    """The sync function itself on a one-rank group (nccl on CUDA; a world of one makes the layer plain BN, so
    the function is called directly), under ``set_sync_debug_mode("error")`` on CUDA: every dtype, layout, rank
    of input, affine on and off, the cancelling dy and fp16's scaled one, against fp64 with native BN's error
    beside it; the portable kernels on the same CUDA tensors; time and kernels per layer."""
    with one_rank_group(device) as group:
        bad, worst, cases = _sweep(device, group)
        portable = ""
        if device == "cuda":
            with _kernels(kernels.PORTABLE):
                p_bad, p_worst, _ = _sweep(device, group)
            bad += [f"portable: {b}" for b in p_bad]
            portable = f"; the portable kernels on the CUDA tensors: worst {p_worst:.2f} of the bound"
        cost = _cost(device, group)
    bound = "2x native BN's error against fp64 for fp16/bf16, 4x for fp32, + 1e-6"
    synced = ", no host sync" if device == "cuda" else ""
    head = f"{cases} cases{synced}, worst at {worst:.2f} of the bound ({bound}){portable}; {cost}"
    return not bad, head if not bad else f"{head}; FAILED: " + "; ".join(bad[:6])
