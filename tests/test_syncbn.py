"""SoloSyncBatchNorm and SoloDDP(sync_batchnorm=...): equivalence with BatchNorm over the global batch.

Raw-torch checks run in 2 real gloo processes (tests/distributed.run_ranks); the Lightning checks go through
SoloDDP's fork launcher. Each rank builds the whole data set from a seed and keeps its own slice, so it can
compute the single-process reference itself.
"""

from __future__ import annotations

import copy
import pickle
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_solo import SoloDDP
from lightning_solo.core import batch_size
from lightning_solo.ddp import syncbn
from lightning_solo.ddp.syncbn.layer import SoloSyncBatchNorm
from lightning_solo.testing import HostSyncRecorder
from tests.distributed import run_ranks
from tests.helpers.modules import TinyModule
from tests.helpers.records import RankRecorder, read_rank_records

TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


# ---------------------------------------------------------------- layer level, 2 gloo ranks


class SequenceBatchNorm(nn.BatchNorm1d):
    """BatchNorm over the channels of ``(batch, time, channels)`` input: a subclass with its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = getattr(self, "calls", 0) + 1
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class BatchNormAct(nn.BatchNorm1d):
    """BatchNorm then ReLU in a forward of its own that never calls ``super().forward`` (as timm's do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                         self.momentum, self.eps)  # fmt: skip
        return F.relu(y)


LAYER_CASES = {
    # name: (layer factory, per-sample shape, per-rank batch sizes, input offset)
    "1d_2D": (lambda: nn.BatchNorm1d(5), (5,), (4, 4), 0.0),
    "1d_3D_uneven": (lambda: nn.BatchNorm1d(3), (3, 7), (2, 5), 0.0),
    "2d_uneven_offset": (lambda: nn.BatchNorm2d(4), (4, 5, 6), (3, 5), 50.0),
    "2d_empty_rank": (lambda: nn.BatchNorm2d(4), (4, 3, 3), (0, 6), 0.0),
    "3d": (lambda: nn.BatchNorm3d(2), (2, 3, 4, 5), (2, 3), 0.0),
    "2d_affine_false": (lambda: nn.BatchNorm2d(4, affine=False), (4, 5, 5), (3, 4), 0.0),
    "2d_no_running_stats": (lambda: nn.BatchNorm2d(4, track_running_stats=False), (4, 5, 5), (3, 2), 0.0),
    "2d_cumulative_momentum": (lambda: nn.BatchNorm2d(4, momentum=None), (4, 5, 5), (2, 6), 0.0),
    # (batch, time, channels) through the subclass's own forward, which reaches the sync through super().forward
    "1d_subclass_forward": (lambda: SequenceBatchNorm(3), (7, 3), (3, 2), 1.0),
}


def _compare_layers(rank: int, world_size: int) -> dict[str, float]:
    errors: dict[str, float] = {}
    for name, (factory, shape, sizes, offset) in LAYER_CASES.items():
        torch.manual_seed(0)
        ref = factory()
        if ref.affine:
            nn.init.uniform_(ref.weight, 0.5, 1.5)
            nn.init.uniform_(ref.bias, -0.5, 0.5)
        mine = syncbn.convert(copy.deepcopy(ref))
        assert isinstance(mine, SoloSyncBatchNorm) and isinstance(mine, type(ref)), name
        start = sum(sizes[:rank])
        for step in range(3):  # several steps: momentum and running statistics accumulate
            x = torch.randn(sum(sizes), *shape) * (step + 1) + offset
            gout = torch.randn_like(x)
            x_ref, x_mine = (
                x.clone().requires_grad_(),
                x[start : start + sizes[rank]].clone().requires_grad_(),
            )
            y_ref, y_mine = ref(x_ref), mine(x_mine)
            (y_ref * gout).sum().backward()
            (y_mine * gout[start : start + sizes[rank]]).sum().backward()
            if sizes[rank]:
                errors[f"{name}/y{step}"] = rel_err(y_mine, y_ref[start : start + sizes[rank]])
                errors[f"{name}/grad_x{step}"] = rel_err(x_mine.grad, x_ref.grad[start : start + sizes[rank]])
        for p_name, p_mine in mine.named_parameters():
            grad = p_mine.grad.clone()
            dist.all_reduce(grad)  # what DDP does (up to its 1/world scale, which the loss has too)
            errors[f"{name}/grad_{p_name}"] = rel_err(grad, getattr(ref, p_name).grad)
        for b_name, b_ref in ref.named_buffers():
            errors[f"{name}/{b_name}"] = rel_err(mine.get_buffer(b_name), b_ref)

        # Eval: running statistics and no communication. Rank 1 does not call, so a collective would make
        # rank 0 hit this group's 3 s timeout.
        silent = dist.new_group(timeout=timedelta(seconds=3))
        mine.process_group = silent
        if rank == 0:
            x = torch.randn(3, *shape) + offset
            errors[f"{name}/eval"] = rel_err(mine.eval()(x), ref.eval()(x))
        dist.barrier()
    return errors


@pytest.mark.multiproc
def test_layers_match_batchnorm_over_the_concatenated_batch():
    for rank, errors in enumerate(run_ranks(_compare_layers, 2)):
        bad = {k: v for k, v in errors.items() if not v <= TOL}
        assert not bad, f"rank {rank}: {bad}"
        assert len(errors) > 60


def _native_vs_solo_on_cuda(rank: int, world_size: int) -> dict[str, float]:
    torch.cuda.set_device(rank)
    nccl = dist.new_group(backend="nccl")  # the default group is gloo; torch's SyncBatchNorm wants nccl
    torch.manual_seed(0)
    sizes, start = (3, 5), 3 * rank
    ref = nn.BatchNorm2d(8).cuda()
    nn.init.uniform_(ref.weight, 0.5, 1.5)
    solo = syncbn.convert(copy.deepcopy(ref), process_group=nccl)
    native = syncbn.convert(copy.deepcopy(ref), native=True, process_group=nccl)
    x = torch.randn(sum(sizes), 8, 6, 6, device="cuda")
    gout = torch.randn_like(x)
    outs = {}
    for name, layer in (("ref", ref), ("solo", solo), ("native", native)):
        xi = (x if name == "ref" else x[start : start + sizes[rank]]).clone().requires_grad_()
        y = layer(xi)
        (y * (gout if name == "ref" else gout[start : start + sizes[rank]])).sum().backward()
        y, gx = (
            (y, xi.grad) if name != "ref" else (y[start : start + sizes[rank]], xi.grad[start : start + sizes[rank]])
        )
        outs[name] = (y, gx, layer.running_var)
    return {
        f"{what}/{name}": rel_err(outs[name][i], outs["ref"][i])
        for name in ("solo", "native")
        for i, what in enumerate(("y", "grad_x", "running_var"))
    }


@pytest.mark.multiproc
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for nccl")
def test_cuda_native_and_solo_agree():
    for errors in run_ranks(_native_vs_solo_on_cuda, 2):
        assert max(errors.values()) <= TOL, errors


# ---------------------------------------------------------------- K DDP steps, 2 gloo ranks


def _small_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4),
    )  # fmt: skip


