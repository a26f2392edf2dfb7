"""Gradient communication hooks (lightning_solo.ddp.comm, SoloDDP(comm_hook=...)) in 2 real gloo processes.

Raw-DDP checks run under tests/distributed.run_ranks and compare every hook with an exact all-reduce computed
on the side; the Lightning checks go through SoloDDP's fork launcher and write what each rank saw to files
in tmp_path for the parent to compare.
"""

import json
from pathlib import Path

import hydra
import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from lightning_solo import SoloDDP
from lightning_solo.checkpoint.rank_shards import read, shard_dir
from lightning_solo.ddp.comm import CHECKPOINT_KEY, CommHook
from lightning_solo.ddp.comm import hooks as hooks_module
from lightning_solo.ddp.comm.hooks import COMM_HOOKS, post_local
from tests.distributed import run_ranks
from tests.helpers import composed
from tests.helpers.modules import TinyModule
from tests.helpers.records import RankRecorder, read_rank_records


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).clone()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------- validation, no processes


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"comm_hook": "fp8"}, "'fp16', 'bf16', 'powersgd', 'post_local_sgd'"),
        ({"comm_hook": "batched_powersgd"}, "'powersgd'"),
        ({"bucket_cap_mb": -1}, "positive number of megabytes"),
        ({"bucket_cap_mb": 0}, "positive number of megabytes"),
        ({"comm_hook": "powersgd", "powersgd_rank": 0}, "powersgd_rank must be a positive integer, got 0"),
        ({"comm_hook": "powersgd", "powersgd_start_iter": 1}, "integer >= 2"),
        (
            {"comm_hook": "post_local_sgd", "local_sgd_period": 0},
            "local_sgd_period must be a positive integer, got 0",
        ),
        ({"comm_hook": "post_local_sgd", "local_sgd_warmup": -1}, "integer >= 0"),
        ({"comm_hook": "fp16", "ddp_comm_hook": lambda state, bucket: None}, "not both"),
    ],
)
def test_bad_options_raise_value_error_listing_accepted_values(kwargs, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(")):
        SoloDDP(**kwargs)


def test_batched_powersgd_is_not_offered():
    assert "batched_powersgd" not in COMM_HOOKS and "powersgd" in COMM_HOOKS


# ---------------------------------------------------------------- raw DDP, 2 gloo ranks


def _powersgd_resume_across_rebucketing(rank: int, ckpt: str) -> dict:
    """6 PowerSGD steps straight vs 3 + save + fresh DDP/hook + load + 3. DDP's first iteration after the
    restore uses one bucket in forward order, later ones two buckets in gradient order: the restored error
    feedback and Q memory must follow the parameters, not the bucket indices."""

    def start(state=None, weights=None):
        net = make_net()
        if weights is not None:
            net.load_state_dict(weights)
        ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.001)
        hook = CommHook("powersgd", powersgd_start_iter=2)
        hook.load_state_dict(state, ckpt)
        hook.register(ddp)
        return net, ddp, hook, torch.optim.SGD(ddp.parameters(), lr=0.1)

    def train(ddp, opt, steps):
        for step in steps:
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * step + rank))
            opt.zero_grad()
            ddp(x).pow(2).sum().backward()
            opt.step()

    net, ddp, hook, opt = start()
    train(ddp, opt, range(6))
    straight, straight_state = flat(net), hook.state_dict()
    net, ddp, hook, opt = start()
    train(ddp, opt, range(3))
    saved = [hook.state_dict(ckpt), net.state_dict()]  # each rank writes its error-feedback shard
    dist.broadcast_object_list(saved, src=0)  # what every rank reads back from rank 0's checkpoint
    net, ddp, hook, opt = start(*saved)
    train(ddp, opt, range(3, 6))
    resumed_state = hook.state_dict()
    result = {"param_diff": (flat(net) - straight).abs().max().item(), "iter": resumed_state["iter"]}
    # Without a checkpoint path the state holds every rank's error feedback, gathered (a notebook's next fit).
    pairs = [(a, resumed_state["error"][rank][k]) for k, a in straight_state["error"][rank].items()]
    pairs += [(a, resumed_state["q"][k]) for k, a in straight_state["q"].items()]
    result["state_diff"] = max((a - b).abs().max().item() for a, b in pairs)
    result["state_entries"] = len(pairs)
    return result


