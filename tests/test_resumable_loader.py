"""The resumable training loader, without a Trainer: the user's dataset stays the user's (its items, its class,
its attributes, its batched ``__getitems__``), a sample's random augmentation is a function of (seed, epoch,
index) alone whatever batch it is fetched in, the caller's RNGs are left as they were, and a sampler that draws
its order from the RNG (``WeightedRandomSampler``, also inside Lightning's wrapper) draws the same order again on
resume."""

import copy
import pickle
import random

import numpy as np
import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    WeightedRandomSampler,
    random_split,
)

from lightning_solo.ddp.resume.loader import SeededDataset, make_resumable

Key = SeededDataset.Key


class Draws(Dataset):
    """Each sample draws from the torch, Python and numpy RNGs, as augmentation pipelines do."""

    classes = ("even", "odd")

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, torch.rand(()).item(), random.random(), np.random.uniform()])


def _rng_fingerprint() -> tuple:
    return (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state(legacy=False)["state"]["key"].copy(),
    )


def _same_rngs(before: tuple) -> bool:
    now = _rng_fingerprint()
    return torch.equal(now[0], before[0]) and now[1] == before[1] and np.array_equal(now[2], before[2])


def test_a_sample_is_the_same_in_any_batch_and_the_callers_rngs_do_not_move():
    seeded = SeededDataset(Draws(), seed=7)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    before = _rng_fingerprint()
    alone = [seeded[Key(2, i)] for i in range(6)]
    batched = seeded.__getitems__([Key(2, i) for i in (5, 3, 1, 0, 2, 4)])
    assert all(torch.equal(batched[pos], alone[i]) for pos, i in enumerate((5, 3, 1, 0, 2, 4)))
    assert not torch.equal(seeded[Key(3, 0)], alone[0])  # the epoch is part of the seed
    assert len({tuple(s[1:].tolist()) for s in alone}) == 6  # and so is the index
    assert _same_rngs(before)


def test_a_random_split_subset_loads_through_the_resumable_loader():
    """``Subset`` (what ``random_split`` returns) has a ``__getitems__`` of its own: it gets plain indices."""
    train, _ = random_split(Draws(), [16, 4], generator=torch.Generator().manual_seed(0))
    loader, decision = make_resumable(DataLoader(train, batch_size=4, shuffle=False), seed=1)
    assert decision.value is True
    ids = torch.cat([batch[:, 0] for batch in loader]).long().tolist()
    assert ids == [train.indices[i] for i in range(16)]
    assert isinstance(loader.dataset, torch.utils.data.Subset) and loader.dataset.indices == train.indices


def test_the_wrapped_dataset_is_the_users_from_the_users_side():
    """What a sample-preview callback does with ``trainer.train_dataloader.dataset``: index it, check its class,
    read its attributes; and what the DataLoader machinery does with it: pickle it (spawned workers), copy it."""
    user = Draws()
    loader, _ = make_resumable(DataLoader(user, batch_size=4, shuffle=True), seed=3)
    dataset = loader.dataset
    assert type(dataset) is SeededDataset and dataset.dataset is user
    assert isinstance(dataset, Draws) and not isinstance(dataset, IterableDataset)
    assert dataset.classes == ("even", "odd") and len(dataset) == 20
    torch.manual_seed(5)
    mine = user[3]
    torch.manual_seed(5)
    assert torch.equal(dataset[3][:2], mine[:2])  # the user's own item, drawn from the user's RNG as before
    for clone in (pickle.loads(pickle.dumps(dataset)), copy.deepcopy(dataset), copy.copy(dataset)):
        assert type(clone) is SeededDataset and isinstance(clone, Draws) and clone.seed == 3
        assert torch.equal(clone[Key(1, 4)], dataset[Key(1, 4)])


class TupleIndexed(Dataset):
    """A dataset indexed by (row, column) pairs: a user's tuple is never taken for the sampler's key."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index):
        row, col = index if isinstance(index, tuple) else (index, 0)
        return torch.tensor([row * 10 + col])


def test_a_users_tuple_index_reaches_the_users_dataset():
    dataset = SeededDataset(TupleIndexed(), seed=0)
    assert dataset[(2, 1)].item() == 21 and dataset.__getitems__([(1, 1), (3, 0)])[0].item() == 11


class BatchFetched(Dataset):
    """Fetches a whole batch per call, as Hugging Face datasets do: ``__getitems__`` and ``__len__`` only; the
    batch draws one random number (batched augmentation), and every call's indices are kept."""

    def __init__(self) -> None:
        self.calls: list = []

    def __len__(self) -> int:
        return 24

    def __getitems__(self, indices):
        self.calls.append(indices)
        noise = torch.rand(())
        return [torch.tensor([float(i), noise.item()]) for i in indices]


