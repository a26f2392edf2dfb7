"""After a forked fit (the notebook launcher) the parent holds what an in-process fit would leave there.

Stock Lightning's fork launcher leaves ``global_step`` at 0, callbacks untrained and the strategy's decisions
behind in the workers, and refuses a second ``fit`` on the same Trainer. Each test runs real 2-process fits
(gloo, fork) and compares the parent with what rank 0 saw, through files the ranks write themselves. What
crosses is state_dicts and decisions, as plain CPU data only (an attribute outside a ``state_dict()`` stays in
the workers, as across a checkpoint): a guard walks the parent after a ``16-mixed`` fit for any
tensor that is not a plain CPU tensor, with tensors that claim to be on CUDA planted in the workers.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_solo import SoloDDP
from lightning_solo.app.run_summary import RunSummary
from lightning_solo.callbacks import WarmupScaledLR
from lightning_solo.core.decision import Decision
from lightning_solo.ddp.carry import LEFT_BEHIND, NotPlain, pack, plain, unpack
from lightning_solo.ddp.launcher import SoloLauncher, capture, restore
from tests.helpers.modules import TinyModule
from tests.helpers.records import RankRecorder, read_rank_records

SAMPLES, BATCH, WORLD = 64, 8, 2
STEPS_PER_EPOCH = SAMPLES // (BATCH * WORLD)


class TinyClassifier(TinyModule):
    """TinyModule that logs its losses and keeps them in a list (a notebook habit: plot afterwards), in its
    state_dict through torch's ``get_extra_state``; it also counts its batches in a plain attribute."""

    def __init__(self) -> None:
        super().__init__((8, 16, 4), activation=nn.ReLU, loss="cross_entropy", lr=0.1, momentum=0.9)
        self.losses: list[float] = []
        self.batches_seen = 0  # outside the state_dict: stays in the workers

    def training_step(self, batch, batch_idx):
        loss = self.batch_loss(batch)
        self.losses.append(loss.item())
        self.batches_seen += 1
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.batch_loss(batch), sync_dist=True)

    def get_extra_state(self):
        return {"losses": self.losses}

    def set_extra_state(self, state):
        self.losses = list(state["losses"])


class StepLog(L.Callback):
    """A user callback that keeps a list, with a ``state_dict`` as Lightning's docs write one."""

    def __init__(self) -> None:
        self.steps_seen: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.steps_seen.append(trainer.global_step)

    def state_dict(self):
        return {"steps_seen": self.steps_seen}

    def load_state_dict(self, state_dict):
        self.steps_seen = list(state_dict["steps_seen"])


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=g)
    return DataLoader(TensorDataset(x, (x[:, :4].argmax(1))), batch_size=BATCH)


