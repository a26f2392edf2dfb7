"""Datamodules: digits and the synthetic set are deterministic (digits held out, synthetic learnable); missing
real data fails with directions."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from lightning_solo.app.data import (
    CIFAR10DataModule,
    DigitsDataModule,
    ImageFolderDataModule,
    SyntheticDataModule,
    SyntheticImages,
)
from lightning_solo.app.data.digits import load_digits, stratified_split
from lightning_solo.app.models import SmallCNN, build_backbone


def test_synthetic_items_are_a_pure_function_of_seed_and_index():
    a, b = SyntheticImages(64, seed=3), SyntheticImages(64, seed=3)
    x0, y0 = a[5]
    assert torch.equal(x0, b[5][0]) and y0 == b[5][1]
    assert not torch.equal(a[5][0], a[6][0])
    assert x0.shape == (3, 32, 32)
    assert SyntheticImages(8, image_size=12, channels=1)[0][0].shape == (1, 12, 12)
    with pytest.raises(IndexError):
        a[64]


def test_synthetic_labels_follow_the_class_templates():
    # Learnable, not random labels: matching each image to the closest class template classifies it;
    # the same matching against shuffled labels is at chance.
    data = SyntheticImages(512, noise=1.5, seed=0)
    images = torch.stack([data[i][0] for i in range(len(data))]).flatten(1)
    labels = torch.tensor([data[i][1] for i in range(len(data))])
    templates = data.templates.flatten(1)
    scores = torch.nn.functional.normalize(images, dim=1) @ torch.nn.functional.normalize(templates, dim=1).T
    accuracy = (scores.argmax(1) == labels).float().mean().item()
    shuffled = (
        (scores.argmax(1) == labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))])
        .float()
        .mean()
        .item()
    )
    assert accuracy > 0.9 and shuffled < 0.3
    assert len(set(labels.tolist())) == 10


def test_train_and_val_splits_differ_and_batch_size_is_per_device():
    dm = SyntheticDataModule(train_size=32, val_size=16, batch_size=8)
    dm.setup("fit")
    assert not torch.equal(dm.train_set[0][0], dm.val_set[0][0])
    assert dm.train_dataloader().batch_size == 8
    with pytest.raises(ValueError, match="batch_size"):
        SyntheticDataModule(batch_size=0)


def test_missing_cifar_says_where_it_looked_and_how_to_get_it(tmp_path):
    dm = CIFAR10DataModule(root=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError) as err:
        dm.setup("fit")
    assert str(tmp_path / "nowhere") in str(err.value) and "download=true" in str(err.value)


def test_image_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="train"):
        ImageFolderDataModule(root=str(tmp_path))
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            Image.new("RGB", (20, 20), color=(10, 200, 30)).save(tmp_path / split / cls / "a.png")
    dm = ImageFolderDataModule(root=str(tmp_path), image_size=16, batch_size=2)
    assert dm.num_classes == 2
    dm.setup("fit")
    x, _y = next(iter(dm.train_dataloader()))
    assert x.shape == (2, 3, 16, 16)
    with pytest.raises(ValueError, match="num_classes=3"):
        ImageFolderDataModule(root=str(tmp_path), num_classes=3)


def test_digits_split_is_fixed_held_out_and_stratified():
    a, b = DigitsDataModule(), DigitsDataModule(split_seed=0, batch_size=8)
    a.setup("fit")
    b.setup("fit")
    (xa, _), (va, vya) = a.train_set.tensors, a.val_set.tensors
    assert xa.shape == (1437, 1, 8, 8) and va.shape == (360, 1, 8, 8) and xa.dtype == torch.float32
    assert torch.equal(xa, b.train_set.tensors[0]) and torch.equal(vya, b.val_set.tensors[1])  # deterministic
    train_rows = {tuple(r) for r in xa.flatten(1).tolist()}
    assert sum(tuple(r) in train_rows for r in va.flatten(1).tolist()) <= 2  # held out (digits has 1 duplicate)
    assert torch.bincount(vya, minlength=10).min() >= 35  # every class in the val split (stratified)
    assert abs(xa.mean().item()) < 0.1 and abs(xa.std().item() - 1) < 0.1
    other = DigitsDataModule(split_seed=1)
    other.setup("fit")
    assert not torch.equal(other.val_set.tensors[1], vya)
    with pytest.raises(ValueError, match="val_fraction"):
        DigitsDataModule(val_fraction=1.0)


def test_the_shipped_digits_are_the_1797_images_of_ten_classes():
    pixels, labels = load_digits()
    assert pixels.shape == (1797, 64) and pixels.dtype == torch.float32 and labels.dtype == torch.long
    assert (pixels.min().item(), pixels.max().item()) == (0.0, 16.0) and torch.equal(pixels, pixels.round())
    assert torch.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


@pytest.mark.parametrize(
    ("counts", "fraction", "held_out"),
    [
        ([5, 5], 0.2, [1, 1]),
        ([3, 7], 0.5, [2, 3]),  # quotas 1.5 and 3.5: the tie goes to the first class
        ([1, 1, 1], 0.5, [1, 1, 0]),  # ceil(1.5) = 2 held out
        ([10], 0.01, [1]),  # at least one
        ([178, 182, 177, 183, 181, 182, 181, 179, 174, 180], 0.2, [36, 37, 35, 37, 36, 36, 36, 36, 35, 36]),
    ],
)
def test_stratified_split_holds_out_each_class_in_proportion(counts, fraction, held_out):
    labels = torch.cat([torch.full((n,), c) for c, n in enumerate(counts)])
    labels = labels[torch.randperm(len(labels), generator=torch.Generator().manual_seed(7))]
    train, val = stratified_split(labels, fraction, seed=0)
    assert torch.bincount(labels[val], minlength=len(counts)).tolist() == held_out
    assert torch.equal(torch.cat([train, val]).sort().values, torch.arange(len(labels)))  # disjoint, complete
    assert torch.equal(val, val.sort().values) and torch.equal(train, train.sort().values)
    again = stratified_split(labels, fraction, seed=0)
    assert torch.equal(again[0], train) and torch.equal(again[1], val)  # the seed alone fixes it
    if min(counts) > max(held_out) > 0:
        assert not torch.equal(stratified_split(labels, fraction, seed=1)[1], val)


def test_small_cnn_is_built_by_name_for_grey_8x8_images():
    net = build_backbone("small_cnn", num_classes=10, in_channels=1)
    assert isinstance(net, SmallCNN) and net(torch.randn(4, 1, 8, 8)).shape == (4, 10)
    with pytest.raises(ValueError, match="pretrained"):
        build_backbone("small_cnn", 10, weights="IMAGENET1K_V1")
    with pytest.raises(ValueError, match="in_channels=1 needs stem='cifar'"):
        build_backbone("resnet18", 10, stem="imagenet", in_channels=1)
