"""Exact resume through Lightning with 2 gloo ranks: a run that crashes (mid-epoch, or at an epoch
boundary) and resumes with ``resume=auto`` equals the uninterrupted run — same parameters, same samples
in the same order on every rank, with dropout (RNG), momentum, a step LR schedule and Lightning's
shuffled DistributedSampler in play."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset, WeightedRandomSampler, random_split

from lightning_solo import SoloDDP
from lightning_solo.callbacks import SoloCheckpoint
from lightning_solo.checkpoint import resolve_ckpt_path, verify
from lightning_solo.ddp.resume.loader import ResumableSampler
from tests.helpers.modules import TinyModule
from tests.helpers.records import RankRecorder, read_rank_records

SAMPLES, BATCH = 44, 4  # 22 samples per rank: 6 batches per epoch, the last one partial
STEPS_PER_EPOCH = 6
MAX_STEPS = 15


class Indexed(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return torch.randn(8, generator=torch.Generator().manual_seed(i)), i


class Crash(Exception):
    pass


class Net(TinyModule):
    """TinyModule with dropout (RNG), momentum and a step LR schedule, on :class:`Indexed` shuffled; each rank
    appends the indices of its batches to ``rank{r}.txt``; ``crash_at``: raises before that step."""

    def __init__(self, log_dir: str, crash_at: int | None = None, batchnorm: bool = False) -> None:
        step_lr = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)  # noqa: E731
        super().__init__((8, 16, 1), activation=None, batchnorm=batchnorm, dropout=0.3, loss="square",
                         batch_size=BATCH, lr=0.05, momentum=0.9, scheduler=step_lr)  # fmt: skip
        self.log_dir, self.crash_at = log_dir, crash_at

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == self.crash_at:
            raise Crash(f"simulated crash before step {self.crash_at + 1}")

    def training_step(self, batch, batch_idx):
        with open(os.path.join(self.log_dir, f"rank{self.global_rank}.txt"), "a") as f:
            f.write(" ".join(map(str, batch[1].tolist())) + "\n")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        return DataLoader(Indexed(), batch_size=BATCH, shuffle=True)


def _decisions(run_dir: str) -> RankRecorder:
    """Rank r writes the strategy's decisions at the start of training to ``run_dir/rank{r}.json``."""
    return RankRecorder(run_dir, on_train_start=("decisions",))