def test_a_getitems_only_dataset_keeps_its_batched_fetching_with_plain_indices():
    user = BatchFetched()
    shuffled = DistributedSampler(user, num_replicas=1, rank=0, shuffle=True)  # (RandomSampler: global RNG)
    loader, decision = make_resumable(DataLoader(user, batch_size=4, sampler=shuffled), seed=5)
    assert decision.value is True
    loader.sampler.set_epoch(1)
    first = list(loader)
    assert all(type(c) is list and len(c) == 4 and all(type(i) is int for i in c) for c in user.calls)
    assert len(user.calls) == 6  # one call per batch
    assert sorted(torch.cat(first)[:, 0].long().tolist()) == list(range(24))
    before = _rng_fingerprint()
    loader.dataset.__getitems__([Key(1, i) for i in range(4)])  # the batch's draws leave the caller's RNG
    assert _same_rngs(before)
    again = list(loader)  # the same epoch again: the same order and the same batch draws
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    loader.sampler.set_epoch(2)
    other = list(loader)
    assert not torch.equal(torch.cat(first)[:, 1], torch.cat(other)[:, 1])
    # And the user's own call, from the user's side, is the user's: plain indices, the user's RNG.
    expected = torch.manual_seed(9) and torch.rand(()).item()
    torch.manual_seed(9)
    user.calls.clear()
    (sample,) = loader.dataset.__getitems__([7])
    assert user.calls == [[7]] and sample[1].item() == expected


class Curriculum(Sampler):
    """A custom sampler that draws its order from the global RNG."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())

    def __len__(self) -> int:
        return self.n


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "lightning_wrapper"])
@pytest.mark.parametrize("kind", ["weighted", "random", "random_with_generator"])
def test_a_sampler_that_draws_its_order_resumes_it_exactly(kind, wrap):
    """``WeightedRandomSampler`` (Lightning wraps it in a ``DistributedSamplerWrapper`` under DDP) and
    ``RandomSampler`` draw their order when the epoch starts: the sampler records the RNG states it started
    from, and a resume draws the same order again, leaving the caller's RNG alone."""
    data = Draws()

    def build():
        if kind == "weighted":
            sampler = WeightedRandomSampler(torch.linspace(0.1, 1.0, 20).double(), num_samples=20)
        else:
            generator = torch.Generator().manual_seed(4) if kind == "random_with_generator" else None
            sampler = RandomSampler(data, generator=generator)
        return DistributedSamplerWrapper(sampler, num_replicas=2, rank=1, shuffle=False) if wrap else sampler

    loader, decision = make_resumable(DataLoader(data, batch_size=2, sampler=build()), seed=0)
    assert decision.value is True and "draws its order" in decision.reason, decision
    sampler = loader.sampler
    torch.manual_seed(1)
    list(sampler)  # epoch 0 moves the RNG (and the sampler's own generator)
    sampler.set_epoch(1)
    order = list(sampler)
    recorded = sampler.epoch_rng
    fresh = make_resumable(DataLoader(data, batch_size=2, sampler=build()), seed=0)[0].sampler
    torch.manual_seed(123)
    before = _rng_fingerprint()
    fresh.resume_once(1, 4, recorded)
    assert list(fresh) == order[4:]
    assert _same_rngs(before)


def test_a_custom_random_sampler_is_not_reported_exact():
    data = Draws()
    for sampler in (Curriculum(20), DistributedSamplerWrapper(Curriculum(20), num_replicas=2, rank=0)):
        _, decision = make_resumable(DataLoader(data, batch_size=2, sampler=sampler), seed=0)
        assert decision.value == "approximate" and "Curriculum" in decision.reason, decision


class Indexed(Dataset):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> int:
        return i


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "lightning_wrapper"])
def test_a_run_that_never_resumes_draws_the_order_stock_draws(wrap):
    """The wrap does not move the sampler's draws in the RNG stream: from the same state, two epochs of a
    ``WeightedRandomSampler`` loader give the order the unwrapped loader gives, and leave the RNG where it does."""

    def build() -> DataLoader:
        sampler = WeightedRandomSampler(torch.linspace(0.1, 1.0, 20).double(), num_samples=20)
        if wrap:
            sampler = DistributedSamplerWrapper(sampler, num_replicas=2, rank=0, shuffle=False)
        return DataLoader(Indexed(), batch_size=4, sampler=sampler)

    def two_epochs(loader: DataLoader) -> tuple[list, tuple]:
        torch.manual_seed(3), random.seed(3), np.random.seed(3)
        order = []
        for epoch in (0, 1):
            loader.sampler.set_epoch(epoch) if hasattr(loader.sampler, "set_epoch") else None
            order += [batch.tolist() for batch in loader]
        return order, _rng_fingerprint()

    stock, stock_rng = two_epochs(build())
    ours, our_rng = two_epochs(make_resumable(build(), seed=0)[0])
    assert ours == stock and _same_rngs(stock_rng) == _same_rngs(our_rng) and torch.equal(our_rng[0], stock_rng[0])
