"""auto_batch_size: the search as a table, and on 2 CPU ranks a batch whose measured peak memory is inside the
band on both, with the lr of the run summary scaled for it."""

from __future__ import annotations

import math
import os
import time

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_solo import SoloDDP
from lightning_solo.app.run_summary import RunSummary
from lightning_solo.callbacks import AutoBatchSize, WarmupScaledLR
from lightning_solo.callbacks.batch_size.probe import is_out_of_memory
from lightning_solo.callbacks.batch_size.search import check_band, decide_batch_size, search_batch_size
from tests.distributed import run_ranks

LOW, HIGH = 0.6, 0.8


def _oom_above(limit):
    return lambda b: math.inf if b > limit else 0.1 + 0.001 * b


@pytest.mark.parametrize(
    ("measure", "start", "max_batch", "expected", "in_band"),
    [
        (lambda b: 0.1 + 0.01 * b, 8, 1024, 60, True),  # a straight line: one jump to the target
        (lambda b: 0.1 + 0.01 * b, 200, 1024, 67, True),  # from far above
        (lambda b: 0.5 + 0.0001 * b, 8, 100_000, 2000, True),  # slow growth: bounded steps, then the line
        (lambda b: 0.1 + 0.001 * b**1.5, 4, 100_000, 64, True),  # not a line
        (lambda b: 0.3 + 0.3 * b, 8, 1024, 1, True),  # one sample is a third of the budget
        (lambda b: 0.9 + 0.3 * b, 8, 1024, 1, False),  # even one sample is too many: 1, and said so
        (lambda b: 0.1 + 0.01 * b, 8, 30, 30, False),  # the set is too small to reach the band
        (_oom_above(50), 4, 100_000, 50, False),  # out of memory long before the band
    ],
)
def test_search_lands_in_the_band_or_takes_the_largest_fit(measure, start, max_batch, expected, in_band):
    search = search_batch_size(measure, start, LOW, HIGH, max_batch)
    assert (search.batch, search.in_band) == (expected, in_band), search
    assert len(search.probes) <= 8 and all(b <= max_batch for b, _ in search.probes)
    assert search.fraction == measure(expected)


def test_band_checks():
    assert check_band(0.7, 0.1) == pytest.approx((0.6, 0.8))
    for fraction, tolerance in ((0.95, 0.1), (0.05, 0.1), (0.0, 0.0)):
        with pytest.raises(ValueError, match="must"):
            check_band(fraction, tolerance)


class _MLP(L.LightningModule):
    """Activations grow with the batch (about 40 KiB a sample), next to 5 MiB of weights; SGD with momentum."""

    def __init__(self, samples: int = 4096) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        self.batch_size, self.samples = 16, samples
        self.steps_taken = 0  # in the state_dict through torch's get_extra_state

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        self.steps_taken += 1
        return loss

    def get_extra_state(self):
        return {"steps_taken": self.steps_taken}

    def set_extra_state(self, state):
        self.steps_taken = state["steps_taken"]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        data = TensorDataset(
            torch.randn(self.samples, 256, generator=gen), torch.randint(10, (self.samples,), generator=gen)
        )
        return DataLoader(data, batch_size=self.batch_size)


CAP_MB = 32


def _fit(rank, world_size, directory):
    os.environ["LOCAL_RANK"] = str(rank)  # ranks already running (as under torchrun)
    finder, summary = AutoBatchSize(cap_mb=CAP_MB), RunSummary()
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=SoloDDP(), max_steps=2, logger=False,
                        callbacks=[finder, WarmupScaledLR(reference_batch_size=64, warmup_steps=0), summary],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        default_root_dir=directory)  # fmt: skip
    torch.manual_seed(0)
    model = _MLP()
    trainer.fit(model)
    return (
        finder.batch_size,
        finder.measured,
        finder.decisions["per_device_batch_size"].reason,
        summary.summary,
        model.steps_taken,
    )


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_two_ranks_agree_on_a_batch_in_the_band_and_the_lr_follows(tmp_path):
    (batch, measured, reason, summary, steps), (batch_1, measured_1, _, _, _) = run_ranks(
        _fit, 2, str(tmp_path), timeout=110
    )
    assert steps == 2  # the probes' steps are undone with the module's state, its extra state included
    print(f"auto_batch_size, cap {CAP_MB} MiB: batch {batch}, measured {measured}; {reason}")
    assert batch == batch_1 > 16 and measured == measured_1
    # The band holds for the largest rank's share, as the finder reads it (the others may sit just under).
    assert len(measured) == 2 and LOW <= max(measured) <= HIGH, reason
    assert summary["per_device_batch"] == batch and summary["global_batch"] == 2 * batch
    assert summary["lr"]["first_step"] == pytest.approx(0.05 * 2 * batch / 64)
    assert any(d["setting"] == "per_device_batch_size" and d["value"] == batch for d in summary["decisions"])


