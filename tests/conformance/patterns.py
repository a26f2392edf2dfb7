"""The conformance corpus: ordinary Lightning code, written the way Lightning's docs and examples write it.

Each pattern is a function ``pattern(trainer)`` that builds a LightningModule and its data, fits it with
``trainer(**kwargs)`` (a ``Trainer`` on 2 CPU devices and the strategy under test) and returns the module, or
``(module, extras)`` where ``extras`` are results to compare between strategies (metrics, gathered rows...).
:mod:`tests.conformance.runner` runs each one under stock ``DDPStrategy`` and under ``SoloDDP()``.

``@pattern(...)`` says how the two runs are compared: ``weights=False`` compares outcome and replica identity
only (the reason is in ``why``); ``solo={...}`` names the SoloDDP options that turn off a documented default
which changes the computation, for the weight comparison (``SoloDDP()`` itself still has to run); ``stock={...}``
is what a user of stock DDP must set for the pattern to run at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    BaseFinetuning,
    BasePredictionWriter,
    Callback,
    EarlyStopping,
    EMAWeightAveraging,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.checkpoint import checkpoint
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    TensorDataset,
    WeightedRandomSampler,
)

DIM, CLASSES, VOCAB = 16, 4, 32
BACKEND = os.environ.get("CONFORMANCE_COMPILE_BACKEND", "aot_eager")


@dataclass(frozen=True)
class Pattern:
    run: Any  # pattern(trainer) -> module | (module, extras)
    weights: bool = True  # False: compare outcome and replicas only (why says why)
    solo: dict = field(default_factory=dict)  # SoloDDP options that turn a documented default off, for the weights
    stock: dict = field(default_factory=dict)  # what stock DDP needs for the pattern to run at all
    why: str = ""
    stock_replicas: bool = True  # False: stock DDP itself lets the replicas diverge (why says how)
    also: dict = field(default_factory=dict)  # one more SoloDDP run with these options: outcome and replicas only
    timeout: float = 60  # seconds for the pattern's runs, after which the pair of ranks is ended


PATTERNS: dict[str, Pattern] = {}


def pattern(name: str | None = None, **how: Any):
    def register(fn):
        PATTERNS[name or fn.__name__] = Pattern(fn, **how)
        return fn

    return register


# ---------------------------------------------------------------- data and a plain classifier


def tensors(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, DIM, generator=g), torch.randint(0, CLASSES, (n,), generator=g)


def loader(n: int = 64, batch_size: int = 4, shuffle: bool = True, seed: int = 0, **kwargs) -> DataLoader:
    return DataLoader(TensorDataset(*tensors(n, seed)), batch_size=batch_size, shuffle=shuffle, **kwargs)


def val_loader(n: int = 64, **kwargs) -> DataLoader:
    return loader(n, shuffle=False, seed=1, **kwargs)


def tokens(n: int = 64, length: int = 9) -> DataLoader:
    data = torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data), batch_size=4, shuffle=True)


class Points(Dataset):
    """A map-style dataset of the usual shape, with optional random augmentation."""

    def __init__(self, n: int = 64, augment: bool = False, seed: int = 0) -> None:
        self.x, self.y = tensors(n, seed)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        x = self.x[i] + 0.1 * torch.randn(DIM) if self.augment else self.x[i]
        return x, self.y[i]


class PointsData(L.LightningDataModule):
    def __init__(self, batch_size: int = 4, num_workers: int = 0, augment: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        self.train_set, self.val_set = Points(augment=self.hparams.augment), Points(seed=1)

    def train_dataloader(self):
        h = self.hparams
        return DataLoader(self.train_set, h.batch_size, shuffle=True, num_workers=h.num_workers)

    def val_dataloader(self):
        return DataLoader(self.val_set, self.hparams.batch_size, num_workers=self.hparams.num_workers)


class Classifier(L.LightningModule):
    def __init__(self, hidden: int = 32, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(DIM, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def metrics(trainer) -> dict[str, float]:
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


# ---------------------------------------------------------------- optimisation


class GAN(L.LightningModule):
    """Lightning's manual-optimisation GAN: two optimizers, toggled."""

    def __init__(self, latent: int = 8) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.latent = latent
        self.generator = nn.Sequential(nn.Linear(latent, 32), nn.ReLU(), nn.Linear(32, DIM))
        self.discriminator = nn.Sequential(nn.Linear(DIM, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        self.toggle_optimizer(opt_g)
        fake = self.generator(torch.randn(len(real), self.latent))
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        d_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        d_loss = (d_loss + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), zeros)) / 2
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss})

    def configure_optimizers(self):
        adam = lambda m: torch.optim.Adam(m.parameters(), lr=2e-4, betas=(0.5, 0.999))  # noqa: E731
        return [adam(self.generator), adam(self.discriminator)], []


