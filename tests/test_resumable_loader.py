"""The seeded training dataset: a sample's random augmentation is a function of (seed, epoch, index) alone,
whatever batch it is fetched in, and the caller's RNGs are left as they were."""

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, random_split

from lightning_solo.resumable_loader import SeededDataset, make_resumable


class Draws(Dataset):
    """Each sample draws from the torch, Python and numpy RNGs, as augmentation pipelines do."""

    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, torch.rand(()).item(), random.random(), np.random.uniform()])


def test_a_sample_is_the_same_in_any_batch_and_the_callers_rngs_do_not_move():
    seeded = SeededDataset(Draws(), seed=7)
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    before = (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state(legacy=False)["state"]["key"].copy(),
    )
    alone = [seeded[(2, i)] for i in range(6)]
    batched = seeded.__getitems__([(2, i) for i in (5, 3, 1, 0, 2, 4)])
    assert all(torch.equal(batched[pos], alone[i]) for pos, i in enumerate((5, 3, 1, 0, 2, 4)))
    assert not torch.equal(seeded[(3, 0)], alone[0])  # the epoch is part of the seed
    assert len({tuple(s[1:].tolist()) for s in alone}) == 6  # and so is the index
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert np.array_equal(np.random.get_state(legacy=False)["state"]["key"], before[2])


def test_a_random_split_subset_loads_through_the_resumable_loader():
    """``Subset`` (what ``random_split`` returns) has a ``__getitems__`` of its own; the fetcher must not be
    handed it with (epoch, index) keys."""
    train, _ = random_split(Draws(), [16, 4], generator=torch.Generator().manual_seed(0))
    loader, decision = make_resumable(DataLoader(train, batch_size=4, shuffle=False), seed=1)
    assert decision.value is True
    ids = torch.cat([batch[:, 0] for batch in loader]).long().tolist()
    assert ids == [train.indices[i] for i in range(16)]
