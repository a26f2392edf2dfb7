"""LossWatch: the trend and rank-spread arithmetic as tables; on 2 real gloo ranks, a NaN loss on rank 1 stops both
ranks at that step before the optimizer step, naming rank 1, after ranks fed differently distributed labels
were flagged; a normal run raises no alarm."""

from __future__ import annotations

import math
import random
import time

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_solo import SoloDDP
from lightning_solo.callbacks import LossWatch
from lightning_solo.diagnostics.loss_trend import LossTrend, rank_spread
from lightning_solo.diagnostics.loss_watch import NonFiniteLossError, decide_grad_check
from tests.helpers.records import read_rank_records, write_rank_record


def _series(kind: str, n: int = 400) -> list[float]:
    rng = random.Random(0)
    noise = [rng.gauss(0, 0.05) for _ in range(n)]
    if kind == "decreasing":
        return [2.0 * math.exp(-i / 100) + 0.3 + noise[i] for i in range(n)]
    if kind == "noise":
        return [1.0 + 3 * noise[i] for i in range(n)]
    if kind == "spike":
        return [1.0 + noise[i] + (4.0 if i == 300 else 0.0) for i in range(n)]
    if kind == "climb":
        return [1.0 + noise[i] + (0.005 * (i - 200) if i > 200 else 0.0) for i in range(n)]
    if kind == "seesaw":
        return [1.0 + noise[i] + (0.4 * (-1) ** i if i > 200 else 0.0) for i in range(n)]
    if kind == "negative":  # a loss that can go below zero: no ratio is meaningful
        return [-0.01 * i + noise[i] for i in range(n)]
    raise ValueError(kind)


@pytest.mark.parametrize(
    ("kind", "events", "remedy"),
    [
        ("decreasing", {}, None),
        ("noise", {}, None),
        ("negative", {}, None),
        ("spike", {"spike": 300}, "gradient_clip_val"),
        ("climb", {"climb": None}, "warmup_steps"),
        ("seesaw", {"seesaw": None}, "rule='sqrt'"),
    ],
)
def test_trend_events_and_their_advice(kind, events, remedy):
    trend = LossTrend(window=50)
    for step, loss in enumerate(_series(kind)):
        trend.update(step, loss)
    assert set(trend.events) == set(events)
    for name, step in events.items():
        if step is not None:
            assert trend.events[name][0][0] == step
    advice = trend.advice()
    assert set(advice) == set(events)
    if remedy:
        assert all(remedy in line for line in advice.values())


@pytest.mark.parametrize(
    ("means", "variances", "counts", "flagged"),
    [
        ([1.0, 1.02], [0.04, 0.04], [50, 50], None),  # 2% apart: below the threshold
        ([1.0, 1.3], [1.0, 1.0], [5, 5], None),  # 30% apart but within the noise of 5 steps
        ([0.47, 1.68], [0.01, 0.1], [8, 8], (1, 0)),
        ([1.0, 1.0, 2.0, 1.0], [0.01] * 4, [20] * 4, (2, 0)),
        ([1.0, float("nan")], [0.01, 0.01], [20, 20], None),
        ([1.0, 5.0], [0.01, 0.01], [20, 0], None),  # a rank without losses
    ],
)
def test_rank_spread_beyond_noise_is_flagged(means, variances, counts, flagged):
    found = rank_spread(means, variances, counts, first_step=0, last_step=9)
    assert (found.ranks if found else None) == flagged
    if found:
        assert "Check the sampler and shuffling" in found.message and not found.error


def test_the_grad_norm_is_left_to_an_fp16_scaler():
    assert decide_grad_check(True, has_scaler=False).value is True
    assert decide_grad_check(True, has_scaler=True).value is False
    assert decide_grad_check(False, has_scaler=False).value is False


# ------------------------------------------------------------------------------------------------ 2 gloo ranks

STEPS, NAN_AT = 24, 20  # rank-spread checks at steps 7 and 15, before the NaN


class _Classifier(L.LightningModule):
    """4 classes from 8 random features. ``skewed``: rank 0 sees class 0 only, rank 1 all four (each rank builds
    its own data; no distributed sampler). ``nan_at``: rank 1's loss is NaN at that optimizer step."""

    def __init__(self, skewed: bool, nan_at: int | None):
        super().__init__()
        torch.manual_seed(1)  # the same start whatever ran before in this process
        self.layer = nn.Linear(8, 4)
        self.skewed, self.nan_at = skewed, nan_at

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.layer(x), y)
        if self.global_rank == 1 and self.trainer.global_step == self.nan_at:
            self.nan_started = time.monotonic()
            loss = loss * float("nan")
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(self.global_rank)
        x = torch.randn(16 * STEPS, 8, generator=g)
        # Healthy: learnable labels, so the loss falls smoothly. Skewed: rank 0 sees only class 0, rank 1 noise.
        y = torch.randint(0, 4, (16 * STEPS,), generator=g) if self.skewed else x[:, :4].argmax(1)
        if self.skewed and self.global_rank == 0:
            y = torch.zeros_like(y)
        return DataLoader(TensorDataset(x, y), batch_size=16)