@pattern(stock=dict(find_unused_parameters=True), why="toggled-off parameters go unused: stock needs find_unused")
def manual_gan(trainer):
    model = GAN()
    trainer().fit(model, loader())
    return model


class TwoOptimizers(Classifier):
    """Manual optimisation with an optimizer per part, manual clipping, and epoch-level schedulers."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt_body, opt_head = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        opt_body.zero_grad()
        opt_head.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt_body, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt_body.step()
        opt_head.step()

    def on_train_epoch_end(self):
        for scheduler in self.lr_schedulers():
            scheduler.step()

    def configure_optimizers(self):
        body = torch.optim.SGD(self.net[0].parameters(), lr=0.1, momentum=0.9)
        head = torch.optim.Adam(self.net[2].parameters(), lr=1e-2)
        return [body, head], [
            torch.optim.lr_scheduler.StepLR(body, 1, 0.5),
            torch.optim.lr_scheduler.ExponentialLR(head, 0.9),
        ]


@pattern()
def manual_several_optimizers_schedulers(trainer):
    model = TwoOptimizers()
    trainer(max_epochs=2).fit(model, loader())
    return model


class ManualAccumulation(Classifier):
    def __init__(self, every: int = 3) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.every = every

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        self.manual_backward(F.cross_entropy(self(x), y) / self.every)
        if (batch_idx + 1) % self.every == 0:
            opt.step()
            opt.zero_grad()


@pattern()
def manual_accumulation(trainer):
    model = ManualAccumulation()
    trainer().fit(model, loader())
    return model


class OneCycle(Classifier):
    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=0.05, total_steps=self.trainer.estimated_stepping_batches
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@pattern()
def scheduler_per_step(trainer):
    model = OneCycle()
    trainer(max_epochs=2).fit(model, loader())
    return model


class Plateau(Classifier):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


@pattern()
def reduce_lr_on_plateau(trainer):
    model = Plateau()
    trainer(max_epochs=3).fit(model, loader(), val_loader())
    return model


@pattern()
def clip_grad_norm(trainer):
    model = Classifier(lr=0.5)
    trainer(gradient_clip_val=0.5).fit(model, loader())
    return model


@pattern()
def clip_grad_value(trainer):
    model = Classifier(lr=0.5)
    trainer(gradient_clip_val=0.05, gradient_clip_algorithm="value").fit(model, loader())
    return model


@pattern()
def accumulate_grad_batches(trainer):
    model = Classifier()
    trainer(accumulate_grad_batches=3, max_epochs=2).fit(model, loader())
    return model


# ---------------------------------------------------------------- model shape


class TokenClassifier(Classifier):
    """ViT-style: a learned [CLS] token defined on the LightningModule itself."""

    def __init__(self) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 8))
        self.embed = nn.Linear(2, 8)
        self.encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.net = nn.Linear(8, CLASSES)

    def forward(self, x):
        patches = self.embed(x.view(len(x), -1, 2))
        h = self.encoder(torch.cat([self.cls_token.expand(len(x), -1, -1), patches], 1))
        return self.net(h[:, 0])


@pattern()
def root_parameter_cls_token(trainer):
    model = TokenClassifier()
    trainer().fit(model, loader())
    return model


class UncertaintyWeighted(Classifier):
    """Multi-task loss weighting (Kendall et al.): the learned log-variances are a parameter of the module."""

    def __init__(self) -> None:
        super().__init__()
        self.regressor = nn.Linear(DIM, 1)
        self.log_vars = nn.Parameter(torch.zeros(2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        losses = torch.stack([F.cross_entropy(self(x), y), F.mse_loss(self.regressor(x).squeeze(1), x.sum(1))])
        loss = (torch.exp(-self.log_vars) * losses + self.log_vars).sum()
        self.log("train_loss", loss)
        return loss


@pattern()
def root_parameter_log_vars(trainer):
    model = UncertaintyWeighted()
    trainer().fit(model, loader())
    return model


class TiedLM(L.LightningModule):
    """A next-token model whose output layer shares the embedding's weight (GPT-2 style)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.lm_head = nn.Linear(16, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight

    def training_step(self, batch, batch_idx):
        (seq,) = batch
        logits = self.lm_head(self.block(self.embed(seq[:, :-1])))
        return F.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


