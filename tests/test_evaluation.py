"""Exact distributed evaluation: every sample counted once on 2 and 3 ranks, the same metric as one process,
ranks in step (per-step collectives do not hang), predictions gathered in dataset order."""

from __future__ import annotations

import csv
import itertools
import math
import os

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from torchmetrics import MeanMetric

from lightning_solo import SoloDDP
from lightning_solo.app.data import SyntheticDataModule
from lightning_solo.app.models import ImageClassifier
from lightning_solo.callbacks.predictions import OrderedPredictions
from lightning_solo.ddp.eval import gather_rows, rank_order, write_predictions
from tests.distributed import run_ranks

SAMPLES = 101


@pytest.mark.parametrize(("total", "world"), list(itertools.product([1, 2, 3, 5, 17, 24, 25, 101], [1, 2, 3, 4])))
def test_rank_order_names_every_padding_repeat_of_lightnings_sampler(total, world):
    """Lightning's DistributedSampler, as it builds it for validate/test: every sample valid on exactly one rank,
    interleaved (rank r: r, r+W, ...), every rank the same length, at most W-1 repeats, each a rank's last row."""
    dataset = range(total)
    orders = [rank_order(DistributedSampler(dataset, world, rank, shuffle=False)) for rank in range(world)]
    assert len({len(indices) for indices, _ in orders}) == 1
    real = sorted(i for indices, valid in orders for i, ok in zip(indices, valid) if ok)
    assert real == list(range(total))
    for rank, (indices, valid) in enumerate(orders):
        assert [i for i, ok in zip(indices, valid) if ok] == list(range(rank, total, world))
        assert all(valid[:-1])
    assert sum(not ok for _, valid in orders for ok in valid) == math.ceil(total / world) * world - total


def test_gather_rows_on_one_process_sorts_and_refuses_repeats(tmp_path):
    index, value = gather_rows(torch.tensor([2, 0, 1]), torch.tensor([[2.0, 20.0], [0.0, 0.0], [1.0, 10.0]]))
    assert index.tolist() == [0, 1, 2] and value[:, 0].tolist() == [0.0, 1.0, 2.0]
    path = write_predictions(tmp_path / "p.csv", index, value)
    assert path.read_text().splitlines() == [
        "index,prediction_0,prediction_1",
        "0,0.0,0.0",
        "1,1.0,10.0",
        "2,2.0,20.0",
    ]
    saved = torch.load(write_predictions(tmp_path / "p.pt", index, value), weights_only=True)
    assert saved["index"].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="more than once"):
        gather_rows(torch.tensor([0, 1, 1]), torch.zeros(3))


class _Data(SyntheticDataModule):
    """101 validation images: validate in batches of 8, test in batches of 1 (padding on every world size
    that does not divide 101), predict in batches of 5."""

    def __init__(self) -> None:
        super().__init__(image_size=8, train_size=8, val_size=SAMPLES, batch_size=8)

    def test_dataloader(self):
        return DataLoader(self.val_set, batch_size=1)

    def predict_dataloader(self):
        return DataLoader(self.val_set, batch_size=5)


class _Classifier(ImageClassifier):
    """The pack's classifier plus per-step collectives in test: a synced step log and a torchmetrics metric
    that syncs on every step. A rank with fewer steps than the others would hang here."""

    def __init__(self) -> None:
        super().__init__("resnet18", num_classes=10, stem="cifar")
        self.rows_seen = MeanMetric(dist_sync_on_step=True)

    def test_step(self, batch, batch_idx):
        self.log("test/rows_step", float(len(batch[1])), on_step=True, on_epoch=False, sync_dist=True, batch_size=1)
        self.rows_seen(torch.tensor(float(len(batch[1]))))
        sampler = self.trainer.test_dataloaders.sampler  # Lightning's own, untouched (its tests and users read it)
        self.test_sampler = [type(sampler).__name__, sampler.num_replicas]
        return super().test_step(batch, batch_idx)


