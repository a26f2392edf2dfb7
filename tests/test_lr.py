"""WarmupScaledLR: the lr each optimizer step actually uses, against the closed-form schedule.

The optimizer below records ``param_group["lr"]`` inside ``step()``, i.e. the lr the update is made
with, and every expected value is written out from the formula here, not taken from the callback.
"""

from __future__ import annotations

import math
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import Precision

from lightning_solo import SoloDDP
from lightning_solo.callbacks import WarmupScaledLR
from lightning_solo.callbacks.lr.schedule import LRSchedule, scale_factor
from tests.helpers.modules import TinyModule
from tests.helpers.records import RankRecorder, read_rank_records

BASE_LR = 0.1
N = 64  # samples; batch 4 → 16 batches per epoch on 1 process, 8 per rank on 2


class RecordingSGD(torch.optim.SGD):
    """SGD that remembers the lr of each param group that its update is made with.

    Like SGD.step, it runs Lightning's closure (forward, backward, ``on_before_optimizer_step``) first and
    reads the lr after it, so anything that moves the lr inside the closure shows up here.
    """

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.lrs: list[list[float]] = []

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.lrs.append([g["lr"] for g in self.param_groups])
        super().step()
        return loss


class Tiny(TinyModule):
    """TinyModule under a RecordingSGD; ``scheduler``: a user scheduler ``(make, interval)``; ``two_groups``: the
    out layer in a second param group at a tenth of the lr."""

    def __init__(self, scheduler=None, two_groups: bool = False):
        super().__init__((4, 4, 2), init_seed=0, loss="cross_entropy", samples=N, batch_size=4, data_seed=0,
                         lr=BASE_LR)  # fmt: skip
        self.user_scheduler, self.two_groups = scheduler, two_groups

    def configure_optimizers(self):
        if self.two_groups:
            params = [
                {"params": self.trunk.parameters()},
                {"params": self.out.parameters(), "lr": BASE_LR / 10},
            ]
        else:
            params = self.parameters()
        opt = RecordingSGD(params, lr=BASE_LR)
        if self.user_scheduler is None:
            return opt
        make, interval = self.user_scheduler
        return {"optimizer": opt, "lr_scheduler": {"scheduler": make(opt), "interval": interval}}


def _lr_decisions(trainer, module) -> dict:
    cb = next(c for c in trainer.callbacks if isinstance(c, WarmupScaledLR))
    return {k: d.as_dict() for k, d in cb.decisions.items()}


def _recorder(out: Path) -> RankRecorder:
    """Per rank: the lr of every optimizer step, WarmupScaledLR's and the strategy's decisions, the last step."""
    return RankRecorder(
        out,
        on_train_end={
            "lrs": lambda trainer, module: trainer.optimizers[0].lrs,
            "lr_decisions": _lr_decisions,
            "decisions": "decisions",
            "global_step": "global_step",
        },
    )


def _trainer(tmp_path, callbacks, devices=1, **kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=devices,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    if devices > 1:
        # Keep the sample order of the 1-process run: rank r takes samples r, r+2, ...
        defaults.update(strategy=SoloDDP(start_method="fork"), use_distributed_sampler=True)
    defaults.update(kwargs)
    return L.Trainer(callbacks=callbacks, **defaults)


def _warmup_then_cosine(step: int, scale: float, warmup: int, total: int) -> float:
    """Goyal warmup from the unscaled lr to scale × lr, then a half cosine to 0: written out by hand."""
    if step < warmup:
        return BASE_LR * (1 + (scale - 1) * step / warmup)
    return BASE_LR * scale * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))