@pattern()
def tied_weights(trainer):
    model = TiedLM()
    trainer().fit(model, tokens())
    return model


class FrozenEmbeddings(TiedLM):
    """Pretrained embeddings kept frozen; only the layers above train."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(torch.randn(VOCAB, 16), freeze=True)
        self.lm_head = nn.Linear(16, VOCAB)


@pattern()
def frozen_embeddings(trainer):
    model = FrozenEmbeddings()
    trainer().fit(model, tokens())
    return model


class ConditionalHeads(Classifier):
    """One head per task; each batch belongs to one task, so the other head goes unused on that step."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(CLASSES, CLASSES), nn.Linear(CLASSES, 2)])

    def training_step(self, batch, batch_idx):
        x, y = batch
        task = batch_idx % 2
        return F.cross_entropy(self.heads[task](self(x)), y % (CLASSES if task == 0 else 2))


@pattern(
    stock=dict(find_unused_parameters=True),
    why="stock DDP needs find_unused_parameters=True, as its docs say",
)
def heads_used_by_condition(trainer):
    model = ConditionalHeads()
    trainer(gradient_clip_val=1.0).fit(model, loader())
    return model


class Checkpointed(Classifier):
    """Activation checkpointing of each block, as memory-bound transformer code does."""

    def __init__(self, use_reentrant: bool) -> None:
        super().__init__()
        self.use_reentrant = use_reentrant
        self.stem = nn.Linear(DIM, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(2))
        self.net = nn.Linear(32, CLASSES)

    def forward(self, x):
        h = self.stem(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.net(h)


@pattern()
def checkpointing_reentrant(trainer):
    model = Checkpointed(use_reentrant=True)
    trainer().fit(model, loader())
    return model


@pattern()
def checkpointing_non_reentrant(trainer):
    model = Checkpointed(use_reentrant=False)
    trainer().fit(model, loader())
    return model


# torch.compile on CPU: inductor builds C++ with gcc (tens of seconds per graph on a busy 2-core machine), so the
# compile patterns use the "aot_eager" backend: Dynamo's capture and AOTAutograd, no code generation.
@pattern(timeout=120)
def compile_module(trainer):
    model = Classifier()
    trainer().fit(torch.compile(model, backend=BACKEND), loader())
    return model


class CompiledEncoder(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.compile(nn.Sequential(nn.Linear(DIM, 32), nn.ReLU()), backend=BACKEND)
        self.net = nn.Linear(32, CLASSES)

    def forward(self, x):
        return self.net(self.encoder(x))


@pattern(timeout=120)
def compile_submodule(trainer):
    """Then what an evaluation script does with the checkpoint: ``load_from_checkpoint`` of the same class,
    outside any Trainer (a plain strict ``load_state_dict``, which no strategy sees)."""
    t = trainer()
    t.fit(CompiledEncoder(), loader())
    path = os.path.join(t.default_root_dir, "compiled_submodule.ckpt")
    t.save_checkpoint(path)
    return CompiledEncoder.load_from_checkpoint(path, weights_only=True)


# Stock DDP registers the parameters that are trainable when it wraps the module: a backbone unfrozen later is never
# synchronised and the replicas diverge (SoloDDP re-wraps). The 1-device runs compare the weights with stock.
UNFROZEN_LATER = "stock DDP never synchronises a backbone unfrozen after it wrapped the module"


class Backbone(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU())
        self.net = nn.Linear(32, CLASSES)

    def forward(self, x):
        return self.net(self.backbone(x))

    def configure_optimizers(self):
        return torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2)


@pattern(stock_replicas=False, weights=False, why=UNFROZEN_LATER)
def backbone_finetuning(trainer):
    model = Backbone()
    trainer(max_epochs=2, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)]).fit(model, loader())
    return model


