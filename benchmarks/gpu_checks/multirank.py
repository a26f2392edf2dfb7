"""The default scenario on more than one rank: 2 processes on the one GPU (gloo on CUDA tensors: NCCL refuses two
ranks on one device), the runner's callbacks, a BatchNorm model at per-device batch 16 and 128; SoloDDP() against
stock DDPStrategy in the same processes, device syncs per steady step counted with torch.profiler."""

from __future__ import annotations

import tempfile
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.gpu_checks.common import accelerator, device_syncs, join_as_rank, runner_callbacks, two_ranks
from lightning_solo import SoloDDP
from lightning_solo.callbacks import Preflight
from lightning_solo.core.decision import Decision

BATCHES = (16, 128)  # SoloDDP's auto SyncBN on at 16, off at 128
STEADY = range(12, 16)  # after every callback's measuring steps (8) and the evidence window (4)
ARMS = ("SoloDDP()", "DDPStrategy()")


class _BNNet(L.LightningModule):
    """A small conv net with BatchNorm, SGD with momentum, ``train/loss`` logged as the runner's model logs it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))  # fmt: skip

    def training_step(self, batch, batch_idx):
        loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class _CountSyncs(L.Callback):
    """torch.profiler over the steady steps (optimizer steps ``STEADY``, within the first epoch): device syncs and
    device-to-host copies, per step (mean); ``profiled`` says the window ran."""

    def __init__(self, device: str) -> None:
        self.device, self.prof, self.per_step, self.profiled = device, None, (0.0, 0.0, 0.0), False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from torch.profiler import ProfilerActivity, profile

        if trainer.global_step == STEADY.start:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
            self.prof = profile(activities=activities)
            self.prof.__enter__()
        elif trainer.global_step == STEADY.stop:
            self.prof.__exit__(None, None, None)
            self.per_step, self.profiled = tuple(n / len(STEADY) for n in device_syncs(self.prof)), True


def multirank_rank(device: str, rank: str, port: str, out: str) -> None:
    """One of the two ranks: for each batch, a SoloDDP() fit and a stock DDPStrategy fit, the runner's callbacks in
    both; what each saw goes to ``out/rank<r>.pt``."""
    g = torch.Generator().manual_seed(int(rank))
    n = 2 * max(BATCHES) * (STEADY.stop + 2)  # one epoch per fit: no epoch end (a checkpoint save) among the steps
    data = TensorDataset(torch.randn(n, 3, 16, 16, generator=g), torch.randint(10, (n,), generator=g))
    seen = {}
    for batch in BATCHES:
        for arm in ARMS:
            join_as_rank(rank, port)  # again: Lightning's teardown removes WORLD_SIZE
            strategy = SoloDDP(process_group_backend="gloo") if arm == "SoloDDP()" else DDPStrategy(
                process_group_backend="gloo")  # fmt: skip
            count, model = _CountSyncs(device), _BNNet()
            # Stock at 16 synchronises BatchNorm too (torch's SyncBatchNorm: CUDA only), so the two count alike.
            stock_sync = arm == "DDPStrategy()" and batch < 32 and device == "cuda"
            with tempfile.TemporaryDirectory() as tmp:
                run = Path(out) / f"{arm[:4]}{batch}"  # shared by the ranks: rank 0 writes the checkpoint there
                # Preflight rightly stops two ranks sharing one GPU: left out there (it checks at setup, not per step).
                callbacks = [c for c in runner_callbacks(run, batch) if device == "cpu" or not isinstance(c, Preflight)]
                trainer = L.Trainer(accelerator=accelerator(device), devices=1, num_nodes=2, strategy=strategy,
                                    max_steps=STEADY.stop + 1, callbacks=[*callbacks, count], log_every_n_steps=50,
                                    logger=L.pytorch.loggers.CSVLogger(tmp), default_root_dir=run,
                                    enable_progress_bar=False, enable_model_summary=False,
                                    sync_batchnorm=stock_sync)  # fmt: skip
                try:
                    trainer.fit(model, DataLoader(data, batch_size=batch))
                    error = None
                except Exception as err:  # stock's failure is a row of the table, the run goes on
                    if arm == "SoloDDP()":
                        raise
                    error = f"{type(err).__name__}: {err}"[:200]
            decisions = getattr(trainer.strategy, "decisions", {})
            if stock_sync:
                decisions = {"sync_batchnorm": Decision("sync_batchnorm", True, "Trainer(sync_batchnorm=True)")}
            seen[(arm, batch)] = {
                "error": error,
                "steps": trainer.global_step,
                "syncs": count.per_step,
                "profiled": count.profiled,
                "decisions": {k: (d.value, d.reason) for k, d in decisions.items()},
                "weights": torch.nn.utils.parameters_to_vector(model.parameters()).detach().cpu(),
            }
    torch.save(seen, f"{out}/rank{rank}.pt")


def check_multirank(device: str) -> tuple[bool, str]:
    """2 ranks on the one device, the runner's callbacks, BatchNorm at per-device batch 16 (SyncBN on: "auto" stays
    on True) and 128 (the fast path reached, the same weights as stock): SoloDDP()'s barrier is monitored; its device
    syncs and device-to-host copies per steady step at most stock DDPStrategy's."""
    with tempfile.TemporaryDirectory() as out:
        failed = two_ranks("multirank-rank", multirank_rank, device, out)
        if failed:
            return False, failed
        ranks = [torch.load(f"{out}/rank{r}.pt", weights_only=False) for r in (0, 1)]
    unit = ", Preflight left out (two ranks share the GPU)" if device == "cuda" else " (CPU: 0 by construction)"
    lines = [f"2 ranks on one {device} device (gloo), runner callbacks, syncs per steady step (steps "
             f"{STEADY.start}-{STEADY.stop - 1}, the most on a rank){unit}",
             "| batch | setup | steps | sync_batchnorm | barrier | find_unused_parameters | device syncs | D2H copies "
             "| value reads | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    ok = True
    for batch in BATCHES:
        stock = [max(r[("DDPStrategy()", batch)]["syncs"][i] for r in ranks) for i in (0, 1)]
        for arm in ARMS:
            runs = [r[(arm, batch)] for r in ranks]
            syncs, copies, reads = (max(run["syncs"][i] for run in runs) for i in (0, 1, 2))
            d = runs[0]["decisions"]
            row_ok = all(run["steps"] == STEADY.stop + 1 and run["profiled"] and not run["error"] for run in runs)
            if arm == "SoloDDP()":
                unused = d.get("find_unused_parameters", (None, ""))
                row_ok = row_ok and d.get("barrier", (None,))[0] == "monitored"
                synced = batch < 32  # auto SyncBN at 16
                if synced:  # its all-reduce runs inside backward: "auto" stays on True
                    expected = unused[0] is True and "inside backward" in unused[1]
                else:
                    expected = unused[0] is False and "fast path" in unused[1]
                row_ok = row_ok and expected and d.get("sync_batchnorm", (None,))[0] is synced
                row_ok = row_ok and syncs <= stock[0] and copies <= stock[1]
                if batch >= 32:  # no SyncBN: the promise, SoloDDP() ≡ stock
                    same = [torch.allclose(run["weights"], r[("DDPStrategy()", batch)]["weights"], rtol=1e-5,
                                           atol=1e-6) for run, r in zip(runs, ranks)]  # fmt: skip
                    row_ok = row_ok and all(same)
            ok = ok and row_ok
            shown = " | ".join(str(d[k][0]) if k in d else "-" for k in ("sync_batchnorm", "barrier",
                                                                          "find_unused_parameters"))  # fmt: skip
            lines.append(f"| {batch} | {arm} | {runs[0]['steps']} | {shown} | {syncs:g} | {copies:g} | {reads:g} | "
                         f"{'PASS' if row_ok else 'FAIL: ' + (runs[0]['error'] or runs[1]['error'] or 'see above')} |")  # fmt: skip
    lines.append("Stock at 16: Trainer(sync_batchnorm=True) on CUDA (torch's SyncBatchNorm has no CPU form). "
                 "SoloDDP(): barrier monitored; at 16 SyncBN on, so find_unused_parameters stays True (its all-reduce "
                 "runs inside backward); at 128 the fast path reached and the weights equal stock's (rtol 1e-5); "
                 "device syncs and D2H copies ≤ stock's each (the fast path reads one step late, without a sync); value reads "
                 "(aten::_local_scalar_dense, any device: CPU-group reads too) for comparison")  # fmt: skip
    return ok, "\n".join(lines)