def _user_scheduler_lrs(make, interval: str, steps: int, steps_per_epoch: int) -> list[float]:
    """The user's scheduler on its own (no WarmupScaledLR): the lr it sets for each optimizer step."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR)
    sched, lrs = make(opt), []
    for s in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if interval == "step" or (s + 1) % steps_per_epoch == 0:
            sched.step()
    return lrs


# ------------------------------------------------------------------------------- pure schedule math


def test_scale_rules_and_schedule_points():
    assert scale_factor("linear", 2048, 256) == 8.0
    assert scale_factor("sqrt", 1024, 256) == 2.0
    assert scale_factor("none", 4096, 256) == 1.0
    s = LRSchedule(scale=8.0, warmup_steps=10, total_steps=110, decay="cosine", min_factor=0.1)
    assert [s.factor(i) for i in (0, 5, 10)] == [1.0, 4.5, 8.0]
    assert s.factor(60) == pytest.approx(8.0 * (0.1 + 0.9 * 0.5))
    assert s.factor(110) == pytest.approx(0.8)
    step = LRSchedule(scale=2.0, warmup_steps=0, total_steps=100, decay="step", milestones=(50, 80), gamma=0.1)
    assert [step.factor(i) for i in (0, 49, 50, 80)] == pytest.approx([2.0, 2.0, 0.2, 0.02])
    # A global batch below the reference scales down; warmup must then not start above its target.
    down = LRSchedule(scale=0.25, warmup_steps=4, total_steps=8)
    assert [down.factor(i) for i in (0, 3, 7)] == [0.25, 0.25, 0.25]
    low = LRSchedule(scale=4.0, warmup_steps=4, total_steps=8, start_factor=0.0)
    assert [low.factor(i) for i in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_plot_a_planned_schedule(tmp_path):
    cb = WarmupScaledLR(reference_batch_size=256, warmup_epochs=5, decay="step", decay_milestones=[1 / 3, 2 / 3])
    png = cb.plot_schedule(tmp_path / "plan.png", global_batch=2048, total_steps=900, steps_per_epoch=10)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert cb.decisions == {}  # a plan is not a decision of the run
    with pytest.raises(ValueError, match="needs global_batch and total_steps"):
        cb.plot_schedule(tmp_path / "x.png")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(reference_batch_size=0), "reference_batch_size must be a positive integer"),
        (dict(reference_batch_size=-256), "reference_batch_size must be a positive integer"),
        (dict(rule="cubic"), "unknown lr scaling rule 'cubic'; accepted: linear, sqrt, none"),
        (dict(decay="exp"), "unknown decay 'exp'; accepted: none, cosine, step"),
        (dict(warmup_steps=5, warmup_epochs=1), "at most one of warmup_epochs, warmup_steps"),
        (dict(warmup_fraction=1.5), "warmup_fraction is a fraction of the run"),
        (dict(decay="step"), "decay='step' needs decay_milestones"),
        (dict(decay="step", decay_milestones=[30, 60]), "fractions of the run"),
        (dict(start_factor=-1.0), "start_factor must be >= 0"),
        (dict(min_lr_factor=1.5), r"min_lr_factor must be in \[0, 1\]"),
        (dict(decay_gamma=0.0), r"decay_gamma must be in \(0, 1\]"),
    ],
)
def test_bad_options_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WarmupScaledLR(**kwargs)
    with pytest.raises(ValueError, match=r"warmup .* is longer than the run"):
        WarmupScaledLR(warmup_steps=11).options.build(global_batch=256, total_steps=10, steps_per_epoch=None)


def test_warmup_longer_than_the_run_fails_at_fit(tmp_path):
    cb = WarmupScaledLR(reference_batch_size=4, warmup_epochs=3)
    with pytest.raises(
        ValueError, match=r"warmup \(warmup_epochs=3 → 48 optimizer steps\) is longer than the run \(32"
    ):
        _trainer(tmp_path, [cb]).fit(Tiny())


# ------------------------------------------------------------------------------- one process


def test_per_step_lr_with_accumulation_matches_formula(tmp_path):
    # batch 4 × 1 device × 2 accumulation = 8 = 2 × reference 4: lr goes 0.1 → 0.2 over 4 steps, then cosine.
    cb = WarmupScaledLR(reference_batch_size=4, warmup_steps=4, decay="cosine")
    trainer = _trainer(tmp_path, [cb], accumulate_grad_batches=2, log_every_n_steps=1)
    model = Tiny()
    trainer.fit(model)
    applied = [lrs[0] for lrs in trainer.optimizers[0].lrs]
    total = 2 * 16 // 2
    assert len(applied) == total == trainer.global_step
    expected = [_warmup_then_cosine(s, 2.0, 4, total) for s in range(total)]
    assert applied == pytest.approx(expected, rel=1e-12)
    assert applied[:5] == pytest.approx([0.1, 0.125, 0.15, 0.175, 0.2])
    assert cb.decisions["lr_global_batch"].value == 8
    assert cb.decisions["lr_scale"].value == 2.0
    assert trainer.callback_metrics["lr-RecordingSGD"].item() == pytest.approx(applied[-1])
    # After fit the optimizer holds the configured lr again (no factor left behind).
    assert trainer.optimizers[0].param_groups[0]["lr"] == BASE_LR
    png = cb.plot_schedule(tmp_path / "lr.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("make", "interval"),
    [
        (lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5), "step"),
        (lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), "epoch"),
        (lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=32, eta_min=0.01), "step"),
    ],
    ids=["StepLR-step", "StepLR-epoch", "CosineAnnealingLR-step"],
)
def test_composes_with_user_scheduler_and_lr_monitor(tmp_path, make, interval):
    # sqrt rule, batch 4 vs reference 1: ×2; warmup 8 of 32 steps from 0.5× the configured lr.
    cb = WarmupScaledLR(rule="sqrt", reference_batch_size=1, warmup_steps=8, start_factor=0.5)
    monitor = LearningRateMonitor(logging_interval="step")  # placed first on purpose: it must still agree
    trainer = _trainer(tmp_path, [monitor, cb], logger=CSVLogger(tmp_path), log_every_n_steps=1)
    trainer.fit(Tiny(scheduler=(make, interval)))
    user = _user_scheduler_lrs(make, interval, 32, 16)
    factor = [0.5 + 1.5 * s / 8 if s < 8 else 2.0 for s in range(32)]
    applied = [lrs[0] for lrs in trainer.optimizers[0].lrs]
    assert applied == pytest.approx([u * f for u, f in zip(user, factor)], rel=1e-9)
    # The user's scheduler kept computing on its own values: nothing compounded.
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == pytest.approx(
        _user_scheduler_lrs(make, interval, 33, 16)[-1]
    )
    assert monitor.lrs["lr-RecordingSGD"] == pytest.approx(applied, rel=1e-9)
    assert "lr_user_scheduler" in cb.decisions


def test_lr_is_logged_on_the_steps_lr_monitor_logs_with_its_values(tmp_path):
    # A logged float becomes a device tensor (a host sync on GPUs): only the steps the loggers write log it.
    def logged(callbacks, name) -> dict[int, float]:
        logger = CSVLogger(tmp_path, name=name)
        _trainer(tmp_path, callbacks, logger=logger, log_every_n_steps=3).fit(Tiny())
        rows = [r.split(",") for r in (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()]
        lr, step = rows[0].index("lr-RecordingSGD"), rows[0].index("step")
        return {int(r[step]): float(r[lr]) for r in rows[1:] if r[lr]}

    ours = logged([WarmupScaledLR(reference_batch_size=1, warmup_steps=8)], "ours")
    monitor = logged([WarmupScaledLR(reference_batch_size=1, warmup_steps=8), LearningRateMonitor()], "monitor")
    # LearningRateMonitor adds the lr at train start and at an epoch start; at batches, the same steps and lrs.
    at_batches = {step: lr for step, lr in monitor.items() if (step + 1) % 3 == 0}
    assert list(ours) == list(at_batches) == list(range(2, 32, 3))
    assert list(ours.values()) == pytest.approx(list(at_batches.values()), rel=1e-6)


class SkipSteps(Precision):
    """What AMP's GradScaler does on inf gradients: the closure runs, ``optimizer.step`` does not."""

    def __init__(self, skip: set[int]) -> None:
        self.skip, self.calls = skip, 0

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        self.calls += 1
        if self.calls - 1 in self.skip:
            closure()
            self._after_closure(model, optimizer)
            return None
        return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)