class FeatureExtractorFreezeUnfreeze(BaseFinetuning):
    """The fine-tuning callback of Lightning's docs: frozen backbone, unfrozen as a new param group."""

    def __init__(self, unfreeze_at_epoch: int = 1) -> None:
        super().__init__()
        self._unfreeze_at_epoch = unfreeze_at_epoch

    def freeze_before_training(self, pl_module):
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module, current_epoch, optimizer):
        if current_epoch == self._unfreeze_at_epoch:
            self.unfreeze_and_add_param_group(modules=pl_module.backbone, optimizer=optimizer, lr=1e-3)


@pattern(stock_replicas=False, weights=False, why=UNFROZEN_LATER)
def finetuning_adds_param_group(trainer):
    model = Backbone()
    trainer(max_epochs=2, callbacks=[FeatureExtractorFreezeUnfreeze()]).fit(model, loader())
    return model


class BatchNormNet(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, CLASSES))


@pattern(
    solo=dict(sync_batchnorm=False),
    why="SoloDDP's sync_batchnorm='auto' synchronises BN at batch 4 (documented)",
)
def batchnorm(trainer):
    model = BatchNormNet()
    trainer().fit(model, loader(), val_loader())
    return model


class SequenceBatchNorm(nn.BatchNorm1d):
    """BatchNorm1d over the channels of ``(batch, time, channels)`` input."""

    def forward(self, x):
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class SequenceClassifier(Classifier):
    """Classifies sequences of ``DIM``-feature steps: per-step projection, BatchNorm, mean over time."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 32), SequenceBatchNorm(32), nn.ReLU())
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x):
        return self.head(self.net(x).mean(dim=1))


def sequences(n: int = 64, steps: int = 5, shuffle: bool = True, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    data = torch.randn(n, steps, DIM, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    return DataLoader(TensorDataset(*data), batch_size=4, shuffle=shuffle)


@pattern(
    solo=dict(sync_batchnorm=False),
    why="SoloDDP's sync_batchnorm='auto' synchronises BN at batch 4 (documented), through the subclass's forward",
)
def batchnorm_subclass_forward(trainer):
    model = SequenceClassifier()
    trainer().fit(model, sequences(), sequences(shuffle=False, seed=1))
    return model


class FrozenBatchNormNet(BatchNormNet):
    """Keeps its BatchNorm layers in eval mode while training: running statistics as they are, no updates."""

    def on_train_epoch_start(self):
        for m in self.modules():
            if isinstance(m, nn.BatchNorm1d):
                m.eval()


@pattern()  # frozen BN normalises with its running statistics: nothing for SyncBN to change
def batchnorm_frozen_by_isinstance(trainer):
    model = FrozenBatchNormNet()
    trainer(max_epochs=2).fit(model, loader(), val_loader())
    return model


class BatchNormAct1d(nn.BatchNorm1d):
    """BatchNorm1d followed by an activation, in one layer whose forward calls ``F.batch_norm`` itself."""

    def __init__(self, num_features: int) -> None:
        super().__init__(num_features)
        self.act = nn.ReLU()

    def forward(self, x):
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, self.training,
                         self.momentum, self.eps)  # fmt: skip
        return self.act(x)


class BatchNormActNet(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 32), BatchNormAct1d(32), nn.Linear(32, CLASSES))


@pattern()  # its forward never reaches BatchNorm's: sync_batchnorm='auto' leaves it as stock runs it (documented)
def batchnorm_layer_with_own_forward(trainer):
    model = BatchNormActNet()
    trainer().fit(model, loader(), val_loader())
    return model


class DropoutNet(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, CLASSES))


@pattern()
def dropout(trainer):
    model = DropoutNet()
    trainer(max_epochs=2).fit(model, loader())
    return model


@pattern(
    solo=dict(exact_resume=False),
    why="exact_resume (documented): an in-fit validation leaves the training RNG as it found it",
)
def dropout_with_validation(trainer):
    model = DropoutNet()
    trainer(max_epochs=2, val_check_interval=0.5).fit(model, PointsData())
    return model


# ---------------------------------------------------------------- data


class TwoSources(Classifier):
    """Trains on two datasets at once, a batch of each per step (None for one that ran out, in max_size mode)."""

    def training_step(self, batch, batch_idx):
        loss = sum(F.cross_entropy(self(x), y) for x, y in (b for b in batch.values() if b is not None))
        self.log("train_loss", loss)
        return loss


@pattern()
def combined_max_size_cycle(trainer):
    model = TwoSources()
    trainer().fit(model, {"a": loader(64), "b": loader(32, seed=2)})  # a dict of loaders: max_size_cycle
    return model


def combined_loader(trainer, mode: str):
    model = TwoSources()
    trainer().fit(model, CombinedLoader({"a": loader(64), "b": loader(32, seed=2)}, mode=mode))
    return model


for _mode in ("min_size", "max_size"):
    pattern(f"combined_{_mode}")(partial(combined_loader, mode=_mode))


class TwoValSets(Classifier):
    """Validates on two sets, one after the other: Lightning's sequential mode (fit does not support it)."""

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)