def _hooks_against_exact_allreduce(rank: int, world_size: int, ckpt: str) -> dict:
    out: dict = {}
    for name, cap in (("fp16", 25), ("bf16", 25), ("powersgd", 0.001)):  # several buckets for PowerSGD
        ref, net = make_net(), make_net()
        ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=cap)
        hook = CommHook(name, powersgd_start_iter=2)
        decision = hook.register(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        errors = []
        for step in range(5):
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            opt.zero_grad()
            ddp(x).pow(2).sum().backward()
            ref.zero_grad()
            ref.load_state_dict(net.state_dict())
            ref(x).pow(2).sum().backward()
            exact = torch.cat([p.grad.flatten() for p in ref.parameters()])
            dist.all_reduce(exact)
            exact /= world_size
            errors.append(rel(torch.cat([p.grad.flatten() for p in net.parameters()]), exact))
            opt.step()
        out[name] = {
            "logged": ddp._get_ddp_logging_data().get("comm_hook"),
            "decision": decision.value,
            "errors": errors,
            "params": torch.cat([p.detach().flatten() for p in net.parameters()]).tolist(),  # no shared memory
        }
    out["resume_across_rebucketing"] = _powersgd_resume_across_rebucketing(rank, ckpt)
    # post-local-SGD counters come back from a state dict on every rank
    net = make_net()
    ddp = nn.parallel.DistributedDataParallel(net)
    hook = CommHook("post_local_sgd", local_sgd_period=3, local_sgd_warmup=2)
    hook.load_state_dict({"hook": "post_local_sgd", "iter": 7, "averager_step": 9})
    out["post_local_sgd"] = {"decision": hook.register(ddp).reason}
    hook.attach_averager(PeriodicModelAverager(period=3, warmup_steps=2))
    out["post_local_sgd"].update(
        logged=ddp._get_ddp_logging_data().get("comm_hook"), iter=hook.state.iter, step=hook.averager.step
    )
    return out


@pytest.mark.multiproc
def test_hooks_registered_on_cpu_and_close_to_exact_allreduce(tmp_path):
    r0, r1 = run_ranks(_hooks_against_exact_allreduce, 2, str(tmp_path / "raw.ckpt"))
    for name, low, high in (("fp16", 1e-6, 2e-3), ("bf16", 1e-4, 2e-2)):
        assert r0[name]["logged"] == f"{name}_compress_hook" and r0[name]["decision"] == name
        # compressed (not exact) but within the format's precision
        assert all(low < e < high for e in r0[name]["errors"]), (name, r0[name]["errors"])
        assert r0[name]["params"] == r1[name]["params"]
    psgd = r0["powersgd"]
    assert psgd["logged"] == "resumable_powerSGD_hook"
    assert max(psgd["errors"][:2]) < 1e-6  # exact all-reduce before start_powerSGD_iter
    assert min(psgd["errors"][2:]) > 1e-3  # low-rank compression afterwards
    assert psgd["params"] == r1["powersgd"]["params"]
    # error feedback for 6 parameters on each rank (its own shard), Q memory for the 3 compressed matrices
    for resumed in (r0["resume_across_rebucketing"], r1["resume_across_rebucketing"]):
        assert resumed["iter"] == 6 and resumed["state_entries"] == 6 + 3
        assert resumed["state_diff"] == 0.0 and resumed["param_diff"] == 0.0
    local = r0["post_local_sgd"]
    assert local["logged"] == "post_localSGD_hook" and "no gradient communication" in local["decision"]
    assert (local["iter"], local["step"]) == (7, 9)


def _post_local_sgd_nodes_and_layout(rank: int, world_size: int) -> dict:
    torch.manual_seed(rank)  # every rank starts from different parameters: the average is visible
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 2, 1)).to(memory_format=torch.channels_last)
    net.append(nn.Linear(2048, 2100))  # a 17 MB weight: averaged on its own, in place (the rest in one buffer)
    start = [p.detach().clone() for p in net.parameters()]
    ddp = nn.parallel.DistributedDataParallel(net)  # broadcasts rank 0's parameters
    for p, mine in zip(net.parameters(), start):
        p.data.copy_(mine)
    hook = CommHook("post_local_sgd", local_sgd_period=2, local_sgd_warmup=0)
    decision = hook.register(ddp, node=f"node{rank % 2}")  # SLURM's cyclic layout: nodes 0,1,0,1
    averager = hook.attach_averager(PeriodicModelAverager(period=2, warmup_steps=0))
    storage = [p.data_ptr() for p in net.parameters()]
    averager.average_parameters(iter(list(net.parameters())))  # step 0: averages
    expected = []
    for mine in start:
        total = mine.clone()
        dist.all_reduce(total)
        expected.append(total / world_size)
    return {
        "subgroup": dist.get_process_group_ranks(hook.state.subgroup),
        "decision": decision.reason,
        "channels_last": net[0].weight.is_contiguous(memory_format=torch.channels_last),
        "same_storage": storage == [p.data_ptr() for p in net.parameters()],
        "avg_err": max((p - e).abs().max().item() for p, e in zip(net.parameters(), expected)),
    }