class _RecordedLossWatch(LossWatch):
    def __init__(self, out, **kwargs):
        super().__init__(**kwargs)
        self.out = out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        try:
            super().on_before_optimizer_step(trainer, pl_module, optimizer)
        except NonFiniteLossError as err:
            self._failed(trainer, pl_module, err)
            raise

    def state_dict(self):  # a checkpoint save reads the check in flight first
        try:
            return super().state_dict()
        except NonFiniteLossError as err:
            self._failed(self._trainer_ref, self._trainer_ref.lightning_module, err)
            raise

    def _failed(self, trainer, pl_module, err):
        after = time.monotonic() - pl_module.nan_started if hasattr(pl_module, "nan_started") else None
        self._record(trainer, pl_module, error=str(err), after_nan_s=after)

    def on_train_end(self, trainer, pl_module):
        self._record(trainer, pl_module, error=None)

    def _record(self, trainer, pl_module, **extra):
        record = {
            "step": trainer.global_step,
            "finite_weights": all(bool(torch.isfinite(p).all()) for p in pl_module.parameters()),
            "advice": self.advice,
            "events": sorted(self.trend.events),
            **extra,
        }
        write_rank_record(self.out, trainer.global_rank, record)


def _fit(tmp_path, skewed: bool, nan_at: int | None, stop_before_step: bool = False) -> list[dict]:
    watch = _RecordedLossWatch(tmp_path, window=5, spread_every_n_steps=8, stop_before_step=stop_before_step)
    # A checkpoint every step: none may hold a non-finite step's update.
    every_step = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=SoloDDP(start_method="fork"), max_steps=STEPS, logger=False,
        use_distributed_sampler=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, callbacks=[watch, every_step],
    )  # fmt: skip
    try:
        trainer.fit(_Classifier(skewed, nan_at))
    finally:
        records = read_rank_records(tmp_path)
    return records


def _saved_steps(tmp_path) -> dict[int, bool]:
    """Each checkpoint's step, and whether its weights are finite."""
    saved = {}
    for path in (tmp_path / "ckpt").glob("step=*.ckpt"):
        checkpoint = torch.load(path, weights_only=True)
        saved[checkpoint["global_step"]] = all(torch.isfinite(v).all() for v in checkpoint["state_dict"].values())
    return saved


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop_before_step", [False, True], ids=["next-step", "before-step"])
def test_a_nan_on_one_rank_stops_both_after_the_skew_was_flagged_and_no_checkpoint_holds_it(tmp_path, stop_before_step):
    start = time.monotonic()
    with pytest.raises(Exception, match=rf"non-finite values at optimizer step {NAN_AT} .*first on rank\(s\) \[1\]"):
        _fit(tmp_path, skewed=True, nan_at=NAN_AT, stop_before_step=stop_before_step)
    assert time.monotonic() - start < 60
    records = read_rank_records(tmp_path)
    for record in records:
        assert "loss nan on rank(s) [1]" in record["error"]
        if stop_before_step:  # read at once: the NaN gradients were never applied
            assert record["step"] == NAN_AT and record["finite_weights"]
        else:  # read a step later: stopped at the next step's check, or at the save before it
            assert record["step"] == NAN_AT + 1 and not record["finite_weights"]
        # the labels rank 0 and rank 1 see differ: flagged by a spread check, on both ranks alike
        assert any(
            "rank 1 averaged a loss" in line and "Check the sampler and shuffling" in line for line in record["advice"]
        )
    assert records[1]["after_nan_s"] < 5  # rank 1 failed within seconds of its NaN
    saved = _saved_steps(tmp_path)
    assert max(saved) == NAN_AT and all(saved.values())  # every checkpoint predates the NaN step's update


@pytest.mark.multiproc
def test_a_normal_run_raises_no_alarm(tmp_path):
    records = _fit(tmp_path, skewed=False, nan_at=None)
    for record in records:
        assert record["step"] == STEPS and record["error"] is None
        assert record["advice"] == [] and record["events"] == []
