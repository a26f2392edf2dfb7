"""comm_hook="auto": every candidate hook really runs for its trial, the times are reduced over the ranks, the
same hook is kept on every rank, and on CPU (gloo, where the hooks measure slower) it is exact all-reduce.
The fit accumulates gradients over 2 batches (trials switch at step boundaries; DDP records nothing under
``no_sync``), with TrainingDoctor on: one value per optimizer step, every micro-batch's samples counted."""

from __future__ import annotations

import time
import warnings

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_solo import SoloDDP
from lightning_solo.callbacks import TrainingDoctor
from lightning_solo.ddp.comm import CHECKPOINT_KEY, make_comm_hook
from lightning_solo.ddp.comm.auto import AUTO_CANDIDATES, AutoCommHook, decide_comm_hook, label
from tests.helpers.records import RankRecorder, read_rank_records, write_rank_record

TRIAL = 2 + 5  # AutoCommHook's default warm-up + timed steps per candidate


@pytest.mark.parametrize(
    ("measured", "kept"),
    [
        ({"exact": 10.0, "fp16": 11.0, "bf16": 10.5, "powersgd": 14.0}, None),  # hooks slower: exact
        (
            {"exact": 10.0, "fp16": 9.8, "bf16": 9.7, "powersgd": 12.0},
            None,
        ),  # 3% faster: not worth the rounding
        ({"exact": 10.0, "fp16": 8.0, "bf16": 7.0, "powersgd": 9.0}, "bf16"),  # the fastest, by 30%
        ({"exact": 10.0, "powersgd": 5.0}, "powersgd"),
    ],
)
def test_the_fastest_is_kept_and_a_hook_must_beat_exact_by_the_margin(measured, kept):
    decision = decide_comm_hook(measured, min_gain=0.05)
    assert decision.setting == "comm_hook" and decision.value == kept
    assert all(f"{name} {ms:.2f}" in decision.reason for name, ms in measured.items())


def test_auto_is_a_comm_hook_that_starts_exact_and_checks_its_candidates():
    hook = make_comm_hook("auto", powersgd_rank=2)
    assert isinstance(hook, AutoCommHook) and hook.name is None and hook.candidates == AUTO_CANDIDATES
    record = hook.state_dict()["auto"]  # where the trial is, for a checkpoint
    assert record["decided"] is False and (record["index"], record["times"]) == (0, [])
    assert record["candidates"] == ["exact", "fp16", "bf16", "powersgd"]
    with pytest.raises(ValueError, match="'auto'"):
        make_comm_hook("fp8")
    with pytest.raises(ValueError, match="comm_hook='fp8'"):
        AutoCommHook(candidates=(None, "fp8"))


def test_a_checkpoint_choice_is_kept_only_for_the_same_candidates_and_ranks(tmp_path):
    decided = {"decided": True, "name": "bf16", "reason": "auto: bf16 was the fastest (...)",
               "measured_ms": {"exact": 2.0, "bf16": 1.0}, "candidates": ["exact", "bf16"], "world_size": 2}  # fmt: skip
    hook = AutoCommHook(candidates=("bf16",))
    hook.load_state_dict({"auto": decided})  # no process group yet (a notebook's parent): taken as it is
    assert hook.decided and hook.name == "bf16" and hook.measured_ms == decided["measured_ms"]
    assert hook._decision.reason.endswith("not measured again")
    again = AutoCommHook(candidates=("bf16",))
    again.load_state_dict(hook.state_dict())  # a resume of a resumed run: said once
    assert again._decision.reason.count("not measured again") == 1

    other = AutoCommHook()
    with pytest.warns(UserWarning, match=r"other candidates \(exact, bf16\): measuring again"):
        other.load_state_dict({"auto": decided})
    assert not other.decided and other.name is None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    fewer = AutoCommHook(candidates=("bf16",))
    with pytest.warns(UserWarning, match="2 ranks, this run has 1: measuring again"):
        fewer.load_state_dict({"auto": decided})
    assert not fewer.decided
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_comm_hook("fp16").load_state_dict({"auto": decided})  # a fixed hook: nothing of auto's to take


