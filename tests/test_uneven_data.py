"""Uneven data cannot hang (:mod:`lightning_solo.ddp.uneven`): two gloo ranks whose ``IterableDataset`` shards differ
by about 30 % (training and validation) end every epoch and every validation at the first rank's end, and train
exactly as a run whose shards were cut to the shortest; a ``__len__`` that overstates ends the same way;
``uneven_data=False`` is stock, which fails on the same data."""

from __future__ import annotations

import json
from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_solo import SoloDDP
from lightning_solo._compat.patch import Patches
from lightning_solo.ddp.agreed_end import AgreedEnd
from lightning_solo.ddp.uneven import _agree_length, check_policy

BATCH = 4
TRAIN = (10, 13)  # training batches per epoch, rank 0 and rank 1
VAL = (4, 6)  # validation batches
MOST = 16


class Shard(IterableDataset):
    """``batches * BATCH`` samples of rank ``rank``'s own regression data; ``length``: what ``__len__`` claims."""

    def __init__(self, rank: int, batches: int, seed: int, length: int | None = None):
        self.rank, self.batches, self.seed, self.length = rank, batches, seed, length

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.rank)
        x, y = torch.randn(MOST * BATCH, 8, generator=g), torch.randn(MOST * BATCH, 1, generator=g)
        # A cut shard has the same first samples. Worker w of n loads batches w, w + n, ...: the loader's
        # round-robin over its workers gives the batches in order.
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        for b in range(w, self.batches, n):
            yield from zip(x[b * BATCH : (b + 1) * BATCH], y[b * BATCH : (b + 1) * BATCH])


class LyingShard(Shard):
    def __len__(self) -> int:
        return self.length


class Net(L.LightningModule):
    def __init__(self, out, train=TRAIN, val=VAL, lie: int | None = None, workers: int = 0):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.out, self.train_batches, self.val_batches, self.lie = str(out), train, val, lie
        self.workers = workers
        self.seen: dict[str, list[int]] = {"train": [], "val": [], "predict": []}

    def _loader(self, batches, seed):
        rank = self.trainer.global_rank
        cls = LyingShard if self.lie else Shard
        workers = dict(num_workers=self.workers, persistent_workers=True) if self.workers else {}
        return DataLoader(cls(rank, batches[rank], seed, self.lie), batch_size=BATCH, **workers)

    def train_dataloader(self):
        return self._loader(self.train_batches, 100)

    def val_dataloader(self):
        return self._loader(self.val_batches, 200)

    def on_train_epoch_start(self):
        self.seen["train"].append(0)

    def training_step(self, batch, batch_idx):
        self.seen["train"][-1] += 1
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def on_validation_epoch_start(self):
        self.seen["val"].append(0)

    def validation_step(self, batch, batch_idx):
        self.seen["val"][-1] += 1
        x, y = batch
        # A collective at every validation batch: on uneven data, one without a partner.
        self.log("val_loss", F.mse_loss(self.layer(x), y), on_step=True, sync_dist=True)

    def predict_dataloader(self):
        return self._loader(self.val_batches, 300)

    def on_predict_epoch_start(self):
        self.seen["predict"].append(0)

    def predict_step(self, batch, batch_idx):
        self.seen["predict"][-1] += 1
        return self.all_gather(self.layer(batch[0]))  # a collective at every batch, as in a gathering predict

    def on_predict_end(self):
        self.on_fit_end()

    def on_validation_end(self):
        if not self.trainer.training and not self.trainer.sanity_checking:  # trainer.validate
            self.on_fit_end()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def on_fit_end(self):
        decision = self.trainer.strategy.decisions.get("uneven_data")
        found = None  # what a callback reading trainer.train_dataloader finds: the loader, its dataset, its length
        if isinstance(loader := self.trainer.train_dataloader, DataLoader):
            found = [type(loader).__name__, type(loader.dataset).__name__, self.trainer.num_training_batches]
        record = {
            "seen": self.seen,
            "train_loader": found,
            "params": [p.detach().flatten().tolist() for p in self.parameters()],
            "decision": decision.as_dict() if decision else None,
        }
        with open(f"{self.out}/rank{self.trainer.global_rank}.json", "w") as f:
            json.dump(record, f, default=str)


