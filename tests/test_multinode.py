"""Beyond one machine through torchrun: two "nodes" (two torchrun agents, one process each) on loopback train with
the runner and with ``Trainer(strategy=SoloDDP())``; an elastic restart resumes from the newest verified checkpoint.
The launcher-independent parts (run directory, restart resume, config checks) are tested in-process first."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from lightning_solo.app.config_check import check_config
from lightning_solo.core import cluster
from lightning_solo.core.cluster import PreflightError
from tests.helpers import REPO, TINY_RUN, composed
from tests.helpers.torchrun import torchrun_nodes

# 64 samples, 8 per device, 2 ranks: 4 optimizer steps in the one epoch.
RUN = [*TINY_RUN, "data.batch_size=8", "trainer.enable_progress_bar=false"]
STEPS = 4
TORCHRUN = ["-m", "lightning_solo.run", "parallelism=torchrun", "parallelism.accelerator=cpu"]


def _torchrun_env(**extra: str) -> dict[str, str]:
    return {"TORCHELASTIC_RUN_ID": "none", "RANK": "0", **extra}


def test_run_dir_is_agreed_before_hydra_runs():
    # No external launcher: the command line is left to Hydra (and to Lightning's popen launcher).
    assert cluster.decide_run_dir(["a=1"], env={}) == (["a=1"], None)
    # SLURM: the job id (array-aware), the same on every task and after a requeue; rank > 0 writes no .hydra/.
    slurm = {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "77", "SLURM_PROCID": "1"}
    args, decision = cluster.decide_run_dir([], env=slurm)
    assert args == [
        "hydra.run.dir=${paths.log_dir}/${task_name}/slurm-77",
        "hydra.output_subdir=null",
        "hydra.job.name=train_ddp_process_1",
    ]
    assert decision.value == "slurm-77"
    array = {**slurm, "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3", "SLURM_PROCID": "0"}
    assert cluster.decide_run_dir([], env=array)[0] == ["hydra.run.dir=${paths.log_dir}/${task_name}/slurm-70_3"]
    # An interactive allocation is not a SLURM launch (Lightning's rule); a directory given by the user stays.
    assert cluster.decide_run_dir([], env={**slurm, "SLURM_JOB_NAME": "bash"})[1] is None
    assert cluster.decide_run_dir(["hydra.run.dir=x"], env=slurm)[0][:1] == ["hydra.run.dir=x"]
    # torchrun without the agent's store: the rendezvous id, or a clear error when there is none.
    no_store = _torchrun_env(TORCHELASTIC_RUN_ID="job9", TORCHELASTIC_USE_AGENT_STORE="False")
    assert cluster.decide_run_dir([], env=no_store)[1].value == "torchrun-job9"
    with pytest.raises(PreflightError, match=r"hydra\.run\.dir"):
        cluster.decide_run_dir([], env=_torchrun_env(TORCHELASTIC_USE_AGENT_STORE="False"))


def test_rank_zero_decides_the_run_dir_through_torchruns_store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    env = _torchrun_env(TORCHELASTIC_USE_AGENT_STORE="True", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port))
    first = cluster.decide_run_dir([], env=env)[1].value
    other = cluster.decide_run_dir([], env={**env, "RANK": "1"})[1].value
    # A restarted rank 0 (a new process, a later time) keeps the first attempt's directory.
    again = cluster.decide_run_dir([], env=env)[1].value
    assert first == other == again


def test_restart_resume_and_store_warning():
    assert cluster.decide_restart_resume(None, env={}) is None
    slurm = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train"}
    assert cluster.decide_restart_resume(None, env=slurm) is None
    assert cluster.decide_restart_resume(None, env={**slurm, "SLURM_RESTART_COUNT": "1"}).value == "auto"
    elastic = _torchrun_env(TORCHELASTIC_MAX_RESTARTS="2", TORCHELASTIC_RESTART_COUNT="0")
    # Every start of a restartable job: an agent's own count can stay 0 while the others restart.
    assert cluster.decide_restart_resume(None, env=elastic).value == "auto"
    assert cluster.decide_restart_resume(None, env={**elastic, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert cluster.decide_restart_resume("path.ckpt", env=elastic) is None  # the user's choice stands
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in cluster.restart_store_warning(
        {**elastic, "TORCHELASTIC_USE_AGENT_STORE": "True"}
    )
    assert cluster.restart_store_warning({**elastic, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None


def test_cluster_parallelism_options_compose_and_need_their_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "3")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8")
    monkeypatch.setenv("SLURM_NNODES", "2")
    with composed(["parallelism=torchrun"], tmp_path) as cfg:
        check_config(cfg)
        assert (cfg.parallelism.devices, cfg.parallelism.num_nodes) == (4, 3)
        env = cfg.parallelism.strategy.cluster_environment
        with pytest.raises(PreflightError, match="not started by a cluster launcher: start it with torchrun"):
            cluster.check_cluster_environment(env, env={})
        cluster.check_cluster_environment(env, env=_torchrun_env())
    with composed(["parallelism=slurm"], tmp_path) as cfg:
        check_config(cfg)
        assert (cfg.parallelism.devices, cfg.parallelism.num_nodes) == (8, 2)
        env = cfg.parallelism.strategy.cluster_environment
        with pytest.raises(PreflightError, match="was started by torchrun"):  # srun torchrun: torchrun's ranks
            cluster.check_cluster_environment(env, env={**_torchrun_env(), "SLURM_NTASKS": "2"})


def _assert_ok(nodes) -> None:
    for node in nodes:
        assert node.returncode == 0, f"node {node.rank} ({node.returncode}):\n{node.output[-4000:]}"


def _run_dir(cwd: Path) -> Path:
    runs = list((cwd / "outputs" / "quick_cpu").iterdir())
    assert len(runs) == 1, f"expected one run directory for all ranks of all nodes, got {runs}"
    return runs[0]


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_trainer_with_solo_ddp_on_two_torchrun_nodes(tmp_path):
    script = str(REPO / "tests" / "scripts" / "multinode_fit.py")
    _assert_ok(torchrun_nodes([script, str(tmp_path / "out")], tmp_path, timeout=160))
    records = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["global_rank"], r["node_rank"], r["local_rank"]) for r in records] == [(0, 0, 0), (1, 1, 0)]
    for record in records:
        assert (record["world_size"], record["num_nodes"]) == (2, 2)
        assert record["cluster_environment"] == "TorchElasticEnvironment"
        assert record["decisions"]["lr_global_batch"] == 16  # 8 per device × 1 device × 2 nodes
        assert record["first_lr"] == pytest.approx(0.8 * 16 / 64)
        assert record["global_step"] == 4 and record["decisions"]["start_method"] == "external"
    assert records[0]["params"] == records[1]["params"], "the ranks of both nodes end with the same model"


@pytest.mark.cli
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_runner_on_two_torchrun_nodes_restarts_and_resumes_from_the_newest_verified_checkpoint(tmp_path):
    # The runner on two torchrun nodes; rank 1 exits once, the agents restart the group, which resumes.
    steps = [
        "+callbacks.checkpoint.every_n_train_steps=2",
        "callbacks.checkpoint.monitor=null",
        "callbacks.checkpoint.save_top_k=1",
        "+callbacks.die._target_=tests.helpers.elastic.DieOnce",  # rank 1 exits at step 3, once
        "+hydra.job.env_set.GLOO_SOCKET_IFNAME=lo",  # docs/multi-node.md's way to set a variable on every rank
    ]
    nodes = torchrun_nodes([*TORCHRUN, *RUN, *steps], tmp_path, timeout=400, max_restarts=1)
    _assert_ok(nodes)
    output = "\n".join(node.output for node in nodes)
    assert "gloo picks its interface" not in output  # GLOO_SOCKET_IFNAME reached every rank
    assert len(list(tmp_path.rglob(".hydra"))) == 1, "only global rank 0 writes .hydra/"
    assert "DieOnce: rank 1 exits at step 3" in output
    run = _run_dir(tmp_path)
    assert run.name == "torchrun-elastic"  # the rendezvous id: the same directory before and after the restart
    assert "newest checkpoint that verifies (global step 2)" in output, "the restarted group logs its resume"
    assert (run / "train_ddp_process_1.log").exists(), "rank 1 (the other node) logs into rank 0's run directory"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == STEPS, "the restarted run ends where an uninterrupted one does"
    assert (summary["world_size"], summary["num_nodes"], summary["devices_per_node"]) == (2, 2, 1)
    assert summary["cluster_environment"] == "TorchElasticEnvironment" and summary["global_batch"] == 16
    decisions = {d["setting"]: d["value"] for d in summary["decisions"]}
    assert decisions["resume"].endswith("checkpoints/last.ckpt")
    assert decisions["resume_after_restart"] == "auto"
    assert decisions["lr_global_batch"] == 16 and decisions["lr_scale"] == pytest.approx(16 / 256)
    assert summary["lr"]["peak"] == pytest.approx(0.2 * 16 / 256)  # model.optimizer.lr × the scale
    assert decisions["run_dir"] == run.name and decisions["start_method"] == "external"
    assert "world size                 2 = 2 node(s) × 1 device(s)" in nodes[0].output