@pattern()
def combined_sequential(trainer):
    model, t = TwoValSets(), trainer()
    val = CombinedLoader([val_loader(64), val_loader(32)], mode="sequential")
    t.fit(model, loader(), val)
    return model, metrics(t)


class Stream(IterableDataset):
    """A streaming dataset that shards itself by rank, as webdataset-style loaders do."""

    def __iter__(self):
        x, y = tensors(64)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        yield from zip(x[rank::world], y[rank::world])


@pattern()
def iterable_dataset(trainer):
    model = Classifier()
    trainer().fit(model, DataLoader(Stream(), batch_size=4))
    return model


@pattern()
def weighted_random_sampler(trainer):
    x, y = tensors()
    sampler = WeightedRandomSampler((y + 1).double(), num_samples=len(y))
    model = Classifier()
    trainer().fit(model, DataLoader(TensorDataset(x, y), batch_size=4, sampler=sampler))
    return model


class HardestFirst(Sampler):
    """A curriculum: samples in a fixed order of difficulty (here: by label, then feature norm)."""

    def __init__(self, dataset) -> None:
        x, y = dataset.tensors
        self.order = sorted(range(len(y)), key=lambda i: (-int(y[i]), float(x[i].norm())))

    def __iter__(self):
        return iter(self.order)

    def __len__(self):
        return len(self.order)


@pattern()
def custom_sampler(trainer):
    data = TensorDataset(*tensors())
    model = Classifier()
    trainer().fit(model, DataLoader(data, batch_size=4, sampler=HardestFirst(data)))
    return model


class SortedBatches(BatchSampler):
    """Batches whose samples are sorted by index within each batch (as length-bucketing samplers do)."""

    def __iter__(self):
        for batch in super().__iter__():
            yield sorted(batch)


@pattern()
def custom_batch_sampler(trainer):
    data = TensorDataset(*tensors())
    batches = SortedBatches(torch.utils.data.RandomSampler(data), batch_size=4, drop_last=False)
    model = Classifier()
    trainer().fit(model, DataLoader(data, batch_sampler=batches))
    return model


class BatchFetched(Dataset):
    """Fetches a whole batch per call, as Hugging Face datasets do: ``__getitems__`` and ``__len__`` only."""

    def __init__(self) -> None:
        self.x, self.y = tensors()

    def __len__(self) -> int:
        return len(self.x)

    def __getitems__(self, indices: list[int]):
        return list(zip(self.x[indices], self.y[indices]))


@pattern()
def getitems_dataset(trainer):
    model = Classifier()
    trainer().fit(model, DataLoader(BatchFetched(), batch_size=4, shuffle=True))
    return model


class PreviewSamples(Callback):
    """Looks at the first training sample before training, as image-logging callbacks do."""

    def on_train_start(self, trainer, pl_module):
        dataset = trainer.train_dataloader.dataset
        x, y = dataset[0]
        self.preview = {
            "ours": isinstance(dataset, Points),
            "len": len(dataset),
            "first": [float(x.sum()), int(y)],
        }


@pattern()
def sample_preview_callback(trainer):
    model, preview = Classifier(), PreviewSamples()
    trainer(callbacks=[preview]).fit(model, PointsData())
    return model, preview.preview


@pattern(
    solo=dict(exact_resume=False),
    why="exact_resume (documented): SoloDDP seeds each sample's augmentation from (seed, epoch, index)",
)
def workers_with_augmentation(trainer):
    model = DropoutNet()
    trainer(max_epochs=2).fit(model, PointsData(num_workers=2, augment=True))
    return model


