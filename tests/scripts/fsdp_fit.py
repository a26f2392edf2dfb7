"""Fit a tiny model with SoloFSDP on 2 CPU processes (the popen launcher re-runs this script for rank 1), save
sharded checkpoints, fit again from the newest one, and consolidate it.

    python tests/scripts/fsdp_fit.py OUT_DIR

Rank 0 writes OUT_DIR/result.json: the strategy's and WarmupScaledLR's decisions, the step each fit started and
ended at, whether the consolidated file, loaded with weights_only=True into a plain model, equals the trained
(full) weights, and each rank's BatchNorm running mean after each fit (the first keeps each rank's own,
``average_bn_stats=False``; the resumed one averages them). Then, in the same processes, the BatchNorm model from
one seed under SoloDDP, SoloFSDP fp32 and SoloFSDP bf16: each fit's full trained parameters, its precision
decisions, and whether every rank ended with the same ones.
"""

import json
import sys
from pathlib import Path

import lightning_solo  # noqa: F401 - first: Lightning then loads with the GC paused (lightning_solo/__init__.py)

# isort: split
import lightning as L
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import DataLoader, TensorDataset
from user_model import QUIET, Tiny, mlp

from lightning_solo.callbacks import SoloCheckpoint, WarmupScaledLR
from lightning_solo.checkpoint import resolve_ckpt_path
from lightning_solo.ddp.strategy import SoloDDP
from lightning_solo.fsdp.consolidate import consolidate
from lightning_solo.fsdp.strategy import SoloFSDP


def net() -> torch.nn.Sequential:
    """The MLP with a BatchNorm layer, whose running statistics follow each rank's batches."""
    layers = list(mlp(hidden=32))
    return torch.nn.Sequential(layers[0], torch.nn.BatchNorm1d(32), *layers[1:])


def bn_mean(trainer, model) -> list[list[float]]:
    """Every rank's BatchNorm running mean (an all-gather)."""
    mean = model.net[1].running_mean.detach().clone()
    return [t.tolist() for t in trainer.strategy.all_gather(mean)]


def fit(out: Path, max_steps: int, resume: bool):
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
    lr = WarmupScaledLR(reference_batch_size=32, warmup_steps=0, log_lr=False)
    ckpt = SoloCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, keep_last_k=2)
    # min_num_params=100: the first Linear (288 parameters) gets a shard group of its own.
    strategy = SoloFSDP(min_num_params=100, average_bn_stats=resume)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, callbacks=[lr, ckpt], max_steps=max_steps,
        default_root_dir=out, **QUIET,
    )  # fmt: skip
    model = Tiny(net(), lr=0.4, momentum=0.9)
    ckpt_path = resolve_ckpt_path("auto", out / "ckpt") if resume else None
    trainer.fit(model, DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
    return trainer, model, lr, ckpt, bn_mean(trainer, model)


def moved(strategy) -> tuple[dict, dict, bool]:
    """4 steps of the BatchNorm model from seed 0 under ``strategy``: how far its full parameters moved (no running
    statistics: DDP broadcasts rank 0's, FSDP averages the ranks'), its decisions, and whether the ranks agree."""
    L.seed_everything(0, verbose=False)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=4, enable_checkpointing=False, **QUIET
    )
    model = Tiny(net(), lr=0.1, momentum=0.9)
    init = {f"net.{k}": v.detach().clone() for k, v in model.net.named_parameters()}
    trainer.fit(model, DataLoader(data, batch_size=8))
    if isinstance(strategy, SoloFSDP):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))  # on every rank
    else:
        state = model.state_dict()
    params = {k.removeprefix("net."): (state[k].detach() - v).float().flatten() for k, v in init.items()}
    flat = torch.cat(list(params.values()))
    same = all(torch.equal(flat, other) for other in trainer.strategy.all_gather(flat))
    decisions = {k: d.value for k, d in trainer.strategy.decisions.items() if "precision" in k}
    return {k: v.tolist() for k, v in params.items()}, decisions, same


def main(out: Path) -> None:
    first, *_, first_bn = fit(out, 3, resume=False)
    trainer, model, lr, ckpt, bn = fit(out, 5, resume=True)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    precisions = {
        "ddp": moved(SoloDDP(sync_batchnorm=False)),
        "fsdp32": moved(SoloFSDP(min_num_params=100, precision="32-true")),
        "fsdp_bf16": moved(SoloFSDP(min_num_params=100, precision="bf16-mixed")),
    }
    if trainer.global_rank != 0:
        return
    manifest = consolidate(ckpt.last_model_path, out / "consolidated.ckpt")
    plain = net()
    state = torch.load(out / "consolidated.ckpt", weights_only=True)["state_dict"]
    plain.load_state_dict({k.removeprefix("net."): v for k, v in state.items()})
    same = all(torch.equal(plain.state_dict()[k.removeprefix("net.")], v) for k, v in full.items())
    result = {
        "decisions": {k: d.value for k, d in {**trainer.strategy.decisions, **lr.decisions}.items()},
        "first_fit_steps": first.global_step,
        "resumed_from": model.start_step,
        "global_step": trainer.global_step,
        "first_lr": model.first_lr,
        "last": ckpt.last_model_path,
        "checkpoints": sorted(p.name for p in (out / "ckpt").iterdir()),
        "consolidated_step": manifest["global_step"],
        "consolidated_equals_trained": same,
        "sharded_param": type(next(model.parameters())).__name__,
        "first_fit_bn_strategy": first.strategy.decisions["bn_stats"].value,
        "first_fit_bn_mean": first_bn,
        "bn_mean": bn,
        "precisions": precisions,
    }
    (out / "result.json").write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