@pytest.mark.multiproc
def test_post_local_sgd_groups_by_real_node_and_averages_in_place():
    for rank, out in enumerate(run_ranks(_post_local_sgd_nodes_and_layout, 4)):
        assert out["subgroup"] == [rank % 2, rank % 2 + 2], out
        assert "within each of 2 nodes (2 ranks)" in out["decision"]
        assert out["channels_last"] and out["same_storage"] and out["avg_err"] < 1e-6, out


# ---------------------------------------------------------------- through Lightning (fork launcher)


def _ddp_comm_hook(trainer, module) -> str | None:
    return trainer.strategy.model._get_ddp_logging_data().get("comm_hook")


def _recorder(out: Path) -> RankRecorder:
    """Per rank: the hook DDP registered, the parameters after each step and at the end, the decisions, the
    hook's state (a collective for PowerSGD: all ranks are in on_fit_end)."""
    return RankRecorder(
        out,
        on_train_start={"logged": _ddp_comm_hook},
        on_train_batch_end={"steps": "params"},
        on_fit_end={
            "decisions": "decisions",
            "final": "params",
            "hook_state": lambda trainer, module: trainer.strategy.comm_hook.state_dict(),
        },
        suffix=".pt",
    )


# make_net's layers and init, under MSE on seeded random data
TINY = dict(widths=(8, 16, 16, 4), init_seed=0, loss="mse", samples=64, batch_size=4, data_seed=1, lr=0.1)