def make_trainer(tmp_path, strategy, max_epochs: int, name: str):
    recorder = StepLog()  # a user callback's list
    # Each rank's final weights, through a channel independent of the launcher.
    weights = RankRecorder(tmp_path, on_train_end=("state", "global_step", "optimizer"), suffix=".pt")
    summary = RunSummary()
    checkpoint = ModelCheckpoint(dirpath=tmp_path / name, monitor="val_loss", save_top_k=1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_epochs=max_epochs,
        callbacks=[recorder, weights, summary, checkpoint],
        logger=CSVLogger(tmp_path, name=name),
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    return trainer, recorder, summary, checkpoint


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def assert_rank_zero_weights(model, tmp_path, step):
    ranks = read_rank_records(tmp_path, WORLD, suffix=".pt")
    assert [r["global_step"] for r in ranks] == [step] * WORLD
    for key, value in model.state_dict().items():  # the weights and rank 0's extra state (its own losses)
        torch.testing.assert_close(value, ranks[0]["state"][key], rtol=0, atol=0)
    for key, value in weights(model).items():
        torch.testing.assert_close(ranks[1]["state"][key], value, rtol=0, atol=0)


@pytest.fixture
def private_tmpdir(tmp_path, monkeypatch):
    """Lightning's fork launcher leaks one mkdtemp() directory per fit: give it a directory we can inspect."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    return temp


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_parent_holds_the_fit_and_can_fit_again(tmp_path, private_tmpdir):
    torch.manual_seed(0)
    model = TinyClassifier()
    initial = weights(model)
    trainer, recorder, summary, checkpoint = make_trainer(tmp_path, SoloDDP(start_method="fork"), 2, "first")
    assert isinstance(trainer.strategy._launcher, SoloLauncher)
    trainer.fit(model, loader(), loader())

    steps = 2 * STEPS_PER_EPOCH
    # Weights: changed, and exactly rank 0's (== rank 1's).
    assert any(not torch.equal(initial[k], v) for k, v in weights(model).items())
    assert_rank_zero_weights(model, tmp_path, steps)
    # Loop progress: the true step, epoch and logging step (stock Lightning: 0, 0, 0).
    assert (trainer.global_step, trainer.current_epoch) == (steps, 2)
    assert trainer.fit_loop.epoch_loop._batches_that_stepped == steps
    assert not trainer.fit_loop.restarting
    # Metrics.
    assert {"train_loss", "val_loss"} <= set(trainer.callback_metrics)
    assert "train_loss" in trainer.logged_metrics
    # Callbacks: ModelCheckpoint's best path and score, a user callback's list, the run summary.
    assert checkpoint.best_model_path and (tmp_path / "first").joinpath(checkpoint.best_model_path).exists()
    assert checkpoint.best_model_score is not None
    assert math.isclose(float(checkpoint.best_model_score), float(trainer.callback_metrics["val_loss"]), rel_tol=0.5)
    assert recorder.steps_seen == list(range(1, steps + 1))
    assert summary.summary is not None and summary.summary["global_step"] == steps
    # The module's state_dict (its extra state: the losses training_step appended); a plain attribute stays
    # behind; the strategy's decisions made in the workers.
    assert len(model.losses) == steps and model.batches_seen == 0
    assert trainer.strategy.decisions["process_group_backend"].value == "gloo"
    assert "cpu_threads" in trainer.strategy.decisions
    assert trainer.strategy.decisions["cpu_malloc"].value == "reuse freed memory"
    # The logger's version is the workers' one, so the parent's log_dir is where the metrics are.
    assert (tmp_path / "first" / "version_0" / "metrics.csv").exists()
    assert trainer.logger.version == 0
    # No leaked temp directory.
    assert list(private_tmpdir.iterdir()) == []
    # The optimizer, as a fit in one process leaves it: the parent's own, holding rank 0's momentum.
    (optimizer,) = trainer.optimizers
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == {id(p) for p in model.parameters()}
    rank0 = read_rank_records(tmp_path, WORLD, suffix=".pt")[0]["optimizer"]
    for index, buffers in rank0["state"].items():
        torch.testing.assert_close(optimizer.state_dict()["state"][index], buffers, rtol=0, atol=0)
    assert len(rank0["state"]) == len(list(model.parameters()))

    # A second fit on the same Trainer continues from where the first stopped (Lightning raises here).
    trainer.fit_loop.max_epochs = 3
    trainer.fit(model, loader(), loader())
    assert (trainer.global_step, trainer.current_epoch) == (steps + STEPS_PER_EPOCH, 3)
    assert_rank_zero_weights(model, tmp_path, steps + STEPS_PER_EPOCH)
    assert recorder.steps_seen[-1] == steps + STEPS_PER_EPOCH
    assert list(private_tmpdir.iterdir()) == []

    # And a fit on a new Trainer in the same process starts its own count.
    trainer2, recorder2, summary2, _ = make_trainer(tmp_path, "solo_ddp_notebook", 1, "second")
    assert isinstance(trainer2.strategy._launcher, SoloLauncher)
    before = weights(model)
    trainer2.fit(model, loader(), loader())
    assert (trainer2.global_step, trainer2.current_epoch) == (STEPS_PER_EPOCH, 1)
    assert any(not torch.equal(before[k], v) for k, v in weights(model).items())
    assert recorder2.steps_seen == list(range(1, STEPS_PER_EPOCH + 1))
    assert summary2.summary["global_step"] == STEPS_PER_EPOCH
    assert trainer2.checkpoint_callback.best_model_path.startswith(str(tmp_path / "second"))


@dataclasses.dataclass(frozen=True)
class _Point:
    x: torch.Tensor
    label: str


class _ListOnly(L.Callback):
    def __init__(self) -> None:
        self.filled: list[int] = []


def test_what_crosses_is_state_dicts_and_decisions(caplog):
    """capture() in the worker, restore() in the parent, without the processes: a callback's public list comes
    back only through its state_dict(), a callback's decisions through its public decisions."""

    def trainer_with(callbacks):
        trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=callbacks, enable_progress_bar=False)
        trainer.strategy.connect(TinyClassifier())
        return trainer

    worker = trainer_with([StepLog(), _ListOnly(), WarmupScaledLR(warmup_steps=0)])
    steps, plain, warmup = worker.callbacks[:3]
    steps.steps_seen, plain.filled = [1, 2, 3], [4, 5]
    warmup.decisions["lr_scale"] = Decision("lr_scale", 2.0, "made in the worker")
    parent = trainer_with([StepLog(), _ListOnly(), WarmupScaledLR(warmup_steps=0)])
    caplog.clear()
    restore(parent, capture(worker))
    steps, plain, warmup = parent.callbacks[:3]
    assert steps.steps_seen == [1, 2, 3]
    assert plain.filled == []  # no state_dict: stays in the worker
    assert warmup.decisions["lr_scale"] == Decision("lr_scale", 2.0, "made in the worker")
    assert "[WarmupScaledLR]" not in caplog.text  # announced where it was made, not again in the notebook


