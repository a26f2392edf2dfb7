"""``SoloDDP(compile=...)`` on 2 gloo ranks: compiled training equals eager, DDPOptimizer splits the graph at
DDP's buckets (overlap kept), SoloDDP's re-wraps recompile at most twice, a fallback to eager is a decision,
"auto" measures and every rank keeps the same choice, and checkpoints resume across compiled and eager runs.

The fits compile with ``backend="aot_eager"`` (Dynamo + AOTAutograd, the graph capture and split DDPOptimizer
works on) rather than inductor: inductor's C++ compile costs ~30 s per graph on this machine and is not what
these tests check; benchmarks/bench_compile.py runs inductor and compares its gradients.
"""

from __future__ import annotations

import math
import os

import lightning as L
import pytest
import torch
from torch._dynamo.utils import counters

from lightning_solo import SoloDDP
from lightning_solo._compat import lightning as lightning_compat
from lightning_solo._compat import torch as torch_compat
from lightning_solo.callbacks import SoloCheckpoint
from lightning_solo.ddp.compile import CompiledSteps, decide_compile
from tests.helpers.modules import TinyModule
from tests.helpers.records import LastGrads, RankRecorder, read_rank_records

# SOLO_TEST_COMPILE_BACKEND=inductor runs the same tests through inductor (minutes per file here).
CHEAP = {"backend": os.environ.get("SOLO_TEST_COMPILE_BACKEND", "aot_eager")}
TOL = 1e-5