def _fit(run_dir: str, crash_at: int | None = None, resume: str | None = None, **strategy_kwargs) -> dict:
    os.makedirs(run_dir, exist_ok=True)
    L.seed_everything(1234, verbose=False)
    model = Net(run_dir, crash_at)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SoloDDP(start_method="fork", **strategy_kwargs),
        max_steps=MAX_STEPS,
        callbacks=[
            SoloCheckpoint(dirpath=os.path.join(run_dir, "ckpt"), every_n_train_steps=1, keep_last_k=2),
            _decisions(run_dir),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    ckpt_path = resolve_ckpt_path(resume, os.path.join(run_dir, "ckpt"))
    if crash_at is None:
        trainer.fit(model, ckpt_path=ckpt_path)
    else:
        with pytest.raises(Exception, match="simulated crash"):
            trainer.fit(model, ckpt_path=ckpt_path)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _batches(run_dir: str, rank: int) -> list[list[int]]:
    with open(os.path.join(run_dir, f"rank{rank}.txt")) as f:
        return [list(map(int, line.split())) for line in f]


def _check_resume(tmp_path, crashes, **strategy_kwargs) -> None:
    reference = _fit(str(tmp_path / "reference"), **strategy_kwargs)
    for crash_at, consumed in crashes:
        run = str(tmp_path / f"crash{crash_at}")
        _fit(run, crash_at=crash_at, **strategy_kwargs)
        assert verify(os.path.join(run, "ckpt", "last.ckpt"))["global_step"] == crash_at
        resumed = _fit(run, resume="auto", **strategy_kwargs)

        for rank in (0, 1):
            expected, seen = _batches(str(tmp_path / "reference"), rank), _batches(run, rank)
            assert len(expected) == MAX_STEPS
            assert seen == expected, f"rank {rank}: resumed sample order differs (crash at step {crash_at})"
        for name, value in reference.items():
            rel = (resumed[name] - value).norm() / value.norm().clamp_min(1e-12)
            assert rel <= 1e-6, f"{name}: relative difference {rel:.2e} after resuming at step {crash_at}"
        decisions = read_rank_records(run)[0]["decisions"]
        assert decisions["mid_epoch_resume"]["value"] == consumed, decisions["mid_epoch_resume"]
        assert "RNG states restored" in decisions["mid_epoch_resume"]["reason"]
        assert decisions["resumable_data"]["value"] is True


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_resume_equals_uninterrupted_run(tmp_path):
    # mid-epoch 1 (3 of its 6 batches done), and the end of epoch 1
    _check_resume(tmp_path, ((9, 3), (12, 0)))


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_resume_keeps_grad_scaler_and_powersgd_state(tmp_path):
    # Their states travel in the same checkpoint (saved by SoloDDP's precision and comm-hook code); PowerSGD
    # compresses from step 3, so the resumed steps depend on its error feedback and warm-start matrices.
    kwargs = {"precision": "16-mixed", "comm_hook": "powersgd", "powersgd_start_iter": 2}
    _check_resume(tmp_path, ((9, 3),), **kwargs)
    checkpoint = torch.load(tmp_path / "crash9" / "ckpt" / "last.ckpt", weights_only=True)
    assert checkpoint["MixedPrecision"]["scale"] > 0 and checkpoint["lightning_solo.comm_hook"]


def test_resumable_sampler_skips_once_and_keeps_its_length():
    from torch.utils.data import DistributedSampler

    inner = DistributedSampler(range(20), num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler = ResumableSampler(inner, batch_size=2)
    sampler.set_epoch(4)
    full = list(sampler)
    sampler.set_epoch(0)
    sampler.resume_once(4, lambda: 6)
    assert len(sampler) == len(inner) == 10
    assert list(sampler) == full[6:]
    assert list(sampler) == full  # only once: the next epoch is whole again
    sampler.resume_once(0, 6)
    sampler.set_epoch(4)  # Lightning setting the epoch after the resume was armed: its epoch wins
    assert list(sampler) == full[6:]


def test_cuda_rng_is_saved_and_restored_per_rank_across_device_layouts(monkeypatch):
    """Saved on device 5 of 8 visible GPUs, restored in a process that sees 4 and runs on device 1: only the
    rank's own generator travels, onto the device the rank uses now (all-device restore: IndexError)."""
    from lightning_solo.ddp.resume import record as resume

    def fake_cuda(count: int, current: int, store: dict):
        def check(device):
            index = torch.device("cuda", device).index if not isinstance(device, int) else device
            if index >= count:
                raise IndexError(f"device {index} of {count}")
            return index

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": store[check(device)].clone())
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [store[i].clone() for i in range(count)])

        def set_state(state, device="cuda"):
            store[check(device)] = state.clone()

        monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)

    saved_side = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(8)}
    fake_cuda(8, 5, saved_side)
    state = resume.rng_state()
    restored_side = {i: torch.zeros(16, dtype=torch.uint8) for i in range(4)}
    fake_cuda(4, 1, restored_side)
    resume.set_rng_state(state)
    assert torch.equal(restored_side[1], saved_side[5])
    assert all(not restored_side[i].any() for i in (0, 2, 3))


# ------------------------------------------------------------------------------------------------------------
# real loaders: workers, augmentation, validation inside the epoch, accumulation

REAL_SAMPLES = 48  # 24 per rank, batch 4: 6 batches per epoch, validation after batches 3 and 6
VAL_SAMPLES = 8


class Augmented(Dataset):
    """Random augmentation in __getitem__ from all three RNGs, as torchvision/albumentations transforms do."""

    def __len__(self) -> int:
        return REAL_SAMPLES + VAL_SAMPLES

    def __getitem__(self, i: int):
        import random

        import numpy as np

        x = torch.randn(8, generator=torch.Generator().manual_seed(i)) + 0.1 * torch.randn(8)
        if random.random() < 0.5:
            x = x.flip(0)
        return x + float(np.random.uniform(-0.1, 0.1)), i