def _train(model: nn.Module, batches, step_model=None) -> nn.Module:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy((step_model or model)(x), y).backward()
        opt.step()
    return model


def _ddp_vs_single(rank: int, world_size: int, steps: int = 4, batch: int = 4) -> dict[str, float]:
    torch.manual_seed(1)
    init = _small_net()
    data = [
        (torch.randn(world_size * batch, 3, 8, 8), torch.randint(0, 4, (world_size * batch,))) for _ in range(steps)
    ]
    reference = _train(copy.deepcopy(init), data)
    local = [(x[rank * batch : (rank + 1) * batch], y[rank * batch : (rank + 1) * batch]) for x, y in data]
    out = {}
    for sync in (True, False):
        model = copy.deepcopy(init)
        if sync:
            syncbn.convert(model)
        _train(model, local, nn.parallel.DistributedDataParallel(model))
        syncbn.revert(model)
        state, ref_state = model.state_dict(), reference.state_dict()
        out[f"sync={sync}"] = max(rel_err(state[k], ref_state[k]) for k in ref_state if "num_batches" not in k)
    return out


@pytest.mark.multiproc
def test_ddp_steps_with_sync_equal_one_process_with_the_double_batch():
    for errors in run_ranks(_ddp_vs_single, 2):
        assert errors["sync=True"] <= TOL, errors
        assert errors["sync=False"] > 100 * TOL, errors  # plain BN sees only half the batch


def _empty_rank_under_bf16_autocast(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(4, 2, 1))
    net.to(memory_format=torch.channels_last)
    mine = syncbn.convert(copy.deepcopy(net))
    x = torch.randn(6, 3, 5, 5) + 3.0
    local = x[: 0 if rank == 0 else 6].clone().requires_grad_()  # rank 0's batch is empty
    mode = HostSyncRecorder()
    with torch.autocast("cpu", dtype=torch.bfloat16), mode:
        y = mine(local)
        y.float().square().sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the reference: plain BN over the joined batch
        ref_x = x.clone().requires_grad_()
        net(ref_x).float().square().sum().backward()
    out = {"allreduces": mode.allreduces, "syncs": mode.syncs, "y_dtype": str(y.dtype)}
    out["running_var"] = rel_err(mine[1].running_var, net[1].running_var)
    if rank == 1:
        out["y"] = rel_err(y, net(x).detach())
        out["grad_x"] = rel_err(local.grad, ref_x.grad)
    return out


