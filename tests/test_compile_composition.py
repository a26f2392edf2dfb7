"""Everything else still holds under ``SoloDDP(compile=True)`` (issue 30), on 2 gloo ranks: SyncBN "auto",
bf16 autocast inside the compiled step, TrainingDoctor's time split, the export of a compiled run's checkpoint;
and a user's compiled submodule (``self.trunk = torch.compile(...)``) saves the eager module's keys, so its
checkpoints resume eagerly and back (``strip_compiled_prefix``).

As in tests/test_compile.py, the fits compile with ``backend="aot_eager"`` (Dynamo's capture, AOTAutograd and
DDPOptimizer's split, without inductor's ~30 s C++ compile per graph on this machine).
"""

from __future__ import annotations

import math
import os

import lightning as L
import pytest
import torch

from lightning_solo import SoloDDP
from lightning_solo.app.export import export_checkpoint
from lightning_solo.callbacks import SoloCheckpoint, TrainingDoctor
from lightning_solo.ddp.compiled_keys import CompiledKeys
from lightning_solo.ddp.syncbn import SoloSyncBatchNorm
from tests.helpers.modules import TinyModule
from tests.helpers.records import LastGrads, RankRecorder, read_rank_records

# SOLO_TEST_COMPILE_BACKEND=inductor runs the same tests through inductor (minutes per file here).
CHEAP = {"backend": os.environ.get("SOLO_TEST_COMPILE_BACKEND", "aot_eager")}
TOL = 1e-5
BF16_TOL = 2e-2  # bf16 has 8 bits of mantissa: ~4e-3 per rounding


_OPTIONS = dict(widths=(8, 16, 16, 4), loss="cross_entropy", samples=96, batch_size=4, init_seed=0, data_seed=0, lr=0.1)


def _model(cls: type[TinyModule] = TinyModule, **kwargs) -> TinyModule:
    return cls(**{**_OPTIONS, **kwargs})


def _layers(trainer, module) -> list[str]:
    synced = {True: " synced", False: ""}
    return sorted({type(m).__name__ + synced[isinstance(m, SoloSyncBatchNorm)]
                   for m in module.modules() if "BatchNorm" in type(m).__name__})  # fmt: skip


def _fit(out, model, steps, callbacks=(), ckpt_path=None, precision=None, **strategy) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    recorder = RankRecorder(
        out,
        on_train_batch_end={"layers": _layers},
        on_train_end=("state",),  # parameters and buffers (BatchNorm's running statistics)
        on_fit_end=("decisions",),
        suffix=".pt",
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SoloDDP(start_method="fork", precision=precision, **strategy),
        max_steps=steps,
        callbacks=[recorder, *callbacks],
        logger=False,
        default_root_dir=out,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.Checkpoint) for c in callbacks),
        num_sanity_val_steps=0,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return read_rank_records(out, suffix=".pt")


def _plain(state: dict) -> dict:
    return {k.replace("_orig_mod.", ""): v for k, v in state.items()}


def _assert_close(got: dict, want: dict, tol: float = TOL, floor: float = 0.0) -> list[float]:
    """Each tensor within ``tol`` of its own norm, or of ``floor`` × the largest norm where its own is smaller: a
    gradient that is zero in exact arithmetic (a Linear's bias right before BatchNorm: 1.5e-8 of the largest here) is
    rounding noise, which inductor's reordered sums change by 100 %. ``tol`` × ``floor`` = 1e-7 of the largest is
    about float32's resolution at that scale (eps 6e-8)."""
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    scale = floor * max(float(v.norm()) for v in want.values() if v.is_floating_point())
    diffs = []
    for name, value in want.items():
        if not value.is_floating_point():  # num_batches_tracked
            assert torch.equal(got[name], value), name
            continue
        rel = float((got[name] - value).norm()) / max(float(value.norm()), scale, 1e-12)
        assert rel <= tol, f"{name}: relative difference {rel:.2e}"
        diffs.append(rel)
    return diffs


class _DoctorReport(L.Callback):
    def __init__(self, out, doctor):
        self.out, self.doctor = out, doctor

    def on_fit_end(self, trainer, module):
        torch.save({"report": self.doctor.report}, os.path.join(self.out, f"doctor{trainer.global_rank}.pt"))