class RealNet(Net):
    def __init__(self, log_dir: str, crash_at_batch: int | None = None, batchnorm: bool = False) -> None:
        super().__init__(log_dir, batchnorm=batchnorm)
        self.crash_at_batch = crash_at_batch

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.fit_loop.epoch_loop.total_batch_idx == self.crash_at_batch:
            raise Crash(f"simulated crash before batch {self.crash_at_batch}")

    def validation_step(self, batch, batch_idx):
        self.log("val", self.batch_loss(batch) + torch.rand(()), sync_dist=True)  # validation draws too

    def _split(self) -> list:  # as users split one dataset: Subsets, which bring a __getitems__ of their own
        return random_split(Augmented(), [REAL_SAMPLES, VAL_SAMPLES], generator=torch.Generator().manual_seed(0))

    def train_dataloader(self):
        return DataLoader(self._split()[0], batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)

    def val_dataloader(self):
        return DataLoader(self._split()[1], batch_size=BATCH)


def _fit_real(
    run_dir: str,
    crash_at_batch: int | None = None,
    resume: bool = False,
    make_model: Any = RealNet,
    strategy: dict[str, Any] | Strategy | None = None,
    callbacks: tuple[Any, ...] = (),
    checkpoint: Any = None,
    **trainer_kwargs,
) -> dict:
    """``strategy``: SoloDDP's options, or a strategy (stock DDP). ``checkpoint``: the checkpoint callback (default:
    a SoloCheckpoint at each validation), built here as ``checkpoint(dirpath)``."""
    os.makedirs(run_dir, exist_ok=True)
    L.seed_everything(1234, verbose=False)
    model = make_model(run_dir, crash_at_batch)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy if isinstance(strategy, Strategy) else SoloDDP(start_method="fork", **(strategy or {})),
        max_epochs=2,
        val_check_interval=0.5,
        callbacks=[
            (checkpoint or (lambda d: SoloCheckpoint(dirpath=d, keep_last_k=1)))(os.path.join(run_dir, "ckpt")),
            _decisions(run_dir),
            *callbacks,
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **{"default_root_dir": run_dir, **trainer_kwargs},  # reports and the watchdog's hang/ stay in the run's folder
    )
    if crash_at_batch is None:
        trainer.fit(model, ckpt_path="auto" if resume else None)
    else:
        with pytest.raises(Exception, match="simulated crash"):
            trainer.fit(model)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.multiproc
@pytest.mark.timeout(150)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_resume_with_workers_augmentation_validation_and_accumulation_is_exact(tmp_path, accumulate):
    """Loader workers (persistent), augmentation from torch/Python/numpy RNGs in __getitem__, dropout, validation
    twice per epoch that draws random numbers, the checkpoint written at a validation (with accumulation: in the
    middle of a cycle), then a crash and ``fit(ckpt_path="auto")``: the weights end bit-identical."""
    # Crashed after epoch 1's first validation, where SoloCheckpoint saved (with accumulation: mid-cycle).
    decisions = _resumed_equals_reference(
        tmp_path, saved_at_step=9 if accumulate == 1 else 4, accumulate_grad_batches=accumulate
    )
    consumed, reason = decisions["mid_epoch_resume"]["value"], decisions["mid_epoch_resume"]["reason"]
    assert consumed == (3 if accumulate == 1 else 2) and "RNG states restored" in reason
    assert ("accumulation cycle" in reason) == (accumulate == 2)
    assert decisions["resume"]["value"].endswith("last.ckpt")


class DefaultsNet(RealNet):
    """RealNet with what a real model brings to the defaults: BatchNorm (``sync_batchnorm="auto"`` turns
    SyncBN on for a per-device batch of 4), and a branch that rank 1 skips at one step after the evidence
    window (``find_unused_parameters="auto"`` completes it exactly, then switches to True)."""

    def __init__(self, log_dir: str, crash_at_batch: int | None = None, bn: bool = True) -> None:
        super().__init__(log_dir, crash_at_batch, batchnorm=bn)
        self.branch = nn.Linear(16, 16)

    def training_step(self, batch, batch_idx):
        h = self.trunk(batch[0])
        if not (self.global_rank == 1 and self.trainer.fit_loop.epoch_loop.total_batch_idx == 7):
            h = h + self.branch(h)
        return self.out(h).pow(2).mean()


