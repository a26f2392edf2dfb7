"""Preflight's pure checks as tables (the ranks' facts compared, launch variables, backend, setup warnings), and
the setup warnings read from a real single-process fit."""

from __future__ import annotations

import dataclasses

import lightning as L
import pytest
import torch
from torch import nn

from lightning_solo.app.preflight.machine import check_machine, format_report, preflight_device
from lightning_solo.callbacks import Preflight
from lightning_solo.core.cluster import PreflightError
from lightning_solo.diagnostics.checks.agreement import disagreements, shared_devices
from lightning_solo.diagnostics.checks.facts import RankFacts, shared_facts
from lightning_solo.diagnostics.checks.finding import Finding, merge
from lightning_solo.diagnostics.checks.launch_env import check_backend, check_launch_env
from lightning_solo.diagnostics.checks.setup_checks import TrainingSetup, check_setup
from tests.helpers.modules import TinyModule

V = {"torch": "2.14.1", "nccl": "2.27.3", "env.NCCL_PROTO": None}


@pytest.mark.parametrize(
    ("facts", "ignore", "expected"),
    [
        ([V, V, V], (), []),
        # one rank off: that rank is named, with both values
        (
            [V, {**V, "torch": "2.14.0"}, V],
            (),
            [("agree.torch", (1,), ["'2.14.0' on rank 1", "'2.14.1' on ranks 0, 2"])],
        ),
        # a tie: the ranks off rank 0's value are the odd ones
        (
            [V, {**V, "env.NCCL_PROTO": "Simple"}],
            (),
            [("agree.env.NCCL_PROTO", (1,), ["'Simple' on rank 1", "Export"])],
        ),
        # the majority is the reference even when rank 0 is the odd one
        ([{**V, "nccl": "2.21"}, V, V], (), [("agree.nccl", (0,), ["'2.21' on rank 0", "Install the same"])]),
        # a fact one rank lacks counts as None; two facts differ: two findings, sorted by name
        (
            [V, {"torch": "x"}],
            (),
            [("agree.nccl", (1,), ["None on rank 1"]), ("agree.torch", (1,), ["'x' on rank 1"])],
        ),
        ([V, {**V, "torch": "x"}], ("torch",), []),
    ],
)
def test_disagreements_name_the_odd_ranks_and_the_values(facts, ignore, expected):
    found = disagreements(facts, ignore)
    assert [(f.check, f.ranks) for f in found] == [(c, r) for c, r, _ in expected]
    for f, (_, _, words) in zip(found, expected):
        assert f.error and all(w in f.message for w in words), f.message


def _rank(rank, host="a", local=None, gpu=None):
    return RankFacts(rank=rank, host=host, local_rank=local, device="cuda", device_id=gpu, shared={})


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        ([_rank(0, local=0, gpu="G0"), _rank(1, local=1, gpu="G1")], []),
        ([_rank(0, local=0, gpu="G0"), _rank(1, host="b", local=0, gpu="G0")], []),  # other host: fine
        ([_rank(0, local=0, gpu="G0"), _rank(1, local=1, gpu="G0")], [("placement.gpu", (0, 1))]),
        ([_rank(0, local=0), _rank(1, local=0), _rank(2, local=1)], [("placement.local_rank", (0, 1))]),
        (
            [dataclasses.replace(_rank(r, local=0), device="cpu") for r in (0, 1)],
            [],
        ),  # CPU "nodes" on one host
    ],
)
def test_ranks_sharing_a_device_are_named(ranks, expected):
    assert [(f.check, f.ranks) for f in shared_devices(ranks)] == expected