class Tiny(L.LightningModule):
    """A 2-layer MLP whose step sleeps 100 ms: scheduling noise on the shared test machine stays small next to
    it, and the hooks' cost or saving on this 2 KiB of gradients is far below the 5% a hook must win by."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        time.sleep(0.1)
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(4 * 64, 16)), batch_size=4)


class HooksSeen(L.Callback):
    """The hook DDP ran each optimizer step, the comm-hook decision, the doctor's report."""

    def __init__(self, path, doctor):
        self.path, self.seen, self.doctor = path, [], doctor

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if len(self.seen) < trainer.global_step:  # this micro-batch ended a step
            self.seen.append(trainer.strategy.model._get_ddp_logging_data().get("comm_hook"))

    def on_fit_end(self, trainer, pl_module):
        strategy = trainer.strategy
        decision = strategy.decisions["comm_hook"]
        write_rank_record(
            self.path,
            trainer.global_rank,
            {"seen": self.seen, "value": decision.value, "reason": decision.reason,
             "measured": strategy.comm_hook.measured_ms, "doctor": self.doctor.report},
        )  # fmt: skip


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_auto_tries_every_hook_and_keeps_exact_allreduce_on_cpu(tmp_path):
    steps = TRIAL * len(AUTO_CANDIDATES) + 3
    doctor = TrainingDoctor(chart=None)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=steps, accumulate_grad_batches=2, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=tmp_path, strategy=SoloDDP(start_method="fork", comm_hook="auto"),
        callbacks=[doctor, HooksSeen(tmp_path, doctor)],
    )  # fmt: skip
    trainer.fit(Tiny())
    r0, r1 = read_rank_records(tmp_path)
    runs = [hook for i, hook in enumerate(r0["seen"]) if i == 0 or hook != r0["seen"][i - 1]]
    assert runs[:2] == [None, "fp16_compress_hook"] and runs[2].startswith("bf16_compress")  # the CPU-build name
    assert runs[3] == "resumable_powerSGD_hook"
    assert r0["seen"][: TRIAL * len(AUTO_CANDIDATES)].count(None) == TRIAL  # each candidate its whole trial
    assert list(r0["measured"]) == [label(name) for name in AUTO_CANDIDATES]
    # The rule on the figures measured (on idle CPU cores exact all-reduce; a loaded machine may time a hook
    # 5 % faster), and the steps after the trials run the hook that candidate's trial ran.
    kept = decide_comm_hook(r0["measured"])
    assert (r0["value"], r0["reason"]) == (kept.value, kept.reason)
    chosen = list(r0["measured"]).index(label(kept.value))
    assert r0["seen"][TRIAL * len(AUTO_CANDIDATES) :] == [r0["seen"][TRIAL * chosen + TRIAL - 1]] * 3, r0["seen"]
    assert r0["measured"] == r1["measured"] and r0["reason"] == r1["reason"]  # MAX-reduced: one choice
    assert all(ms >= 100.0 for ms in r0["measured"].values())  # the synchronising batch's 100 ms, timed

    report = r0["doctor"]
    assert report["steps"] == steps - 3  # the doctor's warm-up
    rank = report["ranks"][0]
    assert rank["samples_per_s"] * rank["step_ms"] / 1e3 == pytest.approx(2 * 4, rel=0.01)  # 2 batches of 4
    assert rank["compute_ms"] >= 200  # both micro-batches' forward+backward
    assert not {r["value"] for r in report["verdict"]["remedies"]} & {"fp16", "bf16", "powersgd", "auto"}


class Quick(Tiny):
    """Tiny without the sleep: the resume test compares weights, not times."""

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()


def _ddp_hook(trainer, module):
    return trainer.strategy.model._get_ddp_logging_data().get("comm_hook")


def _fit_auto(out, max_steps, ckpt_path=None, every=None):
    """A 2-rank fit with comm_hook="auto" (4 candidates × 7 steps: the trial ends after step 28); ``every``:
    for each number n, a checkpoint every n steps into ``out/n``. Per rank: the weights, the registered hook and the step after each batch."""
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    module = Quick()
    callbacks = [
        RankRecorder(
            out,
            on_train_batch_end={"params": "params", "hook": _ddp_hook, "step": "global_step"},
            on_fit_end={
                "decisions": "decisions",
                "measured": lambda trainer, module: trainer.strategy.comm_hook.measured_ms,
            },
            suffix=".pt",
        )
    ]
    if every is not None:
        callbacks += [
            ModelCheckpoint(dirpath=out / str(n), filename="{step}", every_n_train_steps=n, save_top_k=-1)
            for n in every
        ]
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=every is not None, default_root_dir=out,
        strategy=SoloDDP(start_method="fork", comm_hook="auto"), callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt_path)
    return read_rank_records(out, suffix=".pt")


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_auto_checkpoints_its_trial_and_its_choice_and_resumes_exactly(tmp_path):
    """A checkpoint inside the trial resumes the trial where it was: at step 25 on PowerSGD, whose error feedback
    is live; at step 21, the last of bf16's steps, on PowerSGD from the first batch. One after the choice (step
    30) resumes with the hook kept, without measuring again. Each continues as the uninterrupted fit did,
    weight for weight (the 2.6.x code crashed at the first save: state_dict took no ``replica``)."""
    full = _fit_auto(tmp_path / "full", max_steps=32, every=(5, 7))
    kept = full[0]["decisions"]["comm_hook"]
    assert kept == full[1]["decisions"]["comm_hook"] and not kept["reason"].startswith("auto: measuring")
    assert list(full[0]["measured"]) == [label(name) for name in AUTO_CANDIDATES]
    ckpt = {step: tmp_path / "full" / str(n) / f"step={step}.ckpt" for step, n in ((21, 7), (25, 5), (30, 5))}
    for path in ckpt.values():
        assert "auto" in torch.load(path, weights_only=True)[CHECKPOINT_KEY]

    boundary = _fit_auto(tmp_path / "boundary", 24, ckpt_path=ckpt[21])
    in_trial = _fit_auto(tmp_path / "in_trial", 28, ckpt_path=ckpt[25])
    after = _fit_auto(tmp_path / "after", 32, ckpt_path=ckpt[30])
    for rank in range(2):
        assert (boundary[rank]["step"][0], in_trial[rank]["step"][0], after[rank]["step"][0]) == (22, 26, 31)
        assert boundary[rank]["hook"] == full[rank]["hook"][21:24] == ["resumable_powerSGD_hook"] * 3
        assert in_trial[rank]["hook"] == full[rank]["hook"][25:28] == ["resumable_powerSGD_hook"] * 3
        assert after[rank]["hook"] == full[rank]["hook"][30:]  # the kept hook from the first resumed step
        assert after[rank]["decisions"]["comm_hook"]["value"] == kept["value"]
        assert "not measured again" in after[rank]["decisions"]["comm_hook"]["reason"]
        assert after[rank]["measured"] == full[rank]["measured"]
        for run, start in ((boundary, 21), (in_trial, 25), (after, 30)):
            for got, want in zip(run[rank]["params"], full[rank]["params"][start:], strict=False):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