class _Logging(TinyModule):
    """Logs its loss. Traced, ``self.log`` guards on the number of metrics Lightning holds: a recompile."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss


def _model(**kwargs) -> TinyModule:
    options = dict(loss="cross_entropy", samples=96, batch_size=2, init_seed=0, data_seed=0, lr=0.1, shuffle=True)
    return _Logging(**{"widths": (8, 16, 16, 4), **options, **kwargs})


def _frames(trainer, module) -> int:
    return int(counters["frames"]["ok"])


def _aot_graphs(trainer, module) -> int:
    return int(counters["aot_autograd"]["total"])


def _buckets(trainer, module) -> list[list[int]]:
    """The parameters of each of DDP's buckets, as the last wrapper rebuilt them from the gradients' order."""
    indices = torch_compat.ddp_logging_data(trainer.strategy.model).get("rebuilt_per_bucket_param_indices")
    return [[int(i) for i in bucket.split()] for bucket in indices.split(", ")] if indices else []


class _Launches(L.Callback):
    """For each synchronising step: how many of DDP's buckets were launched (their all-reduce started) before
    backward computed its last gradient (the first layer's weight), and how many in all. A comm hook doing DDP's
    own all-reduce notes each launch, on every wrapper SoloDDP builds."""

    def __init__(self) -> None:
        self.wrapper, self.events, self.counts = None, [], []

    @staticmethod
    def _allreduce(state: _Launches, bucket):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        state.events.append("launch")
        return default_hooks.allreduce_hook(None, bucket)

    def on_train_start(self, trainer, module):
        next(module.parameters()).register_post_accumulate_grad_hook(lambda p: self.events.append("last"))

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.strategy.model is not self.wrapper:
            self.wrapper = trainer.strategy.model
            self.wrapper.register_comm_hook(self, self._allreduce)
        self.events = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if launched := self.events.count("launch"):  # "last"'s index: the launches before it
            self.counts.append((self.events.index("last") if "last" in self.events else -1, launched))


def _launch_counts(trainer, module) -> list[tuple[int, int]]:
    return next((c.counts for c in trainer.callbacks if isinstance(c, _Launches)), [])


def _fit(out, model, steps: int, callbacks=(), ckpt_path=None, fit_model=None, accumulate=1, **strategy) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    recorder = RankRecorder(
        out,
        on_train_start={"frames0": _frames, "aot0": _aot_graphs},
        on_train_batch_end={"frames": _frames, "ddp": "wrapper"},
        on_train_end={
            "params": "named_params",
            "aot": _aot_graphs,
            "buckets": _buckets,
            "launches": _launch_counts,
        },
        on_fit_end=("decisions",),  # after the strategy's on_train_end
        suffix=".pt",
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SoloDDP(start_method="fork", **strategy),
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[recorder, *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.Checkpoint) for c in callbacks),
        num_sanity_val_steps=0,
    )
    trainer.fit(fit_model if fit_model is not None else model, ckpt_path=ckpt_path)
    return read_rank_records(out, suffix=".pt")


def _assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        rel = (got[name] - value).norm() / value.norm().clamp_min(1e-12)
        assert rel <= TOL, f"{name}: relative difference {rel:.2e}"


@pytest.mark.multiproc
@pytest.mark.slow  # three fits: ~20 s idle, 36 s at load 8
@pytest.mark.timeout(120)
def test_compiled_training_equals_eager_on_the_fast_path(tmp_path):
    """10 steps with a head never used (the unused policy's excluding fast path): weights and the last step's
    gradients equal eager's; fit(torch.compile(model)) takes the same path."""
    runs = {}
    for name, strategy, user in (
        ("eager", {}, False),
        ("compiled", {"compile": CHEAP}, False),
        ("user", {}, True),
    ):
        out = tmp_path / name
        model = _model(head=True)
        fit_model = torch.compile(model, **CHEAP) if user else None
        runs[name] = _fit(out, model, 10, callbacks=[LastGrads(out)], fit_model=fit_model, **strategy)
        runs[name + "_grads"] = torch.load(out / "grads0.pt", weights_only=True)
    for name in ("compiled", "user"):
        for rank in (0, 1):
            _assert_close(runs[name][rank]["params"], runs["eager"][rank]["params"])
        _assert_close(runs[name + "_grads"], runs["eager_grads"])
        decisions = runs[name][0]["decisions"]
        compiled = decisions["compile"]
        assert compiled["value"] is True and "inside DDP's forward" in compiled["reason"], compiled
        # compile=False leaves the user's compile as Lightning applied it; compile=True runs self.log eagerly.
        assert ("as stock" if name == "user" else "self.log eager") in compiled["reason"], compiled
        assert decisions["find_unused_parameters"]["value"] is False, decisions["find_unused_parameters"]
        assert "excluded" in decisions["find_unused_parameters"]["reason"]
        frames = runs[name][0]["frames"]
        assert frames[0] > runs[name][0]["frames0"]  # compiled at the first step
        # self.log eager: no recompile; traced (the user's compile, as stock), at least one.
        assert (frames[-1] > frames[0]) if name == "user" else (frames[-1] == frames[0]), frames
    assert runs["eager"][0]["decisions"]["compile"]["value"] is False


class _FreezeThenUnfreeze(L.Callback):
    """Freeze the first layer at step 10 and unfreeze it at step 16, as BackboneFinetuning does."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step in (10, 16):
            module.trunk[0].requires_grad_(trainer.global_step == 16)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_rewraps_recompile_at_most_twice(tmp_path):
    """The auto unused policy's window and switch, a freeze and an unfreeze (each a re-wrap and a new window),
    and comm_hook="auto"'s trials (a re-wrap per candidate): at most 2 frames compiled after the first step."""
    records = _fit(tmp_path, _model(), 36, callbacks=[_FreezeThenUnfreeze()], compile=CHEAP, comm_hook="auto")
    for record in records:
        frames, wrappers = record["frames"], record["ddp"]
        assert len(set(wrappers)) >= 6, f"only {len(set(wrappers))} DDP wrappers: the scenario did not re-wrap"
        assert frames[-1] - frames[0] <= 2, f"{frames[-1] - frames[0]} recompiles: {frames}"
        decisions = record["decisions"]
        assert f"{frames[-1] - frames[0]} recompiles in training steps" in decisions["compile"]["reason"]
        assert decisions["comm_hook"]["value"] != "auto", decisions["comm_hook"]  # the trials ended
        assert "compile_fallback" not in decisions


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_ddp_optimizer_splits_the_graph_at_ddp_buckets(tmp_path):
    """Compiled inside DDP's forward, the graph is split at DDP's 1 MiB buckets (one AOTAutograd graph per
    bucket), so each bucket's all-reduce starts while backward continues, as in eager: all buckets but the last
    are launched before the last gradient is computed. With optimize_ddp off, one graph, and every bucket is
    launched after it.
    And DDP builds the same buckets as in an eager fit (the first synchronising step of each wrapper runs
    eagerly): built from the compiled backward's order, they held other parameters here (a bias alone in the
    first bucket, where eager's holds it with the head's)."""
    import torch._dynamo

    graphs = {}
    # None: eager; "accumulate": split, 2 batches a step (the bucket order comes from the synchronising one)
    for optimize in (True, False, None, "accumulate"):
        with torch._dynamo.config.patch(optimize_ddp=bool(optimize)):  # the forked ranks inherit it
            records = _fit(
                tmp_path / str(optimize),
                _model(widths=(8, 512, 512, 512, 4)),  # two 1 MiB layers
                8,  # past the unused window: the last wrapper rebuilds its buckets
                bucket_cap_mb=1,
                accumulate=2 if optimize == "accumulate" else 1,
                callbacks=[_Launches()],
                **({} if optimize is None else {"compile": CHEAP}),
            )
        graphs[optimize] = records[0]
    split = graphs[True]["decisions"]["compile"]["reason"]
    assert "DDPOptimizer splits the graph" in split
    assert "not DDPOptimizer" in graphs[False]["decisions"]["compile"]["reason"]
    aot = {k: v["aot"] - v["aot0"] for k, v in graphs.items() if k is not None}
    assert aot[True] >= 3 and aot[False] == 1, aot
    eager = graphs[None]["buckets"]
    assert len(eager) >= 3, eager
    for optimize in (True, False, "accumulate"):
        assert graphs[optimize]["buckets"] == eager, (optimize, graphs[optimize]["buckets"], eager)
    # Overlap: all but the last bucket leave before backward computes its last gradient, as in eager; the
    # unsplit graph hands every gradient over at its end, so every bucket leaves after it.
    launches = {k: v["launches"][-3:] for k, v in graphs.items()}
    assert launches[None] == [(len(eager) - 1, len(eager))] * 3, launches
    assert launches[True] == launches["accumulate"] == launches[None], launches
    assert launches[False] == [(0, len(eager))] * 3, launches


class _SwitchLossAtStep10(L.Callback):
    """At step 10 the training step switches to another loss: ``self.loss``, a string Dynamo guards on, changes."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == 10:
            module.loss = "square"


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_a_fallback_to_eager_is_a_decision(tmp_path):
    """recompile_limit=1: the switched loss needs a second graph, Dynamo runs the step eagerly, and SoloDDP says
    so. (A freeze needs one on torch 2.14.1, not on 2.11.0, which does not guard a parameter's requires_grad.)"""
    import torch._dynamo

    with torch._dynamo.config.patch(recompile_limit=1):  # the forked ranks inherit it
        records = _fit(tmp_path, _model(), 14, callbacks=[_SwitchLossAtStep10()], compile=CHEAP)
    for record in records:
        fallback = record["decisions"]["compile_fallback"]
        assert fallback["value"] == "eager" and "recompile limit" in fallback["reason"].lower(), fallback


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_auto_measures_and_every_rank_keeps_the_same_choice(tmp_path):
    """compile="auto" times compiled and eager steps after the unused window, and the ranks agree."""
    model = _model()
    records = _fit(tmp_path, model, 16, compile="auto", fit_model=torch.compile(model, **CHEAP))
    decided = [r["decisions"]["compile"] for r in records]
    assert decided[0] == decided[1], decided
    assert isinstance(decided[0]["value"], bool) and "auto: compiled step" in decided[0]["reason"], decided[0]
    # 6 steps: 2 left after the unused window, fewer than the trial's 7: eager, without compiling (inductor's,
    # which "auto" would have used: SoloDDP compiles only when the trial starts).
    records = _fit(tmp_path / "short", _model(), 6, compile="auto")
    for record in records:
        assert record["decisions"]["compile"]["value"] is False, record["decisions"]["compile"]
        assert "too short" in record["decisions"]["compile"]["reason"]
        assert record["frames"][-1] == record["frames0"]  # nothing compiled


def test_decide_compile_pays_back_within_the_planned_run():
    assert decide_compile(10.0, 20.0, 1.0, 100, 3).value is True  # 100 steps save 1 s
    assert decide_compile(10.0, 20.0, 1.0, 99, 3).value is False
    assert decide_compile(10.0, 20.0, 1.0, math.inf, 3).value is True
    assert decide_compile(20.0, 10.0, 0.0, math.inf, 3).value is False  # compiled is slower
    assert "pays back after 100 steps" in decide_compile(10.0, 20.0, 1.0, 100, 3).reason


def test_the_eager_log_is_the_modules_own_again_after_teardown():
    module = _model()
    steps = CompiledSteps(CHEAP)
    assert steps.setup(module).value is True and "log" in module.__dict__ and "log_dict" in module.__dict__
    steps.teardown()
    assert "log" not in module.__dict__ and "log_dict" not in module.__dict__
    assert module.log.__func__ is L.LightningModule.log and not lightning_compat.compiled_by_user(module)


def test_compile_setting_is_checked():
    with pytest.raises(ValueError, match="compile='yes'"):
        SoloDDP(compile="yes")
    with pytest.raises(ValueError, match=r"not torch\.compile options"):
        CompiledSteps({"backnd": "eager"})
    assert CompiledSteps({"mode": "max-autotune"}).setting is True
    assert SoloDDP().decisions["compile"].value is False


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_checkpoints_resume_across_compiled_and_eager(tmp_path):
    """A compiled run's mid-epoch checkpoint (no ``_orig_mod.`` keys) resumes eagerly, an eager run's resumes
    compiled, and both end where the uninterrupted eager run does."""
    reference = _fit(tmp_path / "reference", _model(), 12)
    for first, then in ((CHEAP, False), (False, CHEAP)):
        run = tmp_path / f"first_{bool(first)}"
        save = SoloCheckpoint(dirpath=run / "ckpt", every_n_train_steps=6)
        _fit(run / "a", _model(), 6, callbacks=[save], compile=first)
        checkpoint = torch.load(run / "ckpt" / "last.ckpt", weights_only=True)
        assert checkpoint["global_step"] == 6
        assert not [k for k in checkpoint["state_dict"] if "_orig_mod" in k], list(checkpoint["state_dict"])
        resumed = _fit(run / "b", _model(), 12, ckpt_path=str(run / "ckpt" / "last.ckpt"), compile=then)
        for rank in (0, 1):
            _assert_close(resumed[rank]["params"], reference[rank]["params"])
        assert "RNG states restored" in resumed[0]["decisions"]["mid_epoch_resume"]["reason"]
