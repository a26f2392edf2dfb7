"""Mixed precision (issue 5): real fp16 on CPU, a GradScaler that grows/backs off/skips, resume safety,
clipping after unscale, and the precision rule between Trainer and SoloDDP."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_solo import SoloDDP
from lightning_solo.ddp.precision.plugin import CHECKPOINT_KEY, EXTRA_KEY, SoloMixedPrecision, decide_precision_plugin
from lightning_solo.ddp.precision.rule import (
    agreed_rule,
    auto_precision,
    auto_rule,
    decide_precision,
    precision_options,
    scaler_settings,
)
from tests.distributed import run_ranks
from tests.helpers.modules import TinyModule
from tests.helpers.records import RankRecorder, read_rank_records

CPU = torch.device("cpu")
OVERFLOW_STEP = 2


class TinyNet(TinyModule):
    """Conv + linear (both go through CPU fp16 autocast); an inf loss at ``overflow_step``."""

    def __init__(self, overflow_step: int | None = OVERFLOW_STEP, overflow_rank: int | None = None) -> None:
        torch.manual_seed(0)
        conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
        step_lr = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # noqa: E731
        super().__init__((4 * 6 * 6, 2), trunk=conv, loss="cross_entropy", lr=0.1, scheduler=step_lr)
        self.overflow_step, self.overflow_rank = overflow_step, overflow_rank
        self.out_dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.out_dtypes.append(out.dtype)
        return out

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_step == self.overflow_step and self.overflow_rank in (None, self.global_rank):
            loss = loss * float("inf")  # non-finite gradients: the scaler must skip this step
        return loss


def _scale(trainer, module) -> float:
    return trainer.precision_plugin.scaler.get_scale()


def _scale_at_start(trainer, module) -> float:
    scaler = trainer.precision_plugin.scaler
    return scaler._scale.item() if scaler._scale is not None else scaler._init_scale


def recorder(out=None, **at_end) -> RankRecorder:
    """Per optimizer step: the loss scale after update(), the step and the parameters; the scale at the start;
    ``at_end`` when training ends."""
    return RankRecorder(
        out,
        on_train_start={"scale_at_start": _scale_at_start},
        on_train_batch_end={"scales": _scale, "steps": "global_step", "params": "params"},
        on_train_end=at_end,
    )


def loader(n: int = 40, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 2, (n,), generator=g))
    return DataLoader(ds, batch_size=batch_size)


def trainer(max_steps: int, **kwargs) -> L.Trainer:
    kwargs.setdefault("devices", 1)
    return L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


# --- validation and the precision rule (no training) -------------------------------------------


@pytest.mark.parametrize(
    ("scaler", "match"),
    [
        ({"growth_factor": 1.0}, "growth_factor must be > 1"),
        ({"growth_factor": 0.5}, "growth_factor must be > 1"),
        ({"backoff_factor": 1.0}, r"backoff_factor must be in \(0, 1\)"),
        ({"backoff_factor": 0.0}, r"backoff_factor must be in \(0, 1\)"),
        ({"init_scale": 0}, "init_scale must be > 0"),
        ({"init_scale": float("inf")}, "init_scale must be a finite number"),
        ({"growth_interval": 0}, "growth_interval must be a positive integer"),
        ({"growth_interval": 2.5}, "growth_interval must be a positive integer"),
        ({"growth_factr": 2.0}, "accepted: .*'growth_factor'"),
    ],
)
def test_scaler_settings_are_validated(scaler, match):
    with pytest.raises(ValueError, match=match):
        scaler_settings(scaler)
    with pytest.raises(ValueError, match=match):
        SoloDDP(precision="16-mixed", scaler=scaler)


def test_bad_precision_options():
    assert scaler_settings({"init_scale": 1024})["init_scale"] == 1024.0
    with pytest.raises(ValueError, match="'auto', 'bf16-mixed', '16-mixed', '32-true'"):
        SoloDDP(precision="fp16")
    with pytest.raises(ValueError, match="not both"):
        SoloDDP(precision="16-mixed", precision_plugin=Precision())
    with pytest.raises(ValueError, match="'16-mixed' or 'bf16-mixed'"):
        SoloMixedPrecision("32-true", "cpu")


def test_auto_rule_and_trainer_strategy_agreement():
    assert auto_rule("cuda", bf16_supported=True).value == "bf16-mixed"
    assert auto_rule("cuda", bf16_supported=False).value == "16-mixed"
    assert auto_rule("cpu", bf16_supported=True).value == "32-true"
    assert decide_precision("auto", "32-true", CPU).value == "32-true"
    assert decide_precision("auto", "16-mixed", CPU).value == "16-mixed"  # auto defers to the Trainer
    assert decide_precision("bf16-mixed", "32-true", CPU).value == "bf16-mixed"  # 32-true == unset
    assert decide_precision("16-mixed", "16-mixed", CPU).value == "16-mixed"
    assert decide_precision(None, "bf16-mixed", CPU).value == "bf16-mixed"
    with pytest.raises(ValueError, match=r"Trainer\(precision='bf16-mixed'\) and SoloDDP\(precision='16-mixed'\)"):
        decide_precision("16-mixed", "bf16-mixed", CPU)
    with pytest.raises(ValueError, match="precision=None"):
        decide_precision("auto", "16-true", CPU)


def test_agreed_rule_takes_the_lowest_capability_of_all_ranks():
    assert agreed_rule([2]) == auto_rule("cuda", bf16_supported=True)
    assert agreed_rule([2, 2]).value == "bf16-mixed" and "the same on all 2 ranks" in agreed_rule([2, 2]).reason
    mixed = agreed_rule([2, 1, 2, 1])  # A100 and V100 nodes: fp16 + GradScaler everywhere
    assert mixed.value == "16-mixed" and "rank(s) [1, 3] cannot do more" in mixed.reason
    assert agreed_rule([0, 2]).value == "32-true"


def _auto_where_rank_one_lacks_bf16(rank: int, world_size: int):
    return auto_precision(CPU, capability=1 if rank == 1 else 2)


@pytest.mark.multiproc
@pytest.mark.timeout(30)
def test_auto_precision_is_agreed_across_ranks():
    first, second = run_ranks(_auto_where_rank_one_lacks_bf16, 2)
    assert first == second and first.value == "16-mixed" and "rank(s) [1]" in first.reason


@pytest.mark.multiproc
def test_soloddp_agrees_auto_precision_after_the_process_group_exists(tmp_path):
    t = trainer(1, devices=2, strategy=SoloDDP(start_method="fork", precision="auto"))
    t.fit(TinyNet(overflow_step=None), loader(n=8))
    assert t.strategy.decisions["precision"].reason.endswith("the same on all 2 ranks")


def _settle(strategy: SoloDDP, **trainer_kwargs):
    t = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, **trainer_kwargs)
    return decide_precision_plugin(t.strategy.precision_plugin, strategy._precision_options, t, CPU)


def test_soloddp_settles_the_plugin_on_its_device():
    # 16-mixed on CPU stays fp16 (Lightning alone would switch to bf16) and takes the scaler settings.
    plugin, decisions = _settle(SoloDDP(precision="16-mixed", scaler={"init_scale": 256.0}), precision="16-mixed")
    assert isinstance(plugin, SoloMixedPrecision) and plugin.precision == "16-mixed" and plugin.device == "cpu"
    assert plugin.scaler._init_scale == 256.0
    assert [d.setting for d in decisions] == ["precision", "grad_scaler", "lr_on_overflow"]
    # A second fit/validate of the same Trainer keeps the settled plugin and its scaler state.
    assert decide_precision_plugin(plugin, precision_options("16-mixed", None, False), None, CPU) == (
        plugin,
        [],
    )
    # auto on CPU -> plain fp32 plugin.
    plugin, decisions = _settle(SoloDDP(precision="auto"))
    assert type(plugin) is Precision and decisions[0].value == "32-true"
    # precision=None: Lightning's own AMP plugin is replaced by the resume-safe one, same precision.
    plugin, _ = _settle(SoloDDP(scaler={"growth_interval": 7}), precision="bf16-mixed")
    assert isinstance(plugin, SoloMixedPrecision) and plugin.precision == "bf16-mixed" and plugin.scaler is None
    # A plugin the user gave the Trainer is left alone.
    mine = MixedPrecision("bf16-mixed", "cpu")
    plugin, decisions = _settle(SoloDDP(), plugins=[mine])
    assert plugin is mine and "used as is" in decisions[0].reason
    # An explicit conflicting pair is an error, not a silent winner.
    with pytest.raises(ValueError, match="disagree"):
        _settle(SoloDDP(precision="16-mixed"), precision="bf16-mixed")


# --- fp16 training on CPU: grow, back off, skip, count (single process) ------------------------


def test_fp16_scaler_grows_backs_off_and_skips():
    plugin = SoloMixedPrecision(
        "16-mixed", "cpu", scaler={"init_scale": 1024, "growth_interval": 2}, skip_lr_on_overflow=True
    )
    model, rec = TinyNet(), recorder()
    t = trainer(5, plugins=[plugin], callbacks=[rec])
    t.fit(model, loader())

    assert set(model.out_dtypes) == {torch.float16}  # real fp16 autocast on CPU
    # growth after 2 good steps, halving on the overflow step, regrowth after 2 more good steps
    assert rec.record["scales"] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
    params = rec.record["params"]
    assert torch.equal(params[OVERFLOW_STEP], params[OVERFLOW_STEP - 1])  # the step was skipped
    assert not torch.equal(params[OVERFLOW_STEP + 1], params[OVERFLOW_STEP])
    assert plugin.skipped_steps == 1
    assert t.callback_metrics["amp/skipped_steps"].item() == 1
    assert t.callback_metrics["amp/scale"].item() == 2048.0
    # 5 optimizer calls, 1 skipped: the step-interval scheduler advanced 4 times, not 5.
    assert t.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**4)
    assert "lr_scheduler_step" not in model.__dict__  # the hook wrapper is removed at teardown


class LinearSum(TinyModule):
    """loss = sum(W x) * k: its gradient is known in closed form (k * sum of inputs / accumulation)."""

    def __init__(self, k: float) -> None:
        super().__init__((4, 1), lr=1.0)
        self.out = nn.Linear(4, 1, bias=False)
        nn.init.zeros_(self.out.weight)
        self.k = k
        self.seen_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * self.k

    def on_before_optimizer_step(self, optimizer):
        self.seen_norms.append(self.out.weight.grad.norm().item())  # after unscale, before clipping


def test_clip_after_unscale_with_accumulation_matches_hand_computed_norm():
    # Small integers: exact in fp16, and the scaled gradients (x 1024) stay below fp16's max.
    x = torch.tensor([[1.0, 2.0, 0.0, 3.0], [2.0, 1.0, 1.0, 0.0], [0.0, 3.0, 2.0, 1.0], [1.0, 0.0, 3.0, 2.0]])
    k, clip = 2.0, 1.5
    model = LinearSum(k)
    plugin = SoloMixedPrecision("16-mixed", "cpu", scaler={"init_scale": 1024})
    t = trainer(1, plugins=[plugin], gradient_clip_val=clip, accumulate_grad_batches=2)
    t.fit(model, DataLoader(TensorDataset(x), batch_size=2))

    # Two micro-batches of 2, each loss divided by 2 by Lightning: g = k * (sum of all rows) / 2.
    g = k * x.sum(0) / 2
    norm = g.norm().item()
    assert norm > clip
    assert model.seen_norms == [pytest.approx(norm, rel=1e-6)]  # unscaled: not 1024x larger
    expected = -g * clip / (norm + 1e-6)  # SGD lr=1 from zero weights: the update is the clipped gradient
    torch.testing.assert_close(model.out.weight.detach().flatten(), expected, rtol=1e-5, atol=1e-6)


# --- resume ------------------------------------------------------------------------------------


def test_resume_keeps_scale_applies_new_factors_and_stock_lightning_reads_it(tmp_path, caplog):
    ckpt = tmp_path / "amp.ckpt"
    first = SoloMixedPrecision("16-mixed", "cpu", scaler={"init_scale": 1024, "growth_interval": 2})
    t = trainer(3, plugins=[first])
    t.fit(TinyNet(), loader())
    t.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)
    assert saved[CHECKPOINT_KEY]["scale"] == first.scaler.get_scale() == 1024.0  # 2 good, 1 skipped
    assert "SoloMixedPrecision" not in saved and saved[EXTRA_KEY]["skipped_steps"] == 1

    # Changed factors at resume: the scale is kept exactly, the new growth factor/interval are in force.
    new_cfg = {"init_scale": 8.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 1}
    second, rec = SoloMixedPrecision("16-mixed", "cpu", scaler=new_cfg), recorder()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        trainer(5, plugins=[second], callbacks=[rec]).fit(TinyNet(overflow_step=None), loader(), ckpt_path=ckpt)
    assert rec.record["scale_at_start"] == 1024.0
    assert rec.record["scales"] == [4096.0, 16384.0]  # x4 after every good step
    assert second.scaler._growth_factor == 4.0 and second.scaler._backoff_factor == 0.25
    assert second.skipped_steps == 1  # the counter continues across the resume
    assert "growth_factor 2.0 -> 4.0" in second.decisions["grad_scaler_resume"].reason
    assert "growth_factor 2.0 -> 4.0" in caplog.text

    # Stock Lightning resumes the same checkpoint with the saved scale.
    stock = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1.0))
    rec = recorder()
    trainer(4, plugins=[stock], callbacks=[rec]).fit(TinyNet(overflow_step=None), loader(), ckpt_path=ckpt)
    assert rec.record["scale_at_start"] == 1024.0


# --- two ranks under SoloDDP (gloo, fork) --------------------------------------------------------


@pytest.mark.multiproc
def test_two_ranks_fp16_under_soloddp_resumed_with_new_growth_factor(tmp_path):
    # One single-process step (scale 1024, growth tracker 1), then 2 ranks resume with growth_factor 4.
    ckpt = tmp_path / "one_step.ckpt"
    t = trainer(1, plugins=[SoloMixedPrecision("16-mixed", "cpu", {"init_scale": 1024, "growth_interval": 2})])
    t.fit(TinyNet(overflow_step=None), loader())
    t.save_checkpoint(ckpt)

    # The overflow happens on rank 1 only; DDP's all-reduce spreads the inf, so both ranks skip together.
    scaler = {"init_scale": 1024, "growth_interval": 2, "growth_factor": 4.0}
    strategy = SoloDDP(start_method="fork", precision="16-mixed", scaler=scaler)
    rec = recorder(
        tmp_path,
        plugin=lambda trainer, module: type(trainer.precision_plugin).__name__,
        skipped_steps=lambda trainer, module: trainer.precision_plugin.skipped_steps,
        dtypes=lambda trainer, module: sorted({str(d) for d in module.out_dtypes}),
        lr="lr",
        decisions="decisions",
    )
    t = trainer(5, devices=2, strategy=strategy, precision="16-mixed", callbacks=[rec])
    t.fit(TinyNet(overflow_rank=1), loader(), ckpt_path=ckpt)
    r0, r1 = read_rank_records(tmp_path)
    for r in (r0, r1):
        assert r["plugin"] == "SoloMixedPrecision" and r["dtypes"] == ["torch.float16"]
        # steps 1..4: grow x4 (tracker reaches 2), overflow halves, 1 good, grow x4
        assert r["scales"] == [4096.0, 2048.0, 2048.0, 8192.0]
        i = r["steps"].index(OVERFLOW_STEP + 1)  # global_step counts the overflow step once it is done
        assert r["params"][i] == r["params"][i - 1] and r["skipped_steps"] == 1
        assert r["lr"] == pytest.approx(0.1 * 0.5**5)  # default: the scheduler advances on a skipped step
        assert "real fp16 autocast on CPU" in r["decisions"]["precision"]["reason"]
        assert "growth_factor 2.0 -> 4.0" in r["decisions"]["grad_scaler_resume"]["reason"]
    assert r0["params"][-1] == r1["params"][-1]  # ranks stay in sync through the skipped step


@pytest.mark.multiproc
def test_precision_conflict_fails_the_fit():
    t = trainer(1, devices=2, strategy=SoloDDP(start_method="fork", precision="16-mixed"), precision="bf16-mixed")
    with pytest.raises(Exception, match="disagree"):
        t.fit(TinyNet(), loader())


def test_precision_options_record_the_request():
    opts = precision_options("auto", {"init_scale": 2.0}, True)
    assert opts.precision == "auto" and opts.scaler["init_scale"] == 2.0 and opts.skip_lr_on_overflow
    with pytest.raises(ValueError, match="True or False"):
        precision_options("auto", None, "yes")