def fit(
    out: Path,
    max_epochs: int = 1,
    ckpt_path=None,
    save: bool = False,
    momentum: float = 0.0,
    **strategy_kwargs,
) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    callbacks = [_recorder(out)]
    if save:
        callbacks.append(ModelCheckpoint(dirpath=out, filename="{epoch}", save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SoloDDP(start_method="fork", **strategy_kwargs),
        max_epochs=max_epochs,
        callbacks=callbacks,
        enable_checkpointing=save,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyModule(**TINY, momentum=momentum), ckpt_path=ckpt_path)
    return read_rank_records(out, suffix=".pt")


@pytest.mark.multiproc
def test_lightning_registers_fp16_on_cpu(tmp_path):
    r0, r1 = fit(tmp_path, comm_hook="fp16")
    assert r0["logged"] == r1["logged"] == "fp16_compress_hook"  # stock Lightning drops it on CPU
    assert r0["decisions"]["comm_hook"]["value"] == "fp16"
    assert "monitored" in r0["decisions"]["barrier"]["value"]
    assert torch.equal(r0["final"], r1["final"])


@pytest.mark.multiproc
@pytest.mark.timeout(90)
def test_powersgd_resume_continues_iteration_and_error_feedback(tmp_path):
    opts = {"comm_hook": "powersgd", "powersgd_start_iter": 3}
    full = fit(tmp_path / "full", max_epochs=2, **opts)
    fit(tmp_path / "first", max_epochs=1, save=True, **opts)
    ckpt = tmp_path / "first" / "epoch=0.ckpt"
    saved = torch.load(ckpt, weights_only=True)[CHECKPOINT_KEY]
    # 8 steps; no rank's error feedback in rank 0's file: one shard per rank beside it, hashed in it
    assert saved["iter"] == 8 and "error" not in saved and len(saved["shards"]["sha256"]) == 2
    shards = sorted(Path(shard_dir(ckpt)).glob("rank*.pt"))
    assert [f.name[:6] for f in shards] == ["rank0.", "rank1."]
    errors = [torch.load(f, weights_only=True) for f in shards]
    assert not torch.equal(errors[0]["trunk.0.weight"], errors[1]["trunk.0.weight"])
    resumed = fit(tmp_path / "resumed", max_epochs=2, ckpt_path=str(ckpt), **opts)

    assert full[0]["logged"] == resumed[0]["logged"] == "resumable_powerSGD_hook"
    assert full[0]["hook_state"]["iter"] == resumed[0]["hook_state"]["iter"] == 16
    for rank in range(2):  # each rank's own error feedback continued as if never interrupted
        a, b = full[rank]["hook_state"], resumed[rank]["hook_state"]
        for name, err in a["error"][rank].items():  # every rank's, gathered
            torch.testing.assert_close(b["error"][rank][name], err, rtol=1e-5, atol=1e-7)
    for name, q in a["q"].items():
        torch.testing.assert_close(b["q"][name], q, rtol=1e-5, atol=1e-7)
    for rank in range(2):
        torch.testing.assert_close(resumed[rank]["final"], full[rank]["final"], rtol=1e-5, atol=1e-7)
    assert torch.equal(resumed[0]["final"], resumed[1]["final"])

    # Self-verifying: a damaged or missing shard is a clear error naming the rank, not a silent zero.
    assert (
        read(ckpt, saved["shards"], 1, "PowerSGD error feedback").keys() == errors[1].keys()
    )  # memory-mapped, this rank's only
    shards[1].write_bytes(shards[1].read_bytes()[:-8] + b"damaged!")
    with pytest.raises(RuntimeError, match=r"rank 1 .* does not match the sha256"):
        read(ckpt, saved["shards"], 1, "PowerSGD error feedback")
    shards[0].unlink()
    with pytest.raises(RuntimeError, match=r"rank 0 .* is missing"):
        read(ckpt, saved["shards"], 0, "PowerSGD error feedback")


@pytest.mark.multiproc
def test_post_local_sgd_averages_with_configured_period(tmp_path):
    warmup, period = 2, 3
    r0, r1 = fit(tmp_path, save=True, comm_hook="post_local_sgd", local_sgd_warmup=warmup, local_sgd_period=period)
    assert r0["logged"] == "post_localSGD_hook"
    steps = len(r0["steps"])
    assert steps == 8
    same = [torch.equal(a, b) for a, b in zip(r0["steps"], r1["steps"])]
    expected = [k < warmup or (k - warmup) % period == 0 for k in range(steps)]
    assert same == expected
    assert torch.equal(r0["final"], r1["final"])  # averaged once more at the end of fit
    saved = torch.load(tmp_path / "epoch=0.ckpt", weights_only=True)[CHECKPOINT_KEY]
    # torch's PostLocalSGDState counts only up to the end of the warm-up; the averager counts every step
    assert saved.pop("replicas")["dir"] == "epoch=0.ckpt.local_sgd"  # saved after a local step
    assert saved == {"hook": "post_local_sgd", "iter": warmup, "averager_step": steps}
    assert json.dumps(r0["decisions"]["comm_hook"])  # recorded for the run summary


HOOK_CALLS = {"last_bucket": 0}  # post_localSGD_hook's calls on the last bucket, in this (forked) rank
_torch_post_local_sgd_hook = hooks_module.post_local.post_localSGD_hook


def _counted_post_local_sgd_hook(state, bucket):
    HOOK_CALLS["last_bucket"] += bucket.is_last()
    return _torch_post_local_sgd_hook(state, bucket)


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_post_local_sgd_resume_between_averages_continues_every_replica(tmp_path):
    # 8 steps an epoch; averages after steps 2, 6, 10, 14: the checkpoint after step 7 holds differing replicas,
    # each with its own momentum. A resume from rank 0's model alone would not continue like the full run.
    opts = dict(comm_hook="post_local_sgd", local_sgd_warmup=2, local_sgd_period=4, momentum=0.9)
    full = fit(tmp_path / "full", max_epochs=2, **opts)
    first = fit(tmp_path / "first", max_epochs=1, save=True, **opts)
    ckpt = tmp_path / "first" / "epoch=0.ckpt"
    assert not torch.equal(first[0]["steps"][-1], first[1]["steps"][-1])  # saved between averages
    saved = torch.load(ckpt, weights_only=True)[CHECKPOINT_KEY]
    shards = list(Path(shard_dir(ckpt, "local_sgd")).glob("rank*.pt"))
    assert len(saved["replicas"]["sha256"]) == len(shards) == 2
    resumed = fit(tmp_path / "resumed", max_epochs=2, ckpt_path=str(ckpt), **opts)

    for rank in range(2):  # every replica continued as if never interrupted
        for a, b in zip(resumed[rank]["steps"], full[rank]["steps"][8:], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(resumed[rank]["final"], full[rank]["final"], rtol=1e-6, atol=1e-7)

    # Without its shards the checkpoint is refused with the rank named, not silently resumed from rank 0's model.
    for shard in Path(shard_dir(ckpt, "local_sgd")).glob("rank1.*.pt"):
        shard.unlink()
    with pytest.raises(Exception, match=r"post-local-SGD replica .* of rank 1 .* is missing"):
        fit(tmp_path / "broken", max_epochs=2, ckpt_path=str(ckpt), **opts)


class _ValidatedWithBatchNorm(TinyModule):
    """TinyModule with BatchNorm, validated inside the epoch; each rank keeps its own validation losses (they
    depend on its running statistics, which DDP broadcasts from rank 0)."""

    def __init__(self) -> None:
        super().__init__(**TINY, batchnorm=True)
        self.val_losses: list[float] = []

    def val_dataloader(self):
        return self.train_dataloader()

    def validation_step(self, batch, batch_idx):
        self.val_losses.append(self.batch_loss(batch).item())


def _post_local_sgd_fit(out: Path) -> list[dict]:
    out.mkdir(parents=True)
    recorder = RankRecorder(
        out,
        on_train_batch_end={"steps": "params"},
        on_fit_end={
            "state": "state",  # buffers too
            "val": lambda trainer, module: module.val_losses,
            "hook_calls": lambda trainer, module: HOOK_CALLS["last_bucket"],
        },
        suffix=".pt",
    )
    strategy = SoloDDP(
        start_method="fork",
        sync_batchnorm=False,
        comm_hook="post_local_sgd",
        local_sgd_warmup=2,
        local_sgd_period=3,
    )
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, accumulate_grad_batches=2,
        val_check_interval=4, limit_val_batches=2, callbacks=[recorder], logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, default_root_dir=out,
    )  # fmt: skip
    trainer.fit(_ValidatedWithBatchNorm())
    return read_rank_records(out, suffix=".pt")


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_post_local_sgd_local_steps_skip_the_reducer_and_match_torchs_hook(tmp_path, monkeypatch):
    # After the warm-up SoloDDP runs the local steps outside DDP's reducer; torch's hook on every step is the
    # reference: the same parameters at every micro-batch, the same buffers (BatchNorm statistics broadcast
    # from rank 0 as DDP does) and validation losses on every rank. With accumulation (Lightning's own no_sync
    # around the first micro-batch), validation inside the epoch, and two epochs.
    monkeypatch.setattr(hooks_module.post_local, "post_localSGD_hook", _counted_post_local_sgd_hook)
    fast = _post_local_sgd_fit(tmp_path / "fast")
    monkeypatch.setattr(CommHook, "local_step", property(lambda self: False))
    reference = _post_local_sgd_fit(tmp_path / "hook")

    assert len(fast[0]["steps"]) == 16  # 8 optimizer steps of 2 micro-batches, 2 epochs
    assert len(fast[0]["val"]) == 10  # the sanity check, then 2 validations per epoch, 2 batches each
    for rank in range(2):
        assert fast[rank]["hook_calls"] == 2  # the warm-up's exact steps only
        assert reference[rank]["hook_calls"] == 8
        for a, b in zip(fast[rank]["steps"], reference[rank]["steps"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(fast[rank]["state"], reference[rank]["state"], rtol=0, atol=0)
        assert fast[rank]["val"] == reference[rank]["val"]
    assert not torch.equal(fast[0]["steps"][-2], fast[1]["steps"][-2])  # local steps: the replicas differ
    final = [
        torch.cat([t.flatten() for k, t in r["state"].items() if "running" not in k and "num_batches" not in k])
        for r in fast
    ]
    assert torch.equal(*final)  # and are averaged at the end


def test_post_local_sgd_save_without_the_other_ranks_says_it_keeps_rank_0s_replica_only():
    hook = CommHook("post_local_sgd", local_sgd_warmup=0)
    hook.state = post_local.PostLocalSGDState(None, None, start_localSGD_iter=0, post_local_gradient_allreduce=False)
    with pytest.warns(UserWarning, match="holds rank 0's replica only"):
        saved = hook.state_dict("last.ckpt", replica=None)  # the exception path: no collective
    assert "replicas" not in saved


def test_hydra_parallelism_group_reaches_the_hook(tmp_path):
    overrides = ["++parallelism.strategy.comm_hook=powersgd", "++parallelism.strategy.powersgd_rank=4"]
    with composed(overrides, tmp_path) as cfg:
        strategy = hydra.utils.instantiate(cfg.parallelism.strategy)
    assert (strategy.comm_hook.name, strategy.comm_hook.powersgd_rank) == ("powersgd", 4)