def test_skipped_optimizer_step_leaves_the_user_lr_to_the_scheduler(tmp_path):
    make = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)  # noqa: E731
    cb = WarmupScaledLR(reference_batch_size=1, warmup_steps=8)
    trainer = _trainer(tmp_path, [cb], plugins=[SkipSteps({2, 5})], max_epochs=1)
    trainer.fit(Tiny(scheduler=(make, "step")))
    user = _user_scheduler_lrs(make, "step", 16, 16)
    expected = [u * (1 + 3 * s / 8 if s < 8 else 4.0) for s, u in enumerate(user) if s not in (2, 5)]
    assert [lrs[0] for lrs in trainer.optimizers[0].lrs] == pytest.approx(expected, rel=1e-12)


def test_the_update_itself_uses_the_scaled_lr(tmp_path):
    # Plain SGD, one step, same init and batch: the weight change must be exactly 4× with scale 4.
    deltas = []
    for rule in ("none", "linear"):
        model = Tiny()
        model.configure_optimizers = lambda m=model: torch.optim.SGD(m.parameters(), lr=BASE_LR)
        before = [p.detach().clone() for p in model.parameters()]
        cb = WarmupScaledLR(rule=rule, reference_batch_size=1, warmup_steps=0)
        _trainer(tmp_path, [cb], max_epochs=1, limit_train_batches=1).fit(model)
        deltas.append(torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)]))
    assert deltas[0].abs().max() > 0
    torch.testing.assert_close(deltas[1], 4 * deltas[0], rtol=1e-5, atol=1e-6)