def _model() -> _Classifier:
    torch.manual_seed(0)
    return _Classifier().eval()


def _evaluate(rank, world_size, directory):
    os.environ["LOCAL_RANK"] = str(rank)  # ranks already running (as under torchrun)
    predictions = OrderedPredictions(dirpath=directory)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=SoloDDP(), callbacks=[predictions],
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=directory)  # fmt: skip
    model, data = _model(), _Data()
    val = trainer.validate(model, data, verbose=False)[0]
    test = trainer.test(model, data, verbose=False)[0]
    trainer.predict(model, data, return_predictions=False)
    return val, test, model.test_sampler, dict(predictions.counts)


def _reference():
    data = _Data()
    data.setup()
    x, y = map(torch.stack, zip(*[(img, torch.tensor(label)) for img, label in data.val_set]))
    with torch.no_grad():
        logits = _model()(x)
    return logits.argmax(1), int((logits.argmax(1) == y).sum()), float(F.cross_entropy(logits, y))


def _read(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return [int(r["index"]) for r in rows], [int(r["prediction"]) for r in rows]


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_evaluation_on_n_ranks_equals_one_process(tmp_path, world_size):
    predicted, correct, loss = _reference()
    results = run_ranks(_evaluate, world_size, str(tmp_path), timeout=110)
    for val, test, decisions, _ in results:
        for stage, metrics in (("val", val), ("test", test)):
            assert metrics[f"{stage}/samples"] == SAMPLES
            assert round(metrics[f"{stage}/acc"] * SAMPLES) == correct, (stage, metrics, correct)
            assert metrics[f"{stage}/loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
        assert decisions == ["DistributedSampler", world_size]
    assert results[0][3] == {"val": SAMPLES, "test": SAMPLES, "predict": SAMPLES}
    for stage in ("val", "test", "predict"):
        indices, classes = _read(tmp_path / f"predictions_{stage}.csv")
        assert indices == list(range(SAMPLES)) and classes == predicted.tolist(), stage


def _save(path, step, seed):
    import lightning

    from lightning_solo.checkpoint import SoloCheckpointIO

    torch.manual_seed(seed)
    model = ImageClassifier("resnet18", num_classes=10, stem="cifar")
    state = {"state_dict": model.state_dict(), "global_step": step, "epoch": 0}
    SoloCheckpointIO().save_checkpoint({**state, "pytorch-lightning_version": lightning.__version__}, path)
    return model


def test_evaluate_refuses_bad_input_by_name(tmp_path):
    from lightning_solo.app.config_check import ConfigError
    from lightning_solo.app.evaluate import evaluate
    from tests.helpers import composed

    for overrides, named in (
        ([], "ckpt"),
        (["ckpt=auto"], "ckpt=auto needs ckpt_dir"),
        (["ckpt=auto", f"ckpt_dir={tmp_path}"], "no checkpoint in"),
        ([f"ckpt={tmp_path / 'none.ckpt'}"], "no checkpoint file"),
        (["ckpt=x", "stages=[fit]"], "stages"),
    ):
        with (
            composed(overrides, tmp_path, config_name="evaluate") as cfg,
            pytest.raises(ConfigError, match=named),
        ):
            evaluate(cfg)


@pytest.mark.cli
@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_evaluate_auto_takes_the_newest_checkpoint_that_verifies_on_two_processes(tmp_path):
    import json

    from tests.helpers import run_cli

    checkpoints = tmp_path / "train_run" / "checkpoints"
    good = _save(checkpoints / "step5.ckpt", 5, seed=1).eval()
    _save(checkpoints / "step9.ckpt", 9, seed=2)
    corrupt = bytearray((checkpoints / "step9.ckpt").read_bytes())
    corrupt[len(corrupt) // 2] ^= 0xFF
    (checkpoints / "step9.ckpt").write_bytes(bytes(corrupt))
    data = SyntheticDataModule(image_size=8, train_size=64, val_size=33)
    data.setup()
    x, y = map(torch.stack, zip(*[(img, torch.tensor(label)) for img, label in data.val_set]))
    with torch.no_grad():
        predicted = good(x).argmax(1)
    proc = run_cli(
        ["ckpt=auto", "ckpt_dir=train_run", "stages=[validate]", "hydra.run.dir=eval", "data.image_size=8",
         "data.train_size=64", "data.val_size=33", "data.batch_size=8", "trainer.enable_progress_bar=false"],
        cwd=tmp_path, timeout=170, module="lightning_solo.app.evaluate",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    assert report["world_size"] == 2 and report["checkpoint"].endswith("step5.ckpt")
    assert "passed over step9.ckpt" in report["decisions"][0]["reason"]
    assert report["metrics"]["val/samples"] == 33
    assert round(report["metrics"]["val/acc"] * 33) == int((predicted == y).sum())
    indices, classes = _read(tmp_path / "eval" / "predictions_val.csv")
    assert indices == list(range(33)) and classes == predicted.tolist()


def test_a_run_directory_gives_the_model_and_data_it_trained(tmp_path):
    from omegaconf import OmegaConf

    from lightning_solo.app.config_check import check_config
    from lightning_solo.app.evaluate import find_run_dir, with_run_config
    from tests.helpers import composed

    run = tmp_path / "outputs" / "train" / "run"
    (run / ".hydra").mkdir(parents=True)
    with composed(["data.batch_size=16"], tmp_path) as trained:  # the default job: small_cnn on digits
        saved = OmegaConf.to_yaml({k: trained[k] for k in trained if k != "hydra"})  # as Hydra writes it
    (run / ".hydra" / "config.yaml").write_text(saved)
    assert find_run_dir("auto", str(run)) == run == find_run_dir("auto", str(run / "checkpoints"))
    assert find_run_dir(str(run / "checkpoints" / "last.ckpt"), None) == run
    assert find_run_dir("auto", str(tmp_path / "outputs")) is None

    overrides = ["ckpt=auto", f"ckpt_dir={run}", "data.num_workers=1"]
    with composed(overrides, tmp_path, config_name="evaluate") as cfg:  # evaluate.yaml: resnet18, synthetic
        cfg, decision = with_run_config(cfg, run, overrides)
        check_config(cfg)
        assert (cfg.model.arch, cfg.model.in_channels, cfg.model.num_classes) == ("small_cnn", 1, 10)
        assert cfg.data._target_.endswith("DigitsDataModule")
        assert (cfg.data.batch_size, cfg.data.num_workers) == (
            16,
            1,
        )  # the run's, then this command's override
        assert decision.value["from_run"] == ["model", "data"]
    overrides = ["ckpt=auto", f"ckpt_dir={run}", "model=resnet18"]
    with composed(overrides, tmp_path, config_name="evaluate") as cfg:  # a group chosen here stays chosen
        cfg, decision = with_run_config(cfg, run, overrides)
        assert cfg.model.arch == "resnet18" and cfg.data._target_.endswith("DigitsDataModule")
        assert decision.value["from_run"] == ["data"] and "model chosen by this command" in decision.reason


class _UnequalCounts(L.LightningModule):
    """Rank r logs the value r once, over r + 1 samples: the epoch mean over all samples is 2/3."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            rank = self.global_rank
            self.log("v", torch.tensor(float(rank)), batch_size=rank + 1, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("exact_eval", "expected"), [(True, 2 / 3), (False, 1.0)])
def test_sync_dist_epoch_means_count_every_sample_exactly(tmp_path, exact_eval, expected):
    # Stock (and exact_eval=False) averages the ranks' integer sample counts (1 and 2) with truncation: 1, not 1.5.
    data = DataLoader(TensorDataset(torch.ones(8, 1)), batch_size=2)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=SoloDDP(start_method="fork", exact_eval=exact_eval),
        max_epochs=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(_UnequalCounts(), data, data)
    assert float(trainer.callback_metrics["v"]) == pytest.approx(expected)
