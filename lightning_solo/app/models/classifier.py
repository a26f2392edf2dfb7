"""ImageClassifier: any torchvision classification model (or this package's ``small_cnn``) as a LightningModule.
See docs/runner.md."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import lightning as L
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override

from lightning_solo.app.models.small_cnn import SmallCNN
from lightning_solo.ddp.eval import eval_rows

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[..., Any]


#: Networks of this package, built by name like torchvision's (no stem, no pretrained weights).
LOCAL_ARCHS = {"small_cnn": SmallCNN}


def build_backbone(
    arch: str,
    num_classes: int,
    stem: Literal["imagenet", "cifar"] = "imagenet",
    weights: str | None = None,
    in_channels: int = 3,
) -> nn.Module:
    """``torchvision.models.get_model(arch)``, or a network of :data:`LOCAL_ARCHS`; ``stem="cifar"`` swaps a ResNet's
    7×7/stride-2 stem and max-pool for a 3×3/stride-1 conv (32×32 images), as ``in_channels`` other than 3 needs."""
    if arch in LOCAL_ARCHS:
        if weights is not None:
            raise ValueError(f"{arch!r} has no pretrained weights; use weights=null")
        return LOCAL_ARCHS[arch](num_classes=num_classes, in_channels=in_channels)
    available = torchvision.models.list_models(module=torchvision.models)
    if arch not in available:
        raise ValueError(
            f"unknown model {arch!r}; {', '.join(LOCAL_ARCHS)} or a torchvision classification model: "
            f"{', '.join(available)}"
        )
    if in_channels != 3 and stem != "cifar":
        raise ValueError(f"in_channels={in_channels} needs stem='cifar' for {arch!r} (torchvision's stem is RGB)")
    if stem not in ("imagenet", "cifar"):
        raise ValueError(f"stem must be 'imagenet' or 'cifar', got {stem!r}")
    if weights is not None:  # pretrained heads have 1000 classes; replace the head after loading
        net = torchvision.models.get_model(arch, weights=weights)
        _replace_head(net, num_classes)
    else:
        net = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    if stem == "cifar":
        if not (hasattr(net, "conv1") and hasattr(net, "maxpool")):
            raise ValueError(f"stem='cifar' is defined for ResNet-style models (conv1 + maxpool); {arch!r} has none")
        net.conv1 = nn.Conv2d(in_channels, net.conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    return net


def _replace_head(net: nn.Module, num_classes: int) -> None:
    for name in ("fc", "head", "heads", "classifier"):
        head = getattr(net, name, None)
        if isinstance(head, nn.Linear):
            setattr(net, name, nn.Linear(head.in_features, num_classes))
            return
        if isinstance(head, nn.Sequential) and isinstance(head[-1], nn.Linear):
            head[-1] = nn.Linear(head[-1].in_features, num_classes)
            return
    raise ValueError("cannot find a linear classification head to resize; use weights=null")


class ImageClassifier(L.LightningModule):
    """Cross-entropy classifier over ``build_backbone(arch, ...)``: logs ``train/loss`` and ``val/`` / ``test/``
    ``loss``, ``acc``, ``samples`` (each sample once, all ranks); eval steps return each row's predicted class."""

    def __init__(
        self,
        arch: str = "resnet18",
        num_classes: int = 10,
        stem: Literal["imagenet", "cifar"] = "cifar",
        weights: str | None = None,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        scheduler_interval: Literal["step", "epoch"] = "epoch",
        channels_last: bool = False,
        label_smoothing: float = 0.0,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.model = build_backbone(arch, num_classes, stem, weights, in_channels)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.optimizer_factory = optimizer or partial(torch.optim.SGD, lr=0.1, momentum=0.9)
        self.scheduler_factory = scheduler
        if scheduler_interval not in ("step", "epoch"):
            raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {scheduler_interval!r}")
        self.scheduler_interval = scheduler_interval
        self.channels_last = channels_last
        self.label_smoothing = label_smoothing
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return self.model(x)

    @override
    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y, label_smoothing=self.label_smoothing)
        self.log("train/loss", loss)  # not prog_bar=True, a host sync per batch: app/progress_bar.py shows it
        return loss

    def _evaluate(self, stage: str, metric: MulticlassAccuracy, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        predictions = logits.argmax(dim=-1)
        rows = eval_rows(self.trainer, batch_idx)
        if rows is not None and rows.padded:  # the mask is on the CPU: no device sync without padding
            keep = rows.valid.to(logits.device)
            logits, y = logits[keep], y[keep]
        count = len(y)
        # A mean over the real rows weighted by their number: Lightning's sync_dist epoch mean is then exact.
        loss = F.cross_entropy(logits, y, reduction="sum") / max(count, 1)
        self.log(f"{stage}/loss", loss, sync_dist=True, batch_size=count)
        self.log(f"{stage}/samples", float(count), reduce_fx="sum", sync_dist=True, batch_size=1)
        if count:  # a batch of padding only (fewer samples than ranks): nothing to count
            metric.update(logits, y)
        self.log(f"{stage}/acc", metric, prog_bar=stage == "val")
        return predictions

    @override
    def validation_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._evaluate("val", self.val_acc, batch, batch_idx)

    @override
    def test_step(self, batch, batch_idx: int) -> torch.Tensor:
        return self._evaluate("test", self.test_acc, batch, batch_idx)

    @override
    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (list, tuple)) else batch
        return self(x).argmax(dim=-1)

    @override
    def configure_optimizers(self):
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler_interval}}