def test_param_groups_are_scaled_each_from_its_own_lr(tmp_path):
    cb = WarmupScaledLR(reference_batch_size=2, warmup_steps=0)
    trainer = _trainer(tmp_path, [cb], max_epochs=1)
    trainer.fit(Tiny(two_groups=True))
    assert trainer.optimizers[0].lrs[0] == pytest.approx([0.2, 0.02])
    assert cb.decisions["lr_base"].value == [[0.1, 0.01]]


class SaveAt(L.Callback):
    """trainer.save_checkpoint after micro-batch ``batch_idx`` (mid-window when accumulating)."""

    def __init__(self, path: Path, batch_idx: int) -> None:
        self.path, self.batch_idx = path, batch_idx

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx == self.batch_idx:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize(
    ("accumulate", "save_after_batch", "step"),
    [(1, 5, 6), (2, 6, 3)],
    ids=["after-a-step", "mid-accumulation"],
)
def test_resume_mid_warmup_continues_the_uninterrupted_curve(tmp_path, accumulate, save_after_batch, step):
    # With a user StepLR too (it moves the lr right at step 6), so the restored scheduler state, the
    # callback state and the factor must line up.
    def run(root: Path, ckpt_path=None):
        step_lr = (lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7), "step")
        cbs = [WarmupScaledLR(reference_batch_size=2, warmup_steps=8, decay="cosine")]
        if ckpt_path is None:
            cbs.append(SaveAt(tmp_path / "mid.ckpt", save_after_batch))
        trainer = _trainer(root, cbs, accumulate_grad_batches=accumulate)
        trainer.fit(Tiny(scheduler=step_lr), ckpt_path=ckpt_path)
        return [lrs[0] for lrs in trainer.optimizers[0].lrs], cbs[0]

    full, _ = run(tmp_path / "a")
    assert torch.load(tmp_path / "mid.ckpt", weights_only=True)["global_step"] == step
    resumed, cb = run(tmp_path / "b", ckpt_path=tmp_path / "mid.ckpt")
    assert len(full) == 32 // accumulate and len(resumed) == len(full) - step
    assert step < 8  # mid-warmup
    assert resumed == pytest.approx(full[step:], rel=1e-12)
    assert "lr_rescaled_on_resume" not in cb.decisions


# ------------------------------------------------------------------------------- two processes