@pytest.mark.multiproc
def test_empty_rank_under_bf16_autocast_no_host_sync_and_same_collectives():
    empty, full = run_ranks(_empty_rank_under_bf16_autocast, 2)
    # Both ranks issue identical all-reduces (fixed dtype and size), or gloo/NCCL would mismatch and hang.
    # Forward: 2C + 1 float64 sums; backward: 2C fp32 sums (the statistics' dtype, not the activations').
    assert empty["allreduces"] == full["allreduces"] == [("torch.float64", 9), ("torch.float32", 8)]
    # A rank with at most one value per channel reads the global count (a clear error, not a device assert).
    assert full["syncs"] == [] and empty["syncs"] == ["item"]
    assert full["y_dtype"] == "torch.bfloat16"  # computed from the bf16 activations, not an fp32 copy
    assert empty["running_var"] <= 1e-5 and full["running_var"] <= 1e-5
    assert full["y"] <= 2e-2 and full["grad_x"] <= 3e-2, full  # bf16 rounding of BN's output/gradient


# ---------------------------------------------------------------- precision: fp32 inside, rounded once

EPS = 1e-5
SHAPES = {"1d": ((8, 6), None), "2d": ((8, 6, 5, 5), None), "2d_channels_last": ((8, 6, 5, 5), torch.channels_last),
          "3d": ((8, 6, 3, 3, 3), None)}  # fmt: skip


def _inputs(shape, layout, dtype, kind: str, g: torch.Generator):
    """x and dy rounded to ``dtype``; dy of the cancellation kinds is built from that x's own x̂, so that
    its terms cancel exactly in the gradient and only the computation's rounding is left."""
    dims = [0, *range(2, len(shape))]
    std, offset = (0.03, 0.0) if kind == "scaled" else (1.0, 3.0)  # scaled: invstd ~30, dy·invstd > fp16's max
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * std + offset).to(dtype)
    x64 = x.double()
    xhat = (x64 - x64.mean(dims, keepdim=True)) * (x64.var(dims, unbiased=False, keepdim=True) + EPS).rsqrt()
    noise = torch.randn(shape, generator=g, dtype=torch.float64)
    dy = {"random": noise, "cancel": 1 + 2 * xhat + 0.01 * noise}.get(kind)
    if kind == "scaled":  # the cancellation case under a GradScaler's 65536 (a 1/16 gradient scaled up)
        dy = 65536 / 16 * (1 + 2 * xhat + 0.01 * noise)
    x, dy = x.to(memory_format=layout or torch.contiguous_format), dy.to(dtype)
    return x, dy.contiguous(memory_format=layout or torch.contiguous_format)


def _precision(rank: int, world_size: int) -> dict[str, dict[str, float]]:
    g, out = torch.Generator().manual_seed(0), {}
    for name, (shape, layout) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for kind in ("random", "cancel", *(("scaled",) if dtype is torch.float16 else ())):
                x, dy = _inputs(shape, layout, dtype, kind, g)
                w, b = torch.linspace(0.5, 1.5, shape[1]), torch.linspace(-0.5, 0.5, shape[1])
                results = {}
                # fp64 from the same rounded inputs; native BN in x's dtype with fp32 parameters (autocast's mix)
                for who, xi, wi, bi in (("ref", x.double(), w.double(), b.double()), ("native", x, w, b)):
                    xi = xi.detach().requires_grad_()
                    y = F.batch_norm(xi, None, None, wi, bi, True, 0.0, EPS)
                    y.backward(dy.to(xi.dtype))
                    results[who] = (y, xi.grad)
                n = shape[0] // world_size
                part = slice(rank * n, (rank + 1) * n)
                xi = x[part].detach().clone().requires_grad_()
                layer = SoloSyncBatchNorm(shape[1], EPS, track_running_stats=False)
                layer.weight.data, layer.bias.data = w.clone(), b.clone()
                y = layer(xi)
                y.backward(dy[part])
                ref_y, ref_grad = results["ref"]
                out[f"{name}/{dtype}/{kind}"] = {
                    "y": rel_err(y, ref_y[part]),
                    "grad_x": rel_err(xi.grad, ref_grad[part]),
                    "native y": rel_err(results["native"][0], ref_y),
                    "native grad_x": rel_err(results["native"][1], ref_grad),
                }
    return out


@pytest.mark.multiproc
def test_output_and_input_gradient_as_exact_as_native_batchnorm_in_every_dtype():
    """fp16/bf16: computed in fp32 and rounded once, as native BN does, so its error bounds ours (within 1.3x
    here; the bf16 cancellation case was 300x with two separately rounded terms, the fp16 scaled one inf).
    fp32: both are one fp32 computation in a different order (within 2.4x here)."""
    for rank, cases in enumerate(run_ranks(_precision, 2)):
        assert len(cases) == 4 * 7
        bad = {}
        for case, e in cases.items():
            factor = 4 if "float32" in case else 2
            if not (e["y"] <= factor * e["native y"] + 1e-6 and e["grad_x"] <= factor * e["native grad_x"] + 1e-6):
                bad[case] = e
        assert not bad, f"rank {rank}: {bad}"