def fit(out, strategy, net=None, trainer=None, **options) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    t = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=out, **(trainer or {}),
    )  # fmt: skip
    t.fit((net or Net)(out, **options))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def assert_same_weights(a: dict, b: dict) -> None:
    for p, q in zip(a["params"], b["params"]):
        torch.testing.assert_close(torch.tensor(p), torch.tensor(q), rtol=1e-6, atol=1e-7)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_uneven_iterable_shards_end_together_and_train_as_the_shortest(tmp_path, workers):
    # Stock: rank 0 leaves its epoch after 10 batches, its next collectives pair with rank 1's batches 10-12, and
    # rank 1 waits for a partner (test_uneven_data_off_is_stock_and_fails). With 2 persistent workers the
    # loaders' iterators are kept and reset each epoch; and the agreement runs without the SIGTERM one.
    options = {"sigterm_agreement": False} if workers else {}
    uneven = fit(tmp_path / "uneven", SoloDDP(start_method="fork", **options), workers=workers)
    cut = fit(tmp_path / "cut", SoloDDP(start_method="fork", uneven_data=False), train=(10, 10), val=(4, 4))
    for rank in uneven:
        # Two sanity batches, then every validation ends at the shortest (4), every epoch at 10.
        assert rank["seen"] == {"train": [10, 10], "val": [2, 4, 4], "predict": []}, rank["seen"]
        assert rank["decision"]["value"] == "shortest", rank["decision"]
    assert cut[0]["decision"]["value"] is False
    assert_same_weights(uneven[0], uneven[1])
    assert_same_weights(uneven[0], cut[0])


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_len_that_overstates_ends_with_the_data(tmp_path):
    # __len__ says 40 batches on both ranks; the data has 10 and 13 (validation 4 and 6).
    lying = fit(tmp_path / "lying", SoloDDP(start_method="fork"), lie=40 * BATCH)
    cut = fit(tmp_path / "cut", SoloDDP(start_method="fork", uneven_data=False), train=(10, 10), val=(4, 4))
    for rank in lying:
        # No epoch-end validation, as on one process: Lightning waits for the 40th batch to validate.
        assert rank["seen"] == {"train": [10, 10], "val": [2], "predict": []}, rank["seen"]
    assert_same_weights(lying[0], lying[1])
    assert_same_weights(lying[0], cut[0])


class TwoLoaders(Net):
    """Two training loaders (Lightning's max_size_cycle): the uneven one and a short one that cycles (5 and 3)."""

    def train_dataloader(self):
        return [self._loader(self.train_batches, 100), self._loader((5, 3), 400)]

    def training_step(self, batch, batch_idx):
        self.seen["train"][-1] += 1
        (x, y), (x2, y2) = batch
        return F.mse_loss(self.layer(x), y) + F.mse_loss(self.layer(x2), y2)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("net", "trainer", "seen"),
    [
        (Net, {"limit_train_batches": 7}, {"train": [7, 7], "val": [2, 4, 4]}),
        (Net, {"val_check_interval": 3, "check_val_every_n_epoch": None, "max_epochs": 1},
         {"train": [10], "val": [2, 4, 4, 4]}),
        (TwoLoaders, {}, {"train": [10, 10], "val": [2, 4, 4]}),
    ],
    ids=["limit_train_batches", "val_check_interval", "two_training_loaders"],
)  # fmt: skip
def test_lightning_limits_and_schedules_keep_the_ranks_together(tmp_path, net, trainer, seen):
    # A limit stops reading before the agreed end, on every rank alike; validations inside the epoch end at the
    # shortest; a second loader's own end (and its cycling) is agreed apart from the first's.
    t = L.Trainer(accelerator="cpu", devices=2, strategy=SoloDDP(start_method="fork"), logger=False,
                  enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                  default_root_dir=tmp_path, **{"max_epochs": 2, **trainer})  # fmt: skip
    t.fit(net(tmp_path))
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for record in records:
        assert record["seen"] == {**seen, "predict": []}, record["seen"]
    assert_same_weights(records[0], records[1])


class MapStyle(Net):
    """Map-style training data without Lightning's sampler: rank 0 has 10 batches, rank 1 13."""

    def train_dataloader(self):
        shard = list(Shard(self.trainer.global_rank, self.train_batches[self.trainer.global_rank], 100))
        return DataLoader(shard, batch_size=BATCH)


class DifferentLen(Net):
    """An IterableDataset whose ``__len__`` is true on each rank, and differs (10 and 13 batches)."""

    def _loader(self, batches, seed):
        rank = self.trainer.global_rank
        return DataLoader(LyingShard(rank, batches[rank], seed, batches[rank] * BATCH), batch_size=BATCH)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.parametrize("net", [MapStyle, DifferentLen])