@pytest.mark.multiproc
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("bn", "local_sgd"),
    [(True, False), (False, False), (True, True)],
    ids=["syncbn", "fast_path", "post_local_sgd"],
)
def test_resume_with_every_default_on_is_exact(tmp_path, bn, local_sgd):
    """The defaults together, as a real run meets them: auto unused parameters (a late one-rank skip), auto
    SyncBN, bf16 autocast, WarmupScaledLR, SoloCheckpoint, loader workers with augmentation, validation inside
    the epoch and accumulation; crash, ``fit(ckpt_path="auto")``: the weights end bit-identical, and so does
    LossWatch's trend. With post-local-SGD (local steps from step 2, never averaged before the end) the
    checkpoint holds differing replicas, and every rank must resume its own."""
    from lightning_solo.callbacks import LossWatch, TrainingDoctor, WarmupScaledLR

    local = {"comm_hook": "post_local_sgd", "local_sgd_warmup": 2, "local_sgd_period": 1000} if local_sgd else {}

    def fit(run_dir: str, crash_at_batch: int | None = None, resume: bool = False) -> dict:
        watch = LossWatch(window=2, spread_every_n_steps=2)
        return _fit_real(
            run_dir,
            crash_at_batch,
            resume,
            make_model=lambda log_dir, crash: DefaultsNet(log_dir, crash, bn=bn),
            strategy={"precision": "bf16-mixed", **local},
            callbacks=(
                WarmupScaledLR(reference_batch_size=8, warmup_steps=2),
                # Judging from step 2, so the resume falls in its span; on the fast path the doctor drives it.
                watch if bn else TrainingDoctor(warmup_steps=0, chart=None, loss_watch=watch),
            ),
            accumulate_grad_batches=2,
        )

    reference = fit(str(tmp_path / "reference"))
    assert read_rank_records(tmp_path / "reference")[0]["decisions"]["sync_batchnorm"]["value"] is bn
    run = str(tmp_path / "crash")
    fit(run, crash_at_batch=10)
    resumed = fit(run, resume=True)
    for name, value in reference.items():
        assert torch.equal(resumed[name], value), f"{name}: {(resumed[name] - value).abs().max()} after resuming"

    def loss_trend(run_dir) -> dict:
        checkpoint = torch.load(os.path.join(run_dir, "ckpt", "last.ckpt"), weights_only=True)
        state = checkpoint["callbacks"]["LossWatch" if bn else "TrainingDoctor"]
        return (state if bn else state["loss_watch"])["trend"]

    trend = loss_trend(tmp_path / "reference")
    assert trend["count"] == 6 and trend["lowest"] is not None, trend  # every step, and judged from step 2
    assert loss_trend(run) == trend


def _resumed_equals_reference(tmp_path, crash_at_batch: int = 10, saved_at_step: int = 9, **fit_kwargs) -> dict:
    """Fit uninterrupted, fit again crashing before ``crash_at_batch`` (its last checkpoint at ``saved_at_step``),
    resume with ``ckpt_path="auto"``: the weights must end bit-identical. Returns rank 0's decisions of the
    resumed fit."""
    reference = _fit_real(str(tmp_path / "reference"), **fit_kwargs)
    run = str(tmp_path / "crash")
    _fit_real(run, crash_at_batch=crash_at_batch, **fit_kwargs)
    assert verify(os.path.join(run, "ckpt", "last.ckpt"))["global_step"] == saved_at_step
    resumed = _fit_real(run, resume=True, **fit_kwargs)
    for name, value in reference.items():
        assert torch.equal(resumed[name], value), f"{name}: {(resumed[name] - value).abs().max()} after resuming"
    return read_rank_records(run)[0]["decisions"]


def _every_3_steps(callback: type) -> Any:
    return lambda dirpath: callback(dirpath=dirpath, every_n_train_steps=3, save_last=True)