def _too_few_values(rank: int, world_size: int) -> str:
    bn = syncbn.convert(nn.BatchNorm1d(3))
    try:
        bn(torch.randn(1 if rank == 0 else 0, 3))  # one value per channel over both ranks
    except ValueError as err:
        message = str(err)
    dist.barrier()  # both ranks raised at the same layer: they are still in step
    return message


@pytest.mark.multiproc
def test_one_value_per_channel_over_all_ranks_is_a_clear_error_on_every_rank():
    for message in run_ranks(_too_few_values, 2):
        assert "Expected more than 1 value per channel when training, got 1 over all ranks" in message


def _cumulative_average(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(4, momentum=None)
    mine = syncbn.convert(copy.deepcopy(ref))
    recorder = HostSyncRecorder()
    for step in range(3):
        x = torch.randn(8, 4, 3, 3) * (step + 1)
        ref(x)
        with recorder:
            mine(x[4 * rank : 4 * (rank + 1)]).sum().backward()
    return {
        "syncs": recorder.syncs,
        "running_mean": rel_err(mine.running_mean, ref.running_mean),
        "running_var": rel_err(mine.running_var, ref.running_var),
    }


@pytest.mark.multiproc
def test_cumulative_average_momentum_none_reads_nothing_back():
    for out in run_ranks(_cumulative_average, 2):
        assert out["syncs"] == [], out  # 1/num_batches_tracked stays on the device
        assert out["running_mean"] <= TOL and out["running_var"] <= TOL, out


def test_portable_kernels_compute_what_torchs_cuda_kernels_do():
    """The CPU stand-ins of torch's CUDA-only SyncBN kernels, against their formulas (Normalization.cuh) in
    float64; benchmarks/gpu_check.py compares them with the real ones on a GPU."""
    k, g = syncbn.kernels.PORTABLE, torch.Generator().manual_seed(0)
    x, dy = (torch.randn(6, 3, 4, 5, generator=g, dtype=torch.float64) + 2 for _ in range(2))
    w, b = (
        torch.rand(3, generator=g, dtype=torch.float64) + 0.5,
        torch.randn(3, generator=g, dtype=torch.float64),
    )
    dims, view = (0, 2, 3), (1, 3, 1, 1)
    mean, invstd = k.stats(x, EPS)
    torch.testing.assert_close(mean, x.mean(dims))
    torch.testing.assert_close(invstd, (x.var(dims, unbiased=False) + EPS).rsqrt())
    xmu = x - mean.view(view)
    y = k.elemt(x, w, b, mean, invstd, EPS)
    torch.testing.assert_close(y, xmu * (invstd * w).view(view) + b.view(view))
    sum_dy, sum_dy_xmu, grad_w, grad_b = k.backward_reduce(dy, x, mean, invstd, w, True, True, True)
    torch.testing.assert_close(sum_dy, dy.sum(dims))
    torch.testing.assert_close(sum_dy_xmu, (dy * xmu).sum(dims))
    torch.testing.assert_close(grad_w, (dy * xmu).sum(dims) * invstd)
    torch.testing.assert_close(grad_b, dy.sum(dims))
    count = torch.tensor([2 * 20, 4 * 20], dtype=torch.int32)  # what two ranks of 2 and 4 samples send
    grad = k.backward_elemt(dy, x, mean, invstd, w, sum_dy, sum_dy_xmu, count)
    xr = x.clone().requires_grad_()
    F.batch_norm(xr, None, None, w, b, True, 0.0, EPS).backward(dy)
    torch.testing.assert_close(grad, xr.grad)  # count sums to the batch of x: the local formula
    # Merge of per-rank rows (2, 0 and 4 samples; the empty row in the middle, as the CUDA kernel allows).
    parts = [x[:2], x[:0], x[2:]]
    rows = [k.stats(p, EPS) if p.numel() else (torch.zeros(3).double(), torch.ones(3).double()) for p in parts]
    mean_all, invstd_all = (torch.stack(r) for r in zip(*rows))
    running = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    counts = torch.tensor([40.0, 0.0, 80.0], dtype=torch.float64)
    g_mean, g_invstd = k.gather_stats_with_counts(x, mean_all, invstd_all, *running, 0.25, EPS, counts)
    torch.testing.assert_close(g_mean, mean)
    torch.testing.assert_close(g_invstd, invstd)
    torch.testing.assert_close(running[0], 0.25 * mean)
    torch.testing.assert_close(running[1], 0.75 + 0.25 * x.var(dims, unbiased=True))


# ---------------------------------------------------------------- single process: convert / revert / policy


class _TaggedBN(nn.BatchNorm2d):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.tag = "kept"


def test_convert_revert_restore_original_classes_objects_and_keys():
    model = torchvision.models.get_model("resnet18", num_classes=10)
    model.extra = nn.ModuleList([nn.BatchNorm1d(3), nn.BatchNorm3d(3), _TaggedBN(3), nn.SyncBatchNorm(3)])
    layers = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    classes = {name: type(m) for name, m in layers.items()}
    keys = list(model.state_dict())
    calls = []
    model.bn1.register_forward_hook(lambda *_: calls.append(1))

    x = torch.randn(2, 3, 16, 16)
    expected = model.eval()(x)
    for native in (False, True):
        syncbn.convert(model, native=native)
        target = nn.SyncBatchNorm if native else SoloSyncBatchNorm
        # Synchronised, and still of their own class, by name too. Torch's SyncBatchNorm is kept by native, and
        # is a plain SoloSyncBatchNorm on the CPU otherwise (DDP refuses a SyncBatchNorm there).
        kept = {n: m for n, m in layers.items() if n != "extra.3"}
        assert all(isinstance(m, target) and isinstance(m, classes[name]) for name, m in kept.items()), native
        names = [(c.__name__, c.__qualname__, c.__module__) for n, c in classes.items() if n in kept]
        assert [(type(m).__name__, type(m).__qualname__, type(m).__module__) for m in kept.values()] == names
        assert type(model.extra[3]) is (nn.SyncBatchNorm if native else SoloSyncBatchNorm)
        assert model.extra[2].tag == "kept"
        assert list(model.state_dict()) == keys
        if not native:  # without a process group it is plain BatchNorm, and the original input check holds
            torch.testing.assert_close(model.eval()(x), expected)
            with pytest.raises(ValueError, match="4D"):
                model.bn1(torch.randn(2, 64))
        syncbn.revert(model)
        assert {name: type(m) for name, m in model.named_modules() if name in layers} == classes
        assert all(model.get_submodule(name) is m for name, m in layers.items())
        assert list(model.state_dict()) == keys
        assert model.extra[2].tag == "kept" and not hasattr(model.bn1, "process_group")
    assert calls, "forward hooks survive conversion"
    # A reverted model is a plain torchvision model again.
    fresh = torchvision.models.get_model("resnet18", num_classes=10)
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("extra")})


