"""A feature that is off costs nothing per step: the pack's functions a steady training step calls, counted on
2 gloo ranks with ``sys.setprofile``, come only from the strategy's wiring, the unused-parameter policy and the
SIGTERM agreement (which stands in for Lightning's per-batch broadcast) when the other features are off; each
feature turned on adds calls in its own modules only."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from lightning_solo import SoloDDP

PACKAGE = str(Path(__import__("lightning_solo").__file__).parent) + "/"
FIRST, STEPS = 6, 8  # steady steps: after the unused policy's evidence window and a re-wrap
OFF = dict(compile=False, comm_hook=None, uneven_data=False, watchdog=False, exact_resume=False)
BASE = {
    "ddp/strategy.py",
    "ddp/unused",
    "_compat/torch.py",
    "_compat/patch.py",
    "ddp/sigterm.py",
    "ddp/agreement.py",
}  # _compat/patch.py: the unused policy's patches while it searches


class _CountCalls(L.Callback):
    """Counts the calls into the package's functions from batch FIRST to batch FIRST + STEPS, per module."""

    def __init__(self, out: Path) -> None:
        self.out, self.calls = out, Counter()

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            path = frame.f_code.co_filename[len(PACKAGE) :]
            parts = path.split("/")
            self.calls[path if len(parts) < 3 else "/".join(parts[:2])] += 1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == FIRST:
            sys.setprofile(self._profile)
        elif batch_idx == FIRST + STEPS:
            sys.setprofile(None)
            (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.calls))


class _Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def per_step_calls(tmp_path: Path, strategy) -> dict[str, float]:
    data = TensorDataset(torch.randn(160, 8), torch.randint(0, 2, (160,)))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, limit_train_batches=FIRST + STEPS + 1,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        callbacks=[_CountCalls(tmp_path)], default_root_dir=tmp_path,
    )  # fmt: skip
    tmp_path.mkdir(parents=True, exist_ok=True)
    trainer.fit(_Net(), DataLoader(data, batch_size=4))
    calls = json.loads((tmp_path / "rank0.json").read_text())
    return {module: n / STEPS for module, n in calls.items()}


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_features_that_are_off_add_no_per_step_call(tmp_path):
    assert per_step_calls(tmp_path / "stock", DDPStrategy(start_method="fork")) == {}
    off = per_step_calls(tmp_path / "off", SoloDDP(start_method="fork", **OFF))
    assert set(off) <= BASE, off
    assert off["ddp/unused"] > 0  # the profile sees the policy's calls


# Each feature on its own, the calls it adds (the modules beside the wiring, ddp/component.py), and the loader
# (an IterableDataset, or lengths that differ between ranks, is what uneven_data wraps: here neither).
FEATURES = {
    "watchdog": (dict(watchdog=True), {"ddp/watchdog"}),
    "exact_resume": (dict(exact_resume=True), {"ddp/resume", "core/rng.py"}),
    "compile": (dict(compile={"backend": "eager"}), {"ddp/compile.py", "_compat/torch.py"}),
    "comm_hook_auto": (dict(comm_hook="auto"), {"ddp/comm", "ddp/trial.py"}),
    "post_local_sgd": (dict(comm_hook="post_local_sgd", local_sgd_warmup=2), {"ddp/comm"}),
    "comm_hook_fp16": (
        dict(comm_hook="fp16"),
        set(),
    ),  # DDP calls the hook: nothing per step from the strategy
    "uneven_data": (
        dict(uneven_data="shortest"),
        set(),
    ),  # a map-style loader of equal lengths is not wrapped
}


@pytest.mark.multiproc
@pytest.mark.timeout(240)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_each_feature_adds_only_its_own_per_step_calls(tmp_path, feature):
    options, own = FEATURES[feature]
    calls = per_step_calls(tmp_path, SoloDDP(start_method="fork", **{**OFF, **options}))
    others = {module: n for module, n in calls.items() if module not in BASE | own | {"ddp/component.py"}}
    if feature == "comm_hook_auto":  # a re-wrap between its trials (1 in STEPS here) asks every feature again
        assert all(n < 0.5 for n in others.values()), calls
    else:
        assert not others, calls
    assert all(calls.get(module, 0) > 0 for module in own - {"_compat/torch.py"}), calls