class _ClaimsCuda(torch.Tensor):
    """A CPU tensor that reports itself on CUDA, as a device tensor would: stands in for one on a CPU machine.
    Unpickled as itself, it would be a "CUDA tensor" in the parent."""

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0)


def claims_cuda(*values: float) -> torch.Tensor:
    return torch.tensor(values).as_subclass(_ClaimsCuda)


def test_what_crosses_is_plain_cpu_data_or_nothing():
    state = {"scale": 2.0, "counter": claims_cuda(3.0), "nested": [_Point(claims_cuda(1.0, 2.0), "p")]}
    copied = plain(state)
    assert type(copied["counter"]) is torch.Tensor and not copied["counter"].is_cuda
    assert copied["counter"].tolist() == [3.0] and copied["nested"][0].x.tolist() == [1.0, 2.0]
    assert type(unpack(pack(state, "state"), "state")["counter"]) is torch.Tensor
    # A tensor with no data the CPU can copy is refused, never sent as a device tensor.
    meta = {"m": torch.empty(2, device="meta")}
    with pytest.raises(NotPlain, match="meta"):
        plain(meta)
    assert unpack(pack(meta, "meta"), "meta") is LEFT_BEHIND
    with pytest.raises(NotPlain, match="parameter"):
        plain(nn.Parameter(torch.ones(1)))


def test_capture_outside_a_fit_is_empty_of_progress():
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    trainer.strategy.connect(TinyClassifier())
    state = capture(trainer)
    assert state["fit_loop"] is None and state["optimizers"] == state["lr_schedulers"] == []


def _training_state(trainer, module) -> dict:
    """The step, the GradScaler's scale and PowerSGD's iteration."""
    scale, powersgd = trainer.precision_plugin.scaler.get_scale(), trainer.strategy.comm_hook.state
    return {"step": trainer.global_step, "scale": scale, "iter": powersgd.iter}


class _PlantsDeviceTensors(L.Callback):
    """In the workers, puts tensors that claim CUDA where a device tensor could be after a GPU fit: the precision
    plugin, this callback's attribute and its state_dict()."""

    def __init__(self) -> None:
        self.on_device: torch.Tensor | None = None

    def on_train_end(self, trainer, pl_module):
        trainer.precision_plugin.planted = claims_cuda(1.0)
        self.on_device = claims_cuda(float(trainer.global_step))

    def state_dict(self):
        return {"counter": self.on_device} if self.on_device is not None else {}

    def load_state_dict(self, state_dict):
        self.counter = state_dict["counter"]


class _NoData(L.Callback):
    """A state_dict() holding a meta tensor, which has no data to copy: refused, never loaded."""

    def on_train_end(self, trainer, pl_module):
        self.ended = True

    def state_dict(self):
        return {"m": torch.empty(2, device="meta")} if getattr(self, "ended", False) else {}

    def load_state_dict(self, state_dict):
        self.loaded = True  # never in the parent: the launcher warns on an exception here, so this is a flag