class _Registered(nn.BatchNorm2d):
    registry: ClassVar[dict[str, type]] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.registry[cls.__name__] = cls


class _RegisteredBN(_Registered):
    pass


class _NoSubclasses(nn.BatchNorm2d):
    def __init_subclass__(cls, **kwargs) -> None:
        raise TypeError("final")


class _OwnSyncForward(nn.SyncBatchNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_a_subclass_keeps_its_class_forward_and_pickles_as_before():
    model = nn.Sequential(nn.Linear(4, 3), SequenceBatchNorm(3), nn.Flatten(), nn.Unflatten(1, (2, 3, 3)),
                          _RegisteredBN(2))  # fmt: skip
    keys, x = list(model.state_dict()), torch.randn(5, 6, 4)
    classes = [type(m) for m in model]
    syncbn.convert(model)
    bn = model[1]
    assert all(isinstance(bn, c) for c in (SequenceBatchNorm, nn.BatchNorm1d, SoloSyncBatchNorm))
    names = (type(bn).__name__, type(bn).__qualname__, type(bn).__module__)
    assert names == ("SequenceBatchNorm", SequenceBatchNorm.__qualname__, __name__)
    # (batch, time, channels): the subclass's forward ran (BatchNorm1d's own would refuse 6 channels).
    model(x)
    assert bn.calls == 1 and list(model.state_dict()) == keys
    assert _Registered.registry["_RegisteredBN"] is _RegisteredBN  # the made class did not take its place
    assert type(syncbn.convert(nn.Sequential(SequenceBatchNorm(3)))[0]) is type(bn)  # made once per class
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert [type(m) for m in copied] == [type(m) for m in model]
        torch.testing.assert_close(copied.eval()(x), model.eval()(x))
        assert [type(m) for m in syncbn.revert(copied)] == classes
    syncbn.revert(model)
    assert [type(m) for m in model] == classes
    assert type(pickle.loads(pickle.dumps(model))[1]) is SequenceBatchNorm


def _users_syncbatchnorm_in_ddp_on_cpu(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 3), nn.SyncBatchNorm(3))
    model = syncbn.convert(copy.deepcopy(ref))
    ddp = nn.parallel.DistributedDataParallel(model)  # refuses any torch SyncBatchNorm on the CPU
    x = torch.randn(8, 4)
    y = ddp(x[4 * rank : 4 * (rank + 1)])
    y.sum().backward()
    ref[1].__class__ = nn.BatchNorm1d  # the reference: BatchNorm over the whole batch in one process
    out = {
        "y": rel_err(y, ref(x)[4 * rank : 4 * (rank + 1)]),
        "synced": isinstance(model[1], SoloSyncBatchNorm),
    }
    syncbn.revert(model)
    out["after"] = type(model[1]).__name__
    return out


@pytest.mark.multiproc
def test_a_users_torch_syncbatchnorm_runs_under_ddp_on_cpu():
    for out in run_ranks(_users_syncbatchnorm_in_ddp_on_cpu, 2):
        assert out["synced"] and out["y"] <= TOL and out["after"] == "SyncBatchNorm", out