def _assert_sane_split(report: dict) -> None:
    """The doctor's time split: every part present and non-negative, the parts sum to the step, the shares are
    fractions, and some communication was measured (DDP's all-reduce, SyncBN's)."""
    assert report["steps"] > 0 and report["verdict"]["bound"] in report["verdict"]["shares"], report
    for row in report["ranks"]:
        parts = [row[k] for k in ("data_ms", "compute_ms", "comm_ms", "optimizer_ms")]
        assert all(p >= 0 for p in parts) and row["step_ms"] > 0, row
        assert math.isclose(sum(parts), row["step_ms"], rel_tol=1e-9), row
        assert row["comm_ms"] > 0, row
    shares = report["verdict"]["shares"]
    assert set(shares) == {"data", "communication", "compute", "straggler"}, shares
    assert all(0.0 <= s <= 1.0 for s in shares.values()), shares
    # No sum bound: communication is the slowest rank's share, data and compute the other ranks' mean.


@pytest.mark.multiproc
@pytest.mark.slow  # two fits with SyncBN, the doctor and a checkpoint, plus two exports: ~18 s idle, 2x at load
@pytest.mark.timeout(180)
def test_syncbn_auto_the_doctor_and_export_hold_under_compile(tmp_path):
    """A BatchNorm model at 4 samples per rank (sync_batchnorm="auto" converts), with TrainingDoctor and a
    checkpoint: compiled, the last step's gradients and the weights and running statistics equal eager's, SyncBN
    is on in both, the doctor's time split is sane in both, and the exported weights.pt are the same."""
    runs, grads, reports, exports = {}, {}, {}, {}
    steps = 8
    for name, compile_ in (("eager", False), ("compiled", CHEAP)):
        out = tmp_path / name
        doctor = TrainingDoctor(warmup_steps=2, chart=None)
        save = SoloCheckpoint(dirpath=out / "ckpt", every_n_train_steps=steps)
        runs[name] = _fit(
            out,
            _model(batchnorm=True),
            steps,
            callbacks=[LastGrads(out), doctor, _DoctorReport(out, doctor), save],
            compile=compile_,
        )
        grads[name] = torch.load(out / "grads0.pt", weights_only=True)
        reports[name] = torch.load(out / "doctor0.pt", weights_only=False)["report"]
        export_checkpoint(out / "ckpt" / "last.ckpt", out / "export", onnx=False)
        exports[name] = torch.load(out / "export" / "weights.pt", weights_only=True)
    compiled, eager = runs["compiled"], runs["eager"]
    for rank in (0, 1):
        _assert_close(compiled[rank]["state"], eager[rank]["state"])
        decisions = compiled[rank]["decisions"]
        assert decisions["compile"]["value"] is True and "compile_fallback" not in decisions, decisions
        for run in (compiled, eager):
            synced = run[rank]["decisions"]["sync_batchnorm"]
            assert synced["value"] is True and "per-device batch 4 < 32" in synced["reason"], synced
            assert {tuple(x) for x in run[rank]["layers"]} == {("BatchNorm1d synced",)}, run[rank]["layers"]
    _assert_close(grads["compiled"], grads["eager"], floor=1e-2)
    # The running statistics were synchronised: both ranks hold the same (per-rank BatchNorm would differ).
    for key in ("trunk.1.running_mean", "trunk.1.running_var"):
        assert torch.equal(compiled[0]["state"][key], compiled[1]["state"][key]), key
    for report in reports.values():
        _assert_sane_split(report)
    # The export of the compiled run: the eager run's keys, its values, and the trained module's state.
    assert list(exports["compiled"]) == list(exports["eager"]) == list(eager[0]["state"])
    _assert_close(exports["compiled"], exports["eager"])
    _assert_close(exports["compiled"], compiled[0]["state"], tol=0.0)


class _Bf16Logits(TinyModule):
    """Returns its logits with the loss: the callback checks they were computed in bf16."""

    def training_step(self, batch, batch_idx):
        logits = self(batch[0])
        return {"loss": torch.nn.functional.cross_entropy(logits, batch[1]), "logits": logits.detach()}


class _Dtypes(L.Callback):
    def __init__(self):
        self.seen: set[torch.dtype] = set()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.seen.add(outputs["logits"].dtype)
        if trainer.global_step == trainer.max_steps:
            assert self.seen == {torch.bfloat16}, self.seen  # raised in the rank: the fit fails


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_bf16_autocast_inside_the_compiled_step_matches_eager(tmp_path):
    """precision="auto" is fp32 on CPU (no autocast to compile), so bf16-mixed is set: Lightning's autocast
    around the compiled training_step, the logits in bf16, and weights and gradients equal eager bf16's within
    bf16's tolerance."""
    runs, grads = {}, {}
    for name, compile_ in (("eager", False), ("compiled", CHEAP)):
        out = tmp_path / name
        model = _model(_Bf16Logits, samples=64)
        runs[name] = _fit(
            out, model, 6, callbacks=[LastGrads(out), _Dtypes()], precision="bf16-mixed", compile=compile_
        )
        grads[name] = torch.load(out / "grads0.pt", weights_only=True)
    for rank in (0, 1):
        decisions = runs["compiled"][rank]["decisions"]
        assert decisions["precision"]["value"] == "bf16-mixed", decisions["precision"]
        assert decisions["compile"]["value"] is True and "compile_fallback" not in decisions, decisions
        _assert_close(runs["compiled"][rank]["state"], runs["eager"][rank]["state"], BF16_TOL)
    _assert_close(grads["compiled"], grads["eager"], BF16_TOL)