@pytest.mark.multiproc
@pytest.mark.timeout(150)
@pytest.mark.parametrize("callback", [ModelCheckpoint, SoloCheckpoint])
def test_resume_from_a_step_checkpoint_that_also_validates_is_exact(tmp_path, callback):
    """``every_n_train_steps`` saves at ``on_train_batch_end``, before the validation of that same batch. On
    resume Lightning does not run that validation again but fast-forwards it, building its loader (which draws
    from the RNG) after the training loader's first indices: the RNG must still be the step's at the first
    resumed batch (it was not, and dropout differed)."""
    decisions = _resumed_equals_reference(tmp_path, checkpoint=_every_3_steps(callback))  # saved at step 9
    decision = decisions["mid_epoch_resume"]
    assert decision["value"] == 3 and "RNG states restored" in decision["reason"], decision


class TwoLoaders(RealNet):
    """RealNet on two training loaders at once (Lightning's default ``max_size_cycle``): its shuffled split with
    2 workers, and a shorter one whose ``WeightedRandomSampler`` Lightning wraps for DDP (5 batches of 2 per rank,
    so it starts over inside each epoch and draws a new order then)."""

    def training_step(self, batch, batch_idx):
        (x, i), (xb, ib) = batch["split"], batch["weighted"]
        with open(os.path.join(self.log_dir, f"rank{self.global_rank}.txt"), "a") as f:
            f.write(f"{' '.join(map(str, i.tolist()))} | {' '.join(map(str, ib.tolist()))}\n")
        return self.batch_loss((x, i)) + self.batch_loss((xb, ib))

    def train_dataloader(self):
        weighted = WeightedRandomSampler(torch.linspace(0.1, 1.0, 20).double(), num_samples=20)
        return {
            "split": super().train_dataloader(),
            "weighted": DataLoader(Subset(Augmented(), range(20)), batch_size=2, sampler=weighted),
        }


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_several_training_loaders_and_a_wrapped_weighted_sampler_resume_exactly(tmp_path):
    """Each loader continues at its own position (the short one in its second pass of the epoch), and the
    weighted sampler draws the order it drew in the uninterrupted run, from the RNG state its pass started at."""
    decisions = _resumed_equals_reference(tmp_path, make_model=TwoLoaders, checkpoint=_every_3_steps(ModelCheckpoint))
    for rank in (0, 1):
        expected, seen = _batches_of(tmp_path / "reference", rank), _batches_of(tmp_path / "crash", rank)
        assert seen == expected, f"rank {rank}: the resumed batches differ"
    assert decisions["resumable_data"]["value"] is True, decisions["resumable_data"]
    assert "WeightedRandomSampler (in Lightning's DistributedSamplerWrapper)" in decisions["resumable_data"]["reason"]
    resumed = decisions["mid_epoch_resume"]
    assert resumed["value"] == 3 and "2 loaders (max_size_cycle) at batches [3, 3]" in resumed["reason"], resumed


def _batches_of(run_dir, rank: int) -> list[str]:
    # The crashed fit's lines up to its last checkpoint, then the resumed fit's, are the uninterrupted run's.
    lines = (run_dir / f"rank{rank}.txt").read_text().splitlines()
    return lines[:9] + lines[-3:] if len(lines) > 12 else lines


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_exact_resume_false_keeps_lightnings_streams(tmp_path):
    """``SoloDDP(exact_resume=False)`` is Lightning's loader and RNG streams: with loader workers, random
    augmentation, dropout and validations inside the epoch that draw random numbers, the fit ends bit-identical
    to stock DDP's (SoloDDP's default seeds samples from (seed, epoch, index) and isolates validations, which
    its Decision says)."""
    stock = _fit_real(str(tmp_path / "stock"), strategy=DDPStrategy(start_method="fork"))
    solo = _fit_real(str(tmp_path / "solo"), strategy={"exact_resume": False})
    for name, value in stock.items():
        assert torch.equal(solo[name], value), f"{name}: {(solo[name] - value).abs().max()}"
    decision = read_rank_records(tmp_path / "solo")[0]["decisions"]["resumable_data"]
    assert decision["value"] is False and "exact_resume=False" in decision["reason"], decision
    default = _fit_real(str(tmp_path / "default"))
    assert not all(torch.equal(default[name], value) for name, value in stock.items())
    decision = read_rank_records(tmp_path / "default")[0]["decisions"]["resumable_data"]
    assert "(seed, epoch, index)" in decision["reason"] and "exact_resume=False" in decision["reason"]