def test_lengths_lightning_would_part_are_agreed_at_the_shortest(tmp_path, net):
    # Lightning schedules each rank's epoch end and validation by its own len(): the rank with 10 batches would
    # validate after its 10th while the other goes on (stock: "Connection closed by peer"). Every rank's loader
    # reports the shortest length instead, and the run trains as one whose data was cut to the shortest.
    no_sampler = {"use_distributed_sampler": False}  # each rank's own shard, as a user's own sampler gives it
    uneven = fit(tmp_path / "uneven", SoloDDP(start_method="fork"), net, no_sampler)
    cut = fit(tmp_path / "cut", SoloDDP(start_method="fork", uneven_data=False), net, no_sampler,
              train=(10, 10), val=(4, 4))  # fmt: skip
    for rank in uneven:
        assert rank["seen"] == {"train": [10, 10], "val": [2, 4, 4], "predict": []}, rank["seen"]
        # The loader a callback finds is the one the even run has, its length agreed.
        assert rank["train_loader"] == cut[0]["train_loader"]
        assert rank["train_loader"][::2] == ["DataLoader", 10]
    assert_same_weights(uneven[0], uneven[1])
    assert_same_weights(uneven[0], cut[0])


def test_an_agreed_length_is_the_loaders_own_again_after_the_run():
    class Loader(DataLoader):
        """A user's subclass."""

    loader = Loader(list(range(40)), batch_size=4)
    with Patches() as patches:
        _agree_length(loader, 7, patches)
        assert len(loader) == 7 and isinstance(loader, Loader) and type(loader).__name__ == "Loader"
        assert len(list(loader)) == 10, "the iterator is the loader's own: Lightning stops it at the agreed length"
        _agree_length(loader, 5, patches)  # agreed again
        assert len(loader) == 5 and type(loader).__base__ is Loader
    assert type(loader) is Loader and len(loader) == 10 and "_solo_agreed_len" not in vars(loader)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_batch_limit_within_every_rank_keeps_uneven_lengths(tmp_path):
    # Map-style training shards of 10 and 13 batches, each rank running 7, and their validation (4 and 6
    # batches of an IterableDataset) 3: the ranks stay together, as under stock; no error.
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=SoloDDP(start_method="fork"), max_epochs=1,
                        limit_train_batches=7, limit_val_batches=3, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, use_distributed_sampler=False)  # fmt: skip
    trainer.fit(MapStyle(tmp_path))
    for r in range(2):
        assert json.loads((tmp_path / f"rank{r}.json").read_text())["seen"] == {
            "train": [7],
            "val": [2, 3],
            "predict": [],
        }


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_validate_and_predict_end_at_the_shortest(tmp_path):
    # Validation 4 and 6 batches, predict too, each batch with a collective (sync_dist logging, all_gather).
    net = Net(tmp_path)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=SoloDDP(start_method="fork"), logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.validate(net)
    for r in range(2):
        record = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert record["seen"]["val"] == [4] and record["decision"]["value"] == "shortest", record
    trainer.predict(net)
    for r in range(2):
        assert json.loads((tmp_path / f"rank{r}.json").read_text())["seen"]["predict"] == [4]


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_uneven_data_off_is_stock_and_fails(tmp_path):
    # What SoloDDP(uneven_data=False) and stock DDP do on the same data: an error, not a result (a short collective
    # timeout bounds the wait where a collective has no partner).
    # Here rank 1's gradient all-reduce of its batch 10 waits for a partner rank 0 never sends.
    with pytest.raises(Exception, match=r"Timed out|Connection closed by peer"):
        fit(tmp_path, SoloDDP(start_method="fork", uneven_data=False, timeout=timedelta(seconds=5)))


def test_policy_switch():
    assert check_policy("shortest") == "shortest" and check_policy(False) is False
    for bad in ("join", True, None, 0):
        with pytest.raises(ValueError, match="uneven_data"):
            check_policy(bad)


def test_one_rank_iterator_ends_with_its_data():
    # No group: the agreement is the rank's own end; every item, in order, then the end.
    end = AgreedEnd(iter(range(5)), group=None)
    assert list(end) == [0, 1, 2, 3, 4]
    assert list(AgreedEnd(iter([]), group=None)) == []