class _CompiledTrunk(TinyModule):
    """The user compiles a submodule: ``self.trunk = torch.compile(self.trunk)``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.trunk = torch.compile(self.trunk, **CHEAP)


@pytest.mark.multiproc
@pytest.mark.slow  # five fits: ~35 s idle
@pytest.mark.timeout(180)
def test_a_compiled_submodules_checkpoints_resume_eagerly_and_back(tmp_path):
    """A run with ``self.trunk = torch.compile(...)`` saves torch's keys (``trunk._orig_mod.0.weight``), as stock,
    so ``load_from_checkpoint`` of its class works outside the Trainer; its checkpoint resumes into the eager
    module and an eager one into the compiled module, both ending where the uninterrupted eager run does; the
    export of either is the eager network's."""
    options = dict(batchnorm=True, shuffle=True)  # BatchNorm: its buffers and version metadata move too
    reference = _fit(tmp_path / "reference", _model(**options), 12)
    eager_keys = list(_model(**options).state_dict())
    for first, then in ((_CompiledTrunk, TinyModule), (TinyModule, _CompiledTrunk)):
        run = tmp_path / first.__name__
        save = SoloCheckpoint(dirpath=run / "ckpt", every_n_train_steps=6)
        head = _fit(run / "a", _model(first, **options), 6, callbacks=[save])
        checkpoint = torch.load(run / "ckpt" / "last.ckpt", weights_only=True)
        assert list(checkpoint["state_dict"]) == list(_model(first, **options).state_dict())
        # What a user's evaluation script does, outside any Trainer and strategy: a plain strict load.
        loaded = first.load_from_checkpoint(run / "ckpt" / "last.ckpt", weights_only=True, **_OPTIONS, **options)
        _assert_close(loaded.state_dict(), checkpoint["state_dict"], 0.0)
        export_checkpoint(run / "ckpt" / "last.ckpt", run / "export", onnx=False)
        assert list(torch.load(run / "export" / "weights.pt", weights_only=True)) == eager_keys
        resumed = _fit(run / "b", _model(then, **options), 12, ckpt_path=str(run / "ckpt" / "last.ckpt"))
        for rank in (0, 1):
            _assert_close(_plain(resumed[rank]["state"]), reference[rank]["state"])
        compiled = head if first is _CompiledTrunk else resumed
        keys = compiled[0]["decisions"]["strip_compiled_prefix"]
        assert keys["value"] is False and "['trunk']" in keys["reason"], keys
        assert "strip_compiled_prefix" not in (resumed if first is _CompiledTrunk else head)[0]["decisions"]


def test_compiled_keys_save_stock_keys_unless_stripping_and_either_spelling_loads():
    """By default torch's keys are saved, as stock; ``strip_compiled_prefix=True`` drops the compiled submodule's
    ``_orig_mod`` level from the keys (and the version metadata's module paths); either spelling loads into
    either module whatever the setting."""
    compiled, eager = _model(_CompiledTrunk, batchnorm=True), _model(batchnorm=True)
    stock = compiled.state_dict()
    assert CompiledKeys().save(stock, compiled) is stock
    assert CompiledKeys().decision(compiled).value is False
    assert CompiledKeys().decision(eager) is None  # nothing compiled inside: nothing differs from stock
    assert "strip_compiled_prefix" not in SoloDDP().decisions
    assert SoloDDP(strip_compiled_prefix=True).decisions["strip_compiled_prefix"].value is True
    for keys in (CompiledKeys(), CompiledKeys(strip=True)):
        eager.load_state_dict(keys.load(stock, eager))  # a compiled run's checkpoint into the eager module
        compiled.load_state_dict(keys.load(eager.state_dict(), compiled))  # and back
        assert keys.load(stock, compiled) is stock  # already its spelling
    plain = CompiledKeys(strip=True).save(stock, compiled)
    assert list(plain) == list(eager.state_dict())
    assert plain._metadata["trunk.1"] == {"version": 2}  # BatchNorm's version, under its eager path
    eager.load_state_dict(CompiledKeys().load(plain, eager))
    with pytest.raises(ValueError, match="strip_compiled_prefix must be True or False"):
        SoloDDP(strip_compiled_prefix="yes")