@pytest.mark.parametrize(
    ("env", "kwargs", "expected"),
    [
        ({}, {}, []),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}, {}, []),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, {}, ["env.RANK"]),
        ({"RANK": "one", "WORLD_SIZE": "2"}, {}, ["env.RANK"]),
        ({"RANK": "0"}, {}, ["env.WORLD_SIZE"]),
        ({"RANK": "1", "WORLD_SIZE": "2"}, {}, ["env.MASTER_ADDR", "env.MASTER_PORT"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "70000"}, {}, ["env.MASTER_PORT"]),
        ({"LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "4"}, {}, ["env.LOCAL_RANK"]),
        ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, {}, ["env.LOCAL_WORLD_SIZE"]),
        # srun's and torchrun-style variables disagree (no torchrun: SLURM's are the launch)
        ({"SLURM_PROCID": "3", "RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, {}, ["env.RANK"]),
        # under torchrun inside an allocation, SLURM's variables describe the allocation, not the ranks
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "h",
          "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"}, {}, []),
        # a stale variable: the environment says rank 3, the process group says rank 1
        ({"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, {"placement": {"RANK": 1}}, ["env.RANK"]),
        ({"LOCAL_RANK": "2"}, {"gpus_visible": 2}, ["env.LOCAL_RANK"]),
    ],
)  # fmt: skip
def test_launch_variables(env, kwargs, expected):
    assert [f.check for f in check_launch_env(env, **kwargs)] == expected


@pytest.mark.parametrize(
    ("backend", "device", "error"),
    [("gloo", "cpu", None), ("nccl", "cuda", None), ("nccl", "cpu", True), ("gloo", "cuda", False),
     ("cpu:gloo,cuda:nccl", "cpu", None), ("cuda:nccl", "cpu", True), (None, "cpu", None)],
)  # fmt: skip
def test_backend_suits_the_device(backend, device, error):
    found = check_backend(backend, device)
    assert (found.error if found else None) is error


GPU = TrainingSetup(device_type="cuda", world_size=8, cores_per_process=1, per_device_batch=64, num_workers=4,
                    pin_memory=True, map_style=True, sharded=True)  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "expected", "fix"),
    [
        ({}, [], None),
        ({"data_parallel": ("backbone",)}, ["model.data_parallel"], "Remove the wrapper"),
        ({"num_workers": 0, "cores_per_process": 6}, ["loader.num_workers"], "DataLoader(num_workers=5)"),
        ({"num_workers": 0, "cores_per_process": 1}, [], None),  # no idle core to give
        ({"sharded": False}, ["loader.sampler"], "use_distributed_sampler=True"),
        ({"sharded": False, "world_size": 1}, [], None),
        ({"sharded": False, "map_style": False}, [], None),  # an iterable dataset shards itself
        ({"unsynced_batchnorm": 20, "per_device_batch": 16}, ["model.batchnorm"], "sync_batchnorm"),
        ({"unsynced_batchnorm": 20}, [], None),  # 64 per device: local statistics suffice
        ({"pin_memory": False}, ["loader.pin_memory"], "DataLoader(pin_memory=True)"),
        ({"pin_memory": False, "device_type": "cpu"}, [], None),
        ({"per_device_batch": 4}, ["loader.batch_size"], "accumulate_grad_batches"),
    ],
)  # fmt: skip
def test_setup_warnings_carry_their_fix(changes, expected, fix):
    from dataclasses import replace

    found = check_setup(replace(GPU, **changes))
    assert [f.check for f in found] == expected
    assert all(not f.error for f in found)
    if fix:
        assert fix in found[0].message


def test_merge_lists_every_rank_that_found_the_same():
    a, b = Finding("x", "same"), Finding("y", "other")
    merged = merge([(0, [a]), (1, [a, b]), (2, [])])
    assert [(f.check, f.ranks) for f in merged] == [("x", (0, 1)), ("y", (1,))]


def test_shared_facts_hold_versions_and_the_flags_that_must_agree(monkeypatch):
    monkeypatch.setenv("NCCL_PROTO", "Simple")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")  # logging may differ between ranks
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")  # interface names are per host
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    facts = shared_facts(torch.device("cpu"))
    assert facts["torch"] == torch.__version__ and facts["lightning"] == L.__version__
    assert facts["env.NCCL_PROTO"] == "Simple" and facts["cuda_visible_devices"] == "3"
    assert "env.NCCL_DEBUG" not in facts and "env.NCCL_SOCKET_IFNAME" not in facts


class _Wrapped(TinyModule):
    def __init__(self):
        super().__init__(samples=8, batch_size=4)
        self.head = nn.DataParallel(nn.Linear(1, 1))


def test_strict_preflight_stops_a_fit_on_its_setup_warnings(tmp_path, monkeypatch):
    # One process on this machine's cores (>= 2): DataParallel and num_workers=0 both warn; strict makes them errors.
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(4)))
    kwargs = dict(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    with pytest.raises(PreflightError, match=r"(?s)model\.data_parallel.*loader\.num_workers.*num_workers=2"):
        L.Trainer(callbacks=[Preflight(strict=True)], **kwargs).fit(_Wrapped())
    lenient = Preflight()
    with pytest.warns(UserWarning, match="DataParallel"):
        L.Trainer(callbacks=[lenient], **kwargs).fit(_Wrapped())
    assert [f.check for f in lenient.findings] == ["model.data_parallel", "loader.num_workers"]
    assert lenient.decisions["preflight"].value == "2 warning(s)"
    assert "1 rank(s) agree on torch" in lenient.decisions["preflight"].reason


def test_the_machine_check_alone_reports_this_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    every, findings = check_machine()
    assert len(every) == 1 and every[0].shared["torch"] == torch.__version__ and findings == []
    report = format_report(every, findings)
    assert "one process: run it under torchrun or srun" in report and report.endswith(
        "preflight passed: 0 error(s), 0 warning(s)"
    )


@pytest.mark.parametrize(
    ("local_rank", "gpus_visible", "device"),
    [
        (None, None, "cpu"),  # no GPU
        (1, None, "cpu"),
        (0, 1, "cuda:0"),
        (3, 4, "cuda:3"),
        (1, 1, "cpu"),  # LOCAL_RANK past the visible GPUs: read the facts on the CPU, report the finding
        (4, 4, "cpu"),
    ],
)
def test_preflight_reads_its_facts_where_it_can_and_reports_the_rest(local_rank, gpus_visible, device):
    assert str(preflight_device(local_rank, gpus_visible)) == device
    if device == "cpu" and gpus_visible:
        env = {
            "RANK": str(local_rank),
            "WORLD_SIZE": "8",
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": "8",
        }
        found = {f.check: f.message for f in check_launch_env(env, gpus_visible=gpus_visible)}
        assert f"{gpus_visible} GPU(s) are visible" in found["env.LOCAL_RANK"], found