def test_layers_whose_forward_cannot_reach_the_sync_are_left_alone_and_named():
    model = nn.Sequential(BatchNormAct(3), _OwnSyncForward(3), _NoSubclasses(3), nn.BatchNorm1d(3))
    alone = syncbn.left_alone(model)
    assert [a.split(" (")[0] for a in alone] == ["0", "1", "2"]
    assert "super().forward" in alone[0] and "SyncBatchNorm" in alone[1] and "subclassed" in alone[2]
    syncbn.convert(model)
    assert [type(m) for m in model[:3]] == [BatchNormAct, _OwnSyncForward, _NoSubclasses]
    assert isinstance(model[3], SoloSyncBatchNorm) and isinstance(model[3], nn.BatchNorm1d)


@pytest.mark.parametrize(
    ("kwargs", "value", "reason"),
    [
        (dict(option="auto", has_batchnorm=True, world_size=2, per_device_batch=8), True, "8 < 32"),
        (dict(option="auto", has_batchnorm=True, world_size=2, per_device_batch=32), False, "32 >= 32"),
        (dict(option="auto", has_batchnorm=True, world_size=2, per_device_batch=32, threshold=64), True, "32 < 64"),
        (dict(option="auto", has_batchnorm=True, world_size=1, per_device_batch=2), False, "single process"),
        (dict(option="auto", has_batchnorm=False, world_size=8, per_device_batch=2), False, "no BatchNorm"),
        (dict(option="auto", has_batchnorm=True, world_size=2, per_device_batch=None), False, "unknown"),
        (dict(option=True, has_batchnorm=True, world_size=2, per_device_batch=512), True, "set by the user"),
        (dict(option=False, has_batchnorm=True, world_size=2, per_device_batch=2), False, "set by the user"),
        (dict(option="auto", has_batchnorm=True, world_size=2, per_device_batch=512, trainer_flag=True),
         True, "Trainer(sync_batchnorm=True)"),
        # Layers SyncBN cannot take run as under DDP, and the decision names them; with no other layer it is off.
        (dict(option="auto", has_batchnorm=True, world_size=2, per_device_batch=8, left_alone=["bn (Act)"]),
         True, "left alone, as under DDP: bn (Act)"),
        (dict(option=True, has_batchnorm=False, world_size=2, per_device_batch=8, left_alone=["bn (Act)"]),
         False, "left alone, as under DDP: bn (Act)"),
        (dict(option="auto", has_batchnorm=False, world_size=2, per_device_batch=64, left_alone=["bn (Act)"]),
         False, "64 >= 32"),
        (dict(option=True, has_batchnorm=True, world_size=2, per_device_batch=8, left_alone=list("abcdef")),
         True, "left alone, as under DDP: a, b, c, d and 2 more"),
    ],
)  # fmt: skip
def test_auto_policy(kwargs, value, reason):
    decision = syncbn.decide(kwargs.pop("option"), **kwargs)
    assert decision.setting == "sync_batchnorm" and decision.value is value and reason in decision.reason


def test_bad_options_raise_with_accepted_values():
    with pytest.raises(ValueError, match="'auto'"):
        SoloDDP(sync_batchnorm="yes")
    with pytest.raises(ValueError, match="positive integer"):
        SoloDDP(sync_batchnorm_threshold=0)
    with pytest.raises(ValueError, match="contradicts"):
        syncbn.decide(False, has_batchnorm=True, world_size=2, per_device_batch=2, trainer_flag=True)


def test_per_device_batch_size_sources():
    loader = DataLoader(TensorDataset(torch.zeros(10, 1)), batch_size=5)
    dm = L.LightningDataModule()
    dm.batch_size = 7

    def trainer(loaded=None, source=None, datamodule=None, module=None):
        fit_loop = SimpleNamespace(_data_source=SimpleNamespace(instance=source))
        return SimpleNamespace(
            train_dataloader=loaded, fit_loop=fit_loop, datamodule=datamodule, lightning_module=module
        )

    assert batch_size.per_device_batch_size(trainer(loaded=loader, datamodule=dm)) == 5
    assert batch_size.per_device_batch_size(trainer(source=loader)) == 5
    pre_batched = DataLoader(TensorDataset(torch.zeros(10, 1)), batch_size=None)
    assert batch_size.per_device_batch_size(trainer(loaded=pre_batched, source=pre_batched), 6) == 6
    assert batch_size.per_device_batch_size(trainer(source=dm, datamodule=dm)) == 7
    module = L.LightningModule()
    module.save_hyperparameters({"batch_size": 3})
    assert batch_size.per_device_batch_size(trainer(source=module, module=module)) == 3
    assert batch_size.per_device_batch_size(trainer(source=module, module=L.LightningModule())) is None


# ---------------------------------------------------------------- Lightning + SoloDDP, 2 fork ranks

STEPS, BATCH = 3, 4