def test_runner_option_builds_the_callback_and_bad_keys_are_named(tmp_path):
    import hydra

    from lightning_solo.app.config_check import ConfigError, check_config
    from tests.helpers import composed

    with composed([], tmp_path) as cfg:
        assert cfg.get("auto_batch_size") is None  # off by default
    with composed(["auto_batch_size=memory", "auto_batch_size.cap_mb=64"], tmp_path) as cfg:
        check_config(cfg)
        finder = hydra.utils.instantiate(cfg.auto_batch_size)
        assert isinstance(finder, AutoBatchSize) and (
            finder.low,
            finder.high,
            finder.cap_mb,
        ) == pytest.approx((0.6, 0.8, 64))
    for override, named in (
        ("+auto_batch_size.fractoin=0.5", "Did you mean 'fraction'"),
        ("auto_batch_size.fraction=abc", "expected float"),
    ):
        with (
            composed(["auto_batch_size=memory", override], tmp_path) as cfg,
            pytest.raises(ConfigError, match=named),
        ):
            check_config(cfg)


@pytest.mark.parametrize(
    ("error", "too_big"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (
            RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
            True,
        ),
        (RuntimeError("Unable to find a valid cuDNN algorithm to run convolution"), True),
        (
            RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. ... unable to find an engine to execute"),
            True,
        ),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x5)"), False),
        (ValueError("out of memory"), False),  # not an error torch raises for memory
    ],
)
def test_what_counts_as_too_big(error, too_big):
    assert is_out_of_memory(error) is too_big


def test_the_decision_gives_allocated_and_reserved():
    search = search_batch_size(lambda b: 0.01 * b, 8, LOW, HIGH, 1024)
    reason = decide_batch_size(search, LOW, HIGH, [0.7, 0.69], "80 GiB of the GPU's memory", [0.75, 0.74]).reason
    assert "0.700, 0.690 allocated (0.750, 0.740 reserved) of 80 GiB" in reason
    cpu = decide_batch_size(search, LOW, HIGH, [0.7], "1 GiB of the CPU budget", [math.nan]).reason
    assert "reserved" not in cpu


class _FailsAbove(_MLP):
    """On rank 1 only, a batch above 64 raises ``error``: what a GPU near full memory (or a bug) does."""

    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    def training_step(self, batch, batch_idx):
        if torch.distributed.get_rank() == 1 and batch[0].shape[0] > 64:  # the probes run without a trainer
            raise self.error
        return super().training_step(batch, batch_idx)


def _fit_failing(rank, world_size, directory, error):
    os.environ["LOCAL_RANK"] = str(rank)
    finder = AutoBatchSize(cap_mb=CAP_MB)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=SoloDDP(), max_steps=1, logger=False,
                        callbacks=[finder], enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=directory)  # fmt: skip
    try:
        trainer.fit(_FailsAbove(error))
    except RuntimeError as err:
        return {"raised": str(err)}
    return {"batch": finder.batch_size, "reason": finder.decisions["per_device_batch_size"].reason}


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_cudnn_or_cudamalloc_failure_on_one_rank_counts_as_too_big_on_every_rank(tmp_path):
    error = RuntimeError("Unable to find a valid cuDNN algorithm to run convolution")
    first, second = run_ranks(_fit_failing, 2, str(tmp_path), error, timeout=110)
    assert first == second and first["batch"] <= 64, first  # every rank agrees: above 64 did not fit
    assert "→inf" in first["reason"]


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_another_error_on_one_rank_stops_every_rank_at_that_probe(tmp_path):
    start = time.monotonic()
    first, second = run_ranks(_fit_failing, 2, str(tmp_path), ValueError("a bug in training_step"), timeout=50)
    assert time.monotonic() - start < 45  # not the collective timeout
    for result in (first, second):
        assert "the probe at batch" in result["raised"] and "failed on rank(s) [1]" in result["raised"]
    assert "a bug in training_step" in second["raised"]  # the failing rank says what failed