def _expected_2proc(step: int) -> float:
    # 2 ranks × batch 4 = 8 vs reference 2 → ×4, warmup 6 steps, then cosine to step 20: 4 steps at 1 process,
    # then epoch 0 restarted in full on the 2-process shards (8 steps) and epoch 1 (8 steps).
    return _warmup_then_cosine(step, 4.0, 6, 20)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_two_processes_formula_accumulation_and_world_size_change(tmp_path):
    # (1) Fresh 2-process run with accumulation: global batch 4 × 2 ranks × 2 = 16 vs reference 2 → ×8.
    out = tmp_path / "fresh"
    out.mkdir()
    cb = WarmupScaledLR(reference_batch_size=2, warmup_steps=3, decay="step", decay_milestones=[0.75])
    _trainer(out, [cb, _recorder(out)], devices=2, accumulate_grad_batches=2).fit(Tiny())
    ranks = read_rank_records(out)
    assert ranks[0]["lrs"] == ranks[1]["lrs"]
    applied = [lrs[0] for lrs in ranks[0]["lrs"]]
    assert len(applied) == 8  # 8 batches per rank per epoch / 2 accumulation × 2 epochs
    expected = [0.1 * f for f in (1.0, 1 + 7 / 3, 1 + 14 / 3, 8.0, 8.0, 8.0, 0.8, 0.8)]
    assert applied == pytest.approx(expected, rel=1e-12)
    assert ranks[0]["lr_decisions"]["lr_global_batch"]["value"] == 16

    # (2) Save at 1 process (global batch 4, ×2), resume at 2 processes (global batch 8, ×4).
    one = tmp_path / "one"
    cb1 = WarmupScaledLR(reference_batch_size=2, warmup_steps=6, decay="cosine")
    ckpt_cb = ModelCheckpoint(dirpath=one, every_n_train_steps=4, save_top_k=-1)
    t1 = _trainer(one, [cb1, ckpt_cb], enable_checkpointing=True, strategy=SoloDDP(start_method="fork"))
    t1.fit(Tiny())
    assert cb1.decisions["lr_scale"].value == 2.0
    two = tmp_path / "two"
    two.mkdir()
    cb2 = WarmupScaledLR(reference_batch_size=2, warmup_steps=6, decay="cosine")
    _trainer(two, [cb2, _recorder(two)], devices=2).fit(Tiny(), ckpt_path=one / "epoch=0-step=4.ckpt")
    ranks = read_rank_records(two)
    assert ranks[0]["lrs"] == ranks[1]["lrs"]
    # The interrupted epoch restarts whole on the new shards (not its first 8 - 4 batches only): 4 + 8 + 8 steps.
    assert ranks[0]["global_step"] == 20
    assert "restarts in full" in ranks[0]["decisions"]["mid_epoch_resume"]["reason"]
    applied = [lrs[0] for lrs in ranks[0]["lrs"]]
    assert applied == pytest.approx([_expected_2proc(s) for s in range(4, 20)], rel=1e-12)
    rescaled = ranks[0]["lr_decisions"]["lr_rescaled_on_resume"]
    assert rescaled["value"] == {"global_batch": [4, 8], "scale": [2.0, 4.0]}
    assert "world size 1" in rescaled["reason"] and "world size 2" in rescaled["reason"]

    # (3) And back: saved at 2 processes in the middle of epoch 0, resumed at 1 process; epoch 0 restarts whole.
    ckpt_cb = ModelCheckpoint(dirpath=two, every_n_train_steps=3, save_top_k=-1)
    _trainer(
        two,
        [WarmupScaledLR(reference_batch_size=2, warmup_steps=6), ckpt_cb],
        devices=2,
        max_epochs=1,
        enable_checkpointing=True,
    ).fit(Tiny())
    back = tmp_path / "back"
    back.mkdir()
    _trainer(
        back,
        [WarmupScaledLR(reference_batch_size=2, warmup_steps=6), _recorder(back)],
        strategy=SoloDDP(start_method="fork"),
    ).fit(Tiny(), ckpt_path=two / "epoch=0-step=3.ckpt")
    (record,) = read_rank_records(back, world=1)
    resumed = record["decisions"]["mid_epoch_resume"]
    assert record["global_step"] == 3 + 16 + 16 and "restarts in full" in resumed["reason"]