class _Data(L.LightningDataModule):
    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        super().__init__()
        self.batch_size = BATCH  # per device, which the auto policy reads
        self.data = TensorDataset(images, labels)

    def train_dataloader(self):
        # Lightning always shuffles the training sampler it injects; an unshuffled one gives rank r the
        # samples r, r+2, ..., so each step's two rank batches together are the single-process batch.
        return DataLoader(self.data, batch_size=self.batch_size, sampler=DistributedSampler(self.data, shuffle=False))


def _bn_classes(trainer, module) -> list[str]:
    """The BatchNorm layers' class names, each with " synced" where SoloSyncBatchNorm's forward is beneath."""
    synced = {True: " synced", False: ""}
    return sorted({type(m).__name__ + synced[isinstance(m, SoloSyncBatchNorm)]
                   for m in module.modules() if "BatchNorm" in type(m).__name__})  # fmt: skip


def _fit(tmp_path: Path, net: nn.Module, images, labels, strategy: SoloDDP, callbacks=(), at_end=None,
         **trainer_kwargs):  # fmt: skip
    # The layer classes during and after fit (after the strategy's teardown), the strategy's decisions, and
    # what the readers of ``at_end`` read when training ends (before the teardown).
    record = RankRecorder(
        tmp_path,
        on_train_start={"during": _bn_classes},
        on_train_end=at_end or {},
        on_fit_end={"after": _bn_classes, "decisions": "decisions"},
    )
    module = TinyModule((), trunk=copy.deepcopy(net), loss="cross_entropy", lr=0.1, momentum=0.9)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, limit_val_batches=0,
        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        use_distributed_sampler=False, callbacks=[record, *callbacks], **trainer_kwargs,
    )  # fmt: skip
    trainer.fit(module, datamodule=_Data(images, labels))
    records = read_rank_records(tmp_path)
    return module.trunk, records


def _reference(net: nn.Module, images, labels) -> nn.Module:
    batches = [(images[i : i + 2 * BATCH], labels[i : i + 2 * BATCH]) for i in range(0, STEPS * 2 * BATCH, 2 * BATCH)]
    return _train(copy.deepcopy(net), batches)


def _max_state_err(model: nn.Module | dict, reference: nn.Module) -> float:
    state = model if isinstance(model, dict) else model.state_dict()
    return max(rel_err(state[k], v) for k, v in reference.state_dict().items() if "num_batches" not in k)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_lightning_auto_sync_equals_single_process_and_checkpoint_loads_into_torchvision(tmp_path):
    torch.manual_seed(0)
    net = torchvision.models.get_model("resnet18", num_classes=10)
    images, labels = torch.randn(STEPS * 2 * BATCH, 3, 16, 16), torch.randint(0, 10, (STEPS * 2 * BATCH,))
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)

    # float64: resnet18 at lr 0.1 is chaotic enough that float32 rounding alone moves it by ~10% in 3 steps.
    trained, records = _fit(
        tmp_path, net, images, labels, SoloDDP(start_method="fork"), callbacks=[ckpt], precision="64-true"
    )
    reference = _reference(net.double(), images.double(), labels)

    for record in records:
        assert record["during"] == ["BatchNorm2d synced"]
        assert record["after"] == ["BatchNorm2d"]  # the original class, not Lightning's _BatchNormXd
        decision = record["decisions"]["sync_batchnorm"]
        assert decision["value"] is True and "per-device batch 4 < 32" in decision["reason"]
        assert "on the world group" in decision["reason"]  # gloo: no group of SyncBN's own
    assert _max_state_err(trained, reference) <= TOL

    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
    fresh = torchvision.models.get_model("resnet18", num_classes=10)
    fresh.load_state_dict({k.removeprefix("trunk."): v for k, v in state.items()})  # strict
    assert _max_state_err(fresh, reference) <= TOL


@pytest.mark.multiproc
@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("strategy_kwargs", "trainer_flag", "synced", "reason"),
    [
        # The policy alone would say no (4 >= 1); Lightning's own flag turns it on, on CPU.
        (dict(sync_batchnorm_threshold=1), True, True, "Trainer(sync_batchnorm=True)"),
        (dict(sync_batchnorm=False), False, False, "set by the user"),
    ],
)
def test_lightning_trainer_flag_and_sync_off(tmp_path, strategy_kwargs, trainer_flag, synced, reason):
    torch.manual_seed(0)
    net = _small_net()
    images, labels = torch.randn(STEPS * 2 * BATCH, 3, 8, 8), torch.randint(0, 4, (STEPS * 2 * BATCH,))
    strategy = SoloDDP(start_method="fork", **strategy_kwargs)
    trained, records = _fit(tmp_path, net, images, labels, strategy, sync_batchnorm=trainer_flag)
    for record in records:
        assert record["decisions"]["sync_batchnorm"]["value"] is synced
        assert reason in record["decisions"]["sync_batchnorm"]["reason"]
        during = ["BatchNorm1d synced", "BatchNorm2d synced"] if synced else ["BatchNorm1d", "BatchNorm2d"]
        assert record["during"] == during
        assert record["after"] == ["BatchNorm1d", "BatchNorm2d"]
    err = _max_state_err(trained, _reference(net, images, labels))
    assert err <= TOL if synced else err > 100 * TOL, err