def device_tensors(obj, path: str = "", seen: set | None = None, depth: int = 0) -> list[str]:
    """Where ``obj`` (walked through attributes, containers and dataclasses) holds a tensor that is not a
    plain CPU tensor: what unpickling a device tensor would have left in the parent."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 12 or isinstance(obj, (nn.Module, L.Trainer, type)):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        plain_cpu = type(obj) in (torch.Tensor, nn.Parameter) and obj.device.type == "cpu" and not obj.is_cuda
        return [] if plain_cpu else [f"{path}: {type(obj).__name__} on {obj.device}"]
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple, set)):
        items = list(enumerate(obj))
    elif hasattr(obj, "__dict__") and not isinstance(obj, (str, bytes)):
        items = list(vars(obj).items())
    else:
        return []
    return [hit for key, value in items for hit in device_tensors(value, f"{path}.{key}", seen, depth + 1)]


def parent_state(trainer, model) -> dict:
    """Everything the launcher may have set in the parent (the module's own parameters and buffers aside)."""
    owned = {*model._parameters, *model._buffers, *model._modules}
    return {
        "precision_plugin": trainer.strategy.precision_plugin,
        "callbacks": trainer.callbacks,
        "module": {k: v for k, v in vars(model).items() if k not in owned and not k.startswith("_")},
        "decisions": trainer.strategy.decisions,
        "metrics": [trainer.callback_metrics, trainer.logged_metrics, trainer.progress_bar_metrics],
    }


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_after_a_16_mixed_fit_the_parent_holds_no_device_state_and_fits_again(tmp_path):
    strategy = SoloDDP(
        start_method="fork",
        precision="16-mixed",
        scaler={"init_scale": 2.0**8, "growth_interval": 1},
        comm_hook="powersgd",
        powersgd_start_iter=2,
    )
    planted, no_data = _PlantsDeviceTensors(), _NoData()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=3,
        logger=False,
        callbacks=[
            RankRecorder(tmp_path, on_train_start={"start": _training_state}, on_train_end={"end": _training_state}),
            planted,
            no_data,
        ],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = TinyClassifier()
    trainer.fit(model, loader())
    first_end = read_rank_records(tmp_path)[0]["end"]
    assert first_end["step"] == 3
    assert first_end["scale"] > 2.0**8 and first_end["iter"] >= 3  # the scale grew every step

    # The guard: nothing in the parent is a tensor that is not a plain CPU tensor.
    assert device_tensors(parent_state(trainer, model)) == []
    plugin = trainer.strategy.precision_plugin
    assert not hasattr(plugin, "planted")  # the plugin object stayed behind; its state came as numbers
    assert device_tensors(vars(plugin), "plugin") == [] and not any(
        isinstance(v, torch.Tensor) for v in vars(plugin).values()
    ), "the skipped-step counter lives on the device: the parent holds the count"
    assert plugin.skipped_steps == 0 and plugin.scaler.get_scale() == first_end["scale"]
    assert planted.on_device is None  # an attribute: stays in the workers
    # Its state_dict, converted to a plain CPU tensor.
    assert type(planted.counter) is torch.Tensor and planted.counter.tolist() == [3.0]
    assert not hasattr(no_data, "loaded")  # a state_dict with a meta tensor: refused whole, never loaded
    assert not torch.cuda.is_initialized()

    # The second fit continues the GradScaler and PowerSGD (not init_scale and PowerSGD's warm-up again).
    trainer.fit_loop.epoch_loop.max_steps = 5
    trainer.fit(model, loader())
    second_start = read_rank_records(tmp_path)[0]["start"]
    assert second_start == first_end
    assert trainer.global_step == 5 and device_tensors(parent_state(trainer, model)) == []


class _KeepsALot(L.Callback):
    def on_train_end(self, trainer, pl_module):
        self.kept = torch.arange(200_000, dtype=torch.float32)  # 800 KB: far over a pipe's 64 KiB buffer

    def state_dict(self):
        return {"kept": self.kept} if hasattr(self, "kept") else {}

    def load_state_dict(self, state_dict):
        self.kept = state_dict["kept"]


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_a_result_larger_than_a_pipe_comes_back_without_hanging(tmp_path, private_tmpdir):
    # Lightning's parent joins the workers before reading their results: through the queue, rank 0 would block.
    keeps = _KeepsALot()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=SoloDDP(start_method="fork"),
        max_steps=2,
        callbacks=[keeps],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(TinyClassifier(), loader())
    assert torch.equal(keeps.kept, torch.arange(200_000, dtype=torch.float32))
    assert trainer.global_step == 2
    assert not [p for p in private_tmpdir.rglob("*") if p.is_file()]  # the state file is gone