# ---------------------------------------------------------------- callbacks


@pattern()
def ema_weight_averaging(trainer):
    model = Classifier()
    trainer(max_epochs=2, callbacks=[EMAWeightAveraging(decay=0.9)]).fit(model, loader())
    return model


@pattern()
def stochastic_weight_averaging(trainer):
    model = Classifier()
    trainer(max_epochs=3, callbacks=[StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1)]).fit(model, loader())
    return model


def checkpoint_and_stop(trainer, model, monitor: str, mode: str):
    ckpt = ModelCheckpoint(monitor=monitor, mode=mode, save_top_k=2, filename="{epoch}-{" + monitor + ":.4f}")
    stop = EarlyStopping(monitor=monitor, mode=mode, patience=1, min_delta=1e-3)
    t = trainer(max_epochs=5, enable_checkpointing=True, callbacks=[ckpt, stop])
    t.fit(model, PointsData())
    best = sorted((float(v), os.path.basename(k)) for k, v in ckpt.best_k_models.items())
    return model, {"best": best, "stopped_epoch": stop.stopped_epoch, "epochs": t.current_epoch}


@pattern()
def checkpoint_early_stop_synced(trainer):
    return checkpoint_and_stop(trainer, Classifier(lr=0.5), "val_loss", "min")


class RankAccuracy(Classifier):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(1) == y).float().mean())  # per rank: no sync_dist


@pattern()
def checkpoint_early_stop_per_rank(trainer):
    return checkpoint_and_stop(trainer, RankAccuracy(lr=0.5), "val_acc", "max")


# ---------------------------------------------------------------- evaluation


class Logged(Classifier):
    def __init__(self, reduce_fx: str) -> None:
        super().__init__()
        self.reduce_fx = reduce_fx

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log(
            f"train_{self.reduce_fx}",
            loss,
            on_step=False,
            on_epoch=True,
            sync_dist=True,
            reduce_fx=self.reduce_fx,
        )
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log(f"val_{self.reduce_fx}", loss, sync_dist=True, reduce_fx=self.reduce_fx)


def log_sync_dist(trainer, reduce_fx: str):
    model, t = Logged(reduce_fx), trainer()
    t.fit(model, loader(), val_loader())
    return model, metrics(t)


for _fx in ("mean", "sum", "max", "min"):
    pattern(f"log_sync_dist_{_fx}")(partial(log_sync_dist, reduce_fx=_fx))


class GatherOutputs(Classifier):
    """Collects predictions and gathers them at epoch end, e.g. for AUROC or an sklearn metric."""

    def on_validation_epoch_start(self):
        self.outs, self.ids = [], []

    def validation_step(self, batch, batch_idx):
        x, _y, i = batch
        self.outs.append(self(x).softmax(-1))
        self.ids.append(i)

    def on_validation_epoch_end(self):
        preds, ids = self.all_gather(torch.cat(self.outs)), self.all_gather(torch.cat(self.ids))
        self.gathered = {
            "rows": preds.flatten(0, -2).shape[0],
            "samples": sorted(set(ids.flatten().tolist())),
        }


@pattern()
def gather_eval_outputs_uneven(trainer):
    x, y = tensors(101, seed=1)
    model = GatherOutputs()
    val = DataLoader(TensorDataset(x, y, torch.arange(101)), batch_size=8)
    trainer().fit(model, loader(), val)
    return model, model.gathered


class SavePredictions(BasePredictionWriter):
    """The writer of Lightning's docs: every rank saves its predictions and their dataset indices."""

    def __init__(self, output_dir: str) -> None:
        super().__init__(write_interval="epoch")
        self.output_dir = output_dir

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        torch.save(
            (predictions, batch_indices),
            os.path.join(self.output_dir, f"predictions_{trainer.global_rank}.pt"),
        )


@pattern()
def predict_with_writer(trainer):
    model, writer = Classifier(), SavePredictions(trainer.root)
    t = trainer(callbacks=[writer])
    t.fit(model, loader())
    t.predict(model, val_loader(101), return_predictions=False)
    t.strategy.barrier()
    by_index = {}
    for rank in range(t.world_size):
        predictions, indices = torch.load(os.path.join(writer.output_dir, f"predictions_{rank}.pt"))
        for batch, ids in zip(predictions, indices[0]):
            by_index.update(zip(ids, batch.argmax(1).tolist()))
    return model, [by_index.get(i) for i in range(101)]