def _is(trainer, module) -> list[bool]:
    """Whether the (batch, time, channels) net's BatchNorm is what the user's code checks for, and is synced."""
    return [isinstance(module.trunk[1], c) for c in (SequenceBatchNorm, nn.BatchNorm1d, SoloSyncBatchNorm)]


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_lightning_auto_syncs_a_subclass_through_its_own_forward(tmp_path):
    torch.manual_seed(0)
    # (batch, time, channels) input; the subclass normalises the channels by transposing around super().forward.
    net = nn.Sequential(nn.Linear(6, 8), SequenceBatchNorm(8), nn.ReLU(), nn.Flatten(), nn.Linear(5 * 8, 4))
    images, labels = torch.randn(STEPS * 2 * BATCH, 5, 6), torch.randint(0, 4, (STEPS * 2 * BATCH,))
    at_end = {
        "is": _is,
        "calls": lambda t, m: m.trunk[1].calls,
        "running": lambda t, m: [m.trunk[1].running_mean.tolist(), m.trunk[1].running_var.tolist()],
    }
    trained, records = _fit(tmp_path, net, images, labels, SoloDDP(start_method="fork"), at_end=at_end)
    reference = _reference(net, images, labels)
    for record in records:
        assert record["decisions"]["sync_batchnorm"]["value"] is True
        assert "left alone" not in record["decisions"]["sync_batchnorm"]["reason"]
        assert record["is"] == [True, True, True] and record["calls"] == STEPS
        assert record["during"] == ["SequenceBatchNorm synced"] and record["after"] == ["SequenceBatchNorm"]
    # Statistics of the global batch: the same on both ranks, and those of one process given the whole batch.
    assert records[0]["running"] == records[1]["running"]
    ref_running = torch.stack([reference[1].running_mean, reference[1].running_var])
    assert rel_err(torch.tensor(records[0]["running"]), ref_running) <= TOL
    assert _max_state_err(trained, reference) <= TOL
    assert type(trained[1]) is SequenceBatchNorm


def _act_net() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(3 * 8 * 8, 16), BatchNormAct(16),
        nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4),
    )  # fmt: skip


@pytest.mark.multiproc
@pytest.mark.timeout(90)
@pytest.mark.parametrize("option", ["auto", True])
def test_lightning_leaves_a_layer_it_cannot_sync_alone_and_says_so(tmp_path, option):
    torch.manual_seed(0)
    images, labels = torch.randn(STEPS * 2 * BATCH, 3, 8, 8), torch.randint(0, 4, (STEPS * 2 * BATCH,))
    at_end = {
        "is": lambda t, m: [
            isinstance(m.trunk[2], SoloSyncBatchNorm),
            isinstance(m.trunk[4], SoloSyncBatchNorm),
        ]
    }
    strategy = SoloDDP(start_method="fork", sync_batchnorm=option)
    _, records = _fit(tmp_path, _act_net(), images, labels, strategy, at_end=at_end)
    for record in records:
        decision = record["decisions"]["sync_batchnorm"]
        assert decision["value"] is True, decision
        assert "left alone" in decision["reason"] and "trunk.2 (BatchNormAct" in decision["reason"], decision
        assert record["is"] == [False, True]  # BatchNormAct as under DDP; the plain BatchNorm1d synced
        assert record["during"] == ["BatchNorm1d synced", "BatchNormAct"]
        assert record["after"] == ["BatchNorm1d", "BatchNormAct"]


def test_custom_layer_sync_plugin_is_kept():
    class Mine(LayerSync):
        def apply(self, model):
            return model

        def revert(self, model):
            return model

    plugin = Mine()
    trainer = SimpleNamespace(strategy=None)
    decision, chosen = syncbn.decide_layer_sync(trainer, "auto", 32, plugin)
    assert chosen is plugin and decision.value == "Mine"


def test_solo_layer_sync_gives_its_group_to_converted_batchnorm_only():
    theirs = object()  # a SyncBatchNorm's own group (a subgroup, say) is the user's choice: kept
    model = nn.Sequential(nn.BatchNorm2d(3), nn.SyncBatchNorm(3, process_group=theirs))
    syncbn.policy._SoloLayerSync().apply(model)  # no process group here: SyncBN's group is the world (None)
    assert isinstance(model[0], SoloSyncBatchNorm) and isinstance(model[0], nn.BatchNorm2d)
    assert type(model[1]) is SoloSyncBatchNorm  # a SyncBatchNorm on the CPU, which DDP would refuse
    assert model[0].process_group is None and model[1].process_group is theirs
    syncbn.revert(model)
    assert not hasattr(model[0], "process_group") and model[1].process_group is theirs
