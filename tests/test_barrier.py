"""SoloDDP.barrier: a rank that never arrives is named, within the collective timeout, instead of a hang."""

import time
import warnings
from datetime import timedelta

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_solo import SoloDDP
from lightning_solo.core.cluster import gloo_interface_warning
from lightning_solo.ddp.comm.barrier import backend_for, barrier_group, gloo_group, monitored_barrier
from tests.distributed import run_ranks
from tests.helpers.modules import TinyModule


def _late_rank_two(rank: int, world_size: int) -> str:
    timeout = timedelta(seconds=1.5)
    group, _ = barrier_group(timeout)
    monitored_barrier("everyone", timeout, group)  # all arrive: passes
    if rank == 2:
        time.sleep(3)
    try:
        monitored_barrier("late", timeout, group)
    except RuntimeError as err:
        return str(err)
    return "passed"


@pytest.mark.multiproc
@pytest.mark.timeout(40)
def test_monitored_barrier_names_every_missing_rank():
    r0, r1, _ = run_ranks(_late_rank_two, 3)
    assert "barrier 'late' timed out after 1.5 s: rank(s) [2] did not arrive" in r0
    assert "rank 0's error names the ranks" in r1


class SleepyRankOne(TinyModule):
    def __init__(self):
        super().__init__((2, 1), lr=0.1, samples=8)

    def on_train_start(self):
        if self.global_rank == 1:
            time.sleep(6)
        self.trainer.strategy.barrier("after_sleep")


@pytest.mark.multiproc
def test_soloddp_barrier_names_the_sleeping_rank():
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SoloDDP(start_method="fork", timeout=3),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.monotonic()
    with pytest.raises(Exception, match=r"barrier 'after_sleep' timed out after 3 s: rank\(s\) \[1\] did not arrive"):
        trainer.fit(SleepyRankOne())
    assert time.monotonic() - start < 30


def _side_group_paths(rank: int, world_size: int) -> dict:
    cpu, timeout = torch.device("cpu"), timedelta(seconds=30)
    out = {}
    # The world of "nccl"/"cuda:nccl,cpu:gloo" jobs, told by the backend string (the world here is gloo).
    group, decision = barrier_group(timeout, backend="nccl", device=cpu)
    monitored_barrier("side", timeout, group)
    out["made"] = (group is not dist.group.WORLD and group is not None, decision.value)
    # A later strategy in the same default group reuses it (a group per strategy kept its threads after the fit).
    again, _ = barrier_group(timeout, backend="nccl", device=cpu)
    out["shared"] = (again is group, gloo_group("solo_side", timeout) is group)
    group, decision = barrier_group(timeout, backend="cuda:nccl,cpu:gloo", device=cpu)
    out["mixed"] = (group is dist.group.WORLD, decision.value)
    group, decision = barrier_group(timeout, side_group=False, backend="nccl", device=cpu)
    out["off"] = (group, decision.value, decision.reason)

    def unreachable(create_timeout):
        if rank == 1:  # e.g. gloo bound to loopback: this rank fails, rank 0 waits for it and times out
            raise RuntimeError("Gloo connectFullMesh failed")
        return dist.new_group(backend="gloo", timeout=create_timeout)

    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        group, decision = barrier_group(
            timeout, backend="nccl", device=cpu, create=unreachable, create_timeout=timedelta(seconds=2)
        )
    out["failed"] = (group, decision.value, decision.reason, time.monotonic() - start)
    out["warned"] = [str(w.message) for w in caught if "no gloo side group" in str(w.message)]
    return out


@pytest.mark.multiproc
def test_gloo_side_group_made_turned_off_or_fallen_back_on_every_rank():
    for rank, out in enumerate(run_ranks(_side_group_paths, 2)):
        assert out["made"] == (True, "monitored (gloo side group)")
        assert out["shared"] == (True, False)  # the same group again; another name, another group
        assert out["mixed"] == (True, "monitored")
        assert out["off"][:2] == (None, "plain") and "gloo_side_group=False" in out["off"][2]
        group, value, reason, seconds = out["failed"]
        assert group is None and value == "plain" and seconds < 15  # not the 30 s collective timeout
        assert "GLOO_SOCKET_IFNAME" in reason
        assert ("connectFullMesh" if rank == 1 else "DistStoreError") in reason
        # Loud, not quiet: each rank (rank 0; rank 1 with its own error) warns once, naming every feature that now
        # goes without the side group and what it falls back to, as the decision does.
        [warned] = out["warned"]
        for feature, fallback in (
            ("monitored barrier", "plain"),
            ("fast path", "find_unused_parameters=True"),
            ("SIGTERM agreement", "per-batch broadcast"),
            ("uneven_data", "as stock"),
            ("SlurmRequeue", "synchronous"),
        ):
            assert feature in warned and fallback in warned and feature in reason and fallback in reason


def test_backend_strings_and_gloo_interface_check():
    assert backend_for("cuda:nccl,cpu:gloo", "cpu") == "gloo" and backend_for("cuda:nccl,cpu:gloo", "cuda") == "nccl"
    assert backend_for("nccl", "cuda") == "nccl" and backend_for("cuda:nccl", "cpu") is None
    loopback = gloo_interface_warning("node7", ifname="", resolve=lambda host: "127.0.1.1")
    assert "loopback address 127.0.1.1" in loopback and "GLOO_SOCKET_IFNAME" in loopback
    assert gloo_interface_warning("node7", ifname="", resolve=lambda host: "10.0.0.7") is None
    assert gloo_interface_warning("node7", ifname="ib0", resolve=lambda host: "127.0.0.1") is None
