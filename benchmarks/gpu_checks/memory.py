"""Checks of memory: AutoBatchSize's prediction against the fit, SoloFSDP with bf16, BatchNorm and a resume."""

from __future__ import annotations

import tempfile
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.gpu_checks.common import trainer


class _MLP(L.LightningModule):
    """Activations grow with the batch (about 40 KiB a sample) next to 5 MiB of weights; SGD with momentum."""

    def __init__(self, samples: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                                 nn.Linear(1024, 10))  # fmt: skip
        self.batch_size, self.samples = 16, samples

    def training_step(self, batch, batch_idx):
        return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(self.samples, 256, generator=g), torch.randint(10, (self.samples,), generator=g)
        )
        return DataLoader(data, batch_size=self.batch_size)


class _Realised(L.Callback):
    """The fit's own peak allocated and reserved memory, from its second step (the first sets up workspaces)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 1 and pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def on_train_end(self, trainer, pl_module):
        if pl_module.device.type == "cuda":
            self.peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def check_autobatch(device: str) -> tuple[bool, str]:
    """AutoBatchSize's predicted peak (the fraction its probe measured) against the fit's realised allocated and
    reserved peaks at that batch; and a budget no batch fits (cap_mb tiny) must come back as too big."""
    from lightning_solo.callbacks import AutoBatchSize

    cap_mb, samples = (256, 16384) if device == "cuda" else (32, 4096)
    finder, realised = AutoBatchSize(cap_mb=cap_mb), _Realised()
    trainer(device, 4, [finder, realised]).fit(_MLP(samples))
    predicted = max(finder.measured)
    reason = finder.decisions["per_device_batch_size"].reason
    detail = f"batch {finder.batch_size} of cap {cap_mb} MiB: predicted {predicted:.3f}"
    ok = finder.low <= predicted <= finder.high
    if device == "cuda":
        allocated, reserved = (peak / (cap_mb * 2**20) for peak in realised.peaks)
        # the fit's steps are the probe's: what it measured is what the fit takes, within the band's half-width
        ok = ok and abs(allocated - predicted) <= finder.tolerance and allocated <= finder.high
        detail += (
            f" allocated ({max(finder.measured_reserved):.3f} reserved), realised {allocated:.3f} allocated "
            f"({reserved:.3f} reserved)"
        )
    else:
        detail += " of the CPU budget (realised: the GPU's figure only)"
    over = AutoBatchSize(cap_mb=0.01, max_probes=3)
    trainer(device, 1, [over]).fit(_MLP(samples))
    too_big = over.batch_size == 1 and "exceeds" in over.decisions["per_device_batch_size"].reason
    detail += f"; over budget (cap 0.01 MiB): batch {over.batch_size}, said too big {too_big}"
    return ok and too_big, detail if ok else f"{detail}; {reason[:200]}"


class _BNNet(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 4))
        self.dtype_seen = None

    def training_step(self, batch, batch_idx):
        out = self.net(batch[0])
        self.dtype_seen = str(out.dtype)
        return nn.functional.cross_entropy(out.float(), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def check_fsdp(device: str) -> tuple[bool, str]:
    """SoloFSDP on the one device (nccl, a one-rank mesh) with BatchNorm: ``precision="auto"`` picks bf16 on a
    GPU; 4 steps, a sharded checkpoint at the epoch's end, a resumed fit to 8 equals 8 straight; the checkpoint
    consolidates into a plain model (weights_only)."""
    from lightning_solo.callbacks import SoloCheckpoint
    from lightning_solo.checkpoint import resolve_ckpt_path
    from lightning_solo.fsdp.consolidate import consolidate
    from lightning_solo.fsdp.strategy import SoloFSDP

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(128, 64, generator=g), torch.randint(0, 4, (128,), generator=g))

    def fit(out: Path, steps: int, resume: bool = False):
        L.seed_everything(0, verbose=False)
        ckpt = SoloCheckpoint(dirpath=out, every_n_train_steps=4, keep_last_k=2)
        fitted = trainer(device, steps, [ckpt], SoloFSDP(min_num_params=1000), enable_checkpointing=True)
        model = _BNNet()
        fitted.fit(
            model,
            DataLoader(data, batch_size=32),
            ckpt_path=resolve_ckpt_path("auto", out) if resume else None,
        )
        return fitted, model, ckpt

    with tempfile.TemporaryDirectory() as directory:  # the checkpoints go with it
        out = Path(directory)
        straight, model, _ = fit(out / "straight", 8)
        fit(out / "run", 4)
        resumed, again, ckpt = fit(out / "run", 8, resume=True)
        diff = max(
            (a.full_tensor() - b.full_tensor()).abs().max().item() / b.full_tensor().abs().max().clamp_min(1e-30).item()
            for a, b in zip(again.parameters(), model.parameters())
        )
        precision = straight.strategy.decisions["fsdp_precision"].value
        bn_precision = straight.strategy.decisions["fsdp_bn_precision"].value
        manifest = consolidate(ckpt.last_model_path, out / "full.ckpt")
        plain = _BNNet().net
        state = torch.load(out / "full.ckpt", weights_only=True)["state_dict"]
        plain.load_state_dict({k.removeprefix("net."): v for k, v in state.items()})
    want = "bf16-mixed" if device == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False) else "32-true"
    ok = precision == want and bn_precision == ("32-true" if want == "bf16-mixed" else "as the model")
    ok = ok and manifest["global_step"] == 8 and resumed.global_step == 8 and diff <= 1e-6
    return ok, (
        f"precision {precision} (compute {model.dtype_seen}), BatchNorm1d inside ({bn_precision}); 4 + resume + 4 vs 8 straight: "
        f"rel. diff {diff:.2g}; consolidated step {manifest['global_step']}, loads into the plain model"
    )