@pattern(
    solo=dict(exact_eval=False),
    why="exact_eval (documented): sync_dist epoch means count the samples in float",
)
def val_metric_uneven_set(trainer):
    model, t = Classifier(), trainer()
    t.fit(model, loader(), val_loader(101))
    return model, metrics(t)


@pattern()
def overfit_batches(trainer):
    model = Classifier()
    trainer(max_epochs=3, overfit_batches=2).fit(model, loader(), val_loader())
    return model


@pattern(also=dict(comm_hook="auto"))
def resume_from_checkpoint(trainer):
    first = trainer(enable_checkpointing=True)
    first.fit(Classifier(), loader())
    model = Classifier()
    trainer(max_epochs=2, enable_checkpointing=True).fit(
        model, loader(), ckpt_path=first.checkpoint_callback.best_model_path
    )
    return model


@pattern()
def validate_and_test_before_fit(trainer):
    model, t = Classifier(), trainer()
    before = [t.validate(model, val_loader(), verbose=False), t.test(model, val_loader(), verbose=False)]
    t.fit(model, loader(), val_loader())
    return model, before


# ---------------------------------------------------------------- the strategy's own collectives, tuners


@pattern()
def lr_finder_callback(trainer):
    """Lightning's LearningRateFinder as a callback: its range test runs the fit loop (and the strategy's
    on_train_end) before the real fit goes on."""
    from lightning.pytorch.callbacks import LearningRateFinder

    model = Classifier()
    finder = LearningRateFinder(num_training_steps=20, early_stop_threshold=None, update_attr=True, attr_name="lr")
    trainer(max_epochs=2, callbacks=[finder]).fit(model, loader(128), val_loader())
    return model, {"lr": model.hparams.lr}


@pattern(
    solo=dict(exact_resume=False),
    why="exact_resume (documented): after the restore of its range test the resumable loader orders epoch 1 by "
    "epoch 1; stock's re-made loader repeats epoch 0's order",
)
def lr_finder_at_milestones(trainer):
    """The subclass in LearningRateFinder's docstring: a range test at chosen epochs, from inside the fit."""
    from lightning.pytorch.callbacks import LearningRateFinder

    class FineTuneLearningRateFinder(LearningRateFinder):
        def __init__(self, milestones, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.milestones = milestones

        def on_fit_start(self, *args, **kwargs):
            return

        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch in self.milestones or trainer.current_epoch == 0:
                self.lr_find(trainer, pl_module)

    model = Classifier()
    finder = FineTuneLearningRateFinder(
        milestones=(1,), num_training_steps=20, early_stop_threshold=None, attr_name="lr"
    )
    trainer(max_epochs=2, callbacks=[finder]).fit(model, loader(128))
    return model, {"lr": model.hparams.lr}


class ReducedCounts(Classifier):
    """Counts with the strategy's own reduce, as Lightning's docs show ``trainer.strategy.reduce``."""

    def on_train_epoch_end(self):
        seen = torch.tensor(64 + self.global_rank)  # an integer tensor, as a sample count is
        self.reduced = {
            op: (r.dtype, r.tolist())
            for op in ("mean", "sum")
            for r in [self.trainer.strategy.reduce(seen, reduce_op=op)]
        }


@pattern()
def strategy_reduce_integers(trainer):
    model = ReducedCounts()
    trainer().fit(model, loader())
    return model, {op: [str(dtype), value] for op, (dtype, value) in model.reduced.items()}


@pattern()
def environment_after_fit(trainer):
    """What a fit leaves in ``os.environ`` (Lightning's own test suite fails a test that leaks a variable)."""
    before, model = dict(os.environ), Classifier()
    trainer().fit(model, loader())
    after = dict(os.environ)
    changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
    return model, sorted(changed - LAUNCH_VARIABLES)


# What Lightning's launch sets for its processes (and its own test suite allows to stay).
LAUNCH_VARIABLES = {"WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED",
                    "PL_SEED_WORKERS"}  # fmt: skip
