"""benchmarks/gpu_check.py runs its figures only where a GPU is; here: it parses, without CUDA it says so and stops,
its harness kills a check's whole process group at its limit and runs a bundle of checks in one process, a row each,
its table states the targets; gpu_run.sh, the device's one command, runs end to end on CPU with the multi-rank
scenario. Every check's CPU form: ``bash benchmarks/gpu_run.sh --device cpu`` (benchmarks/README.md)."""

import importlib.util
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_help_lists_every_check_and_the_limits_fit_the_budget(capsys):
    gpu_check = _load()
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    from benchmarks.gpu_checks.harness import rows_of

    rows = rows_of(gpu_check.CHECKS)
    for check in rows:
        assert f"``{check.name}``" in out
    assert len({c.name for c in rows}) == len(rows)
    # defaults_cost right after stage 0, the multi-rank scenario next; the limits add up to the 540 s budget
    assert [c.name for c in rows[:2]] == ["defaults_cost", "multirank"]
    assert sum(entry.budget_s for entry in gpu_check.CHECKS) <= 540


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_cuda_it_skips_with_a_message(tmp_path, capsys):
    gpu_check = _load()
    assert gpu_check.main(["--out", str(tmp_path / "table.md")]) == 0
    assert "SKIPPED, CUDA is not available" in capsys.readouterr().out
    assert not (tmp_path / "table.md").exists()
    rows = [
        {"check": "rng", "status": "PASS", "detail": "a|b", "seconds": 1.0},
        {
            "check": "precision",
            "status": "FAIL",
            "detail": "| precision | img/s |\n|---|---|",
            "seconds": 2.0,
        },
        {"check": "fork", "status": "SKIP", "detail": "no CPU form", "seconds": 0},
    ]
    table = gpu_check.render(rows, "cuda")
    assert "| rng | PASS | 1.0 | a/b |" in table and "| precision | FAIL | 2.0 | table below |" in table
    assert "| fork | SKIP | 0 | no CPU form |" in table and "precision:\n\n| precision | img/s |" in table


def test_a_check_past_its_limit_is_killed_with_its_whole_process_group():
    from benchmarks.gpu_checks.harness import run_group

    # The check starts a process of its own (a rank, a loader worker) and hangs.
    hang = "import subprocess, sys, time; p = subprocess.Popen(['sleep', '120']); print(p.pid, flush=True); time.sleep(120)"
    start = time.monotonic()
    code, out = run_group([sys.executable, "-c", hang], limit=5)
    assert code is None and time.monotonic() - start < 30
    grandchild = int(out.split()[0])
    time.sleep(0.5)
    assert not _running(grandchild)  # no orphan left (holding the GPU, on a GPU machine)


def test_terminating_the_run_kills_the_running_checks_group():
    # An outer timeout sends SIGTERM to gpu_check; the check runs in a session of its own, so without the handler it
    # (and the GPU it holds) would outlive the run.
    hang = "import subprocess, time; p = subprocess.Popen(['sleep', '120']); print(p.pid, flush=True); time.sleep(120)"
    parent = (
        "import sys; from benchmarks.gpu_checks.harness import _terminate_as_exit, run_group\n"
        f"with _terminate_as_exit(): run_group([sys.executable, '-c', {hang!r}], limit=120)"
    )
    env = {**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", parent], env=env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    check = _child(proc.pid, "time.sleep(120)", deadline)
    grandchild = _child(check, "sleep\x00120", deadline)
    proc.terminate()
    assert proc.wait(timeout=30) == 128 + 15
    time.sleep(0.5)
    assert not _running(check) and not _running(grandchild)


def test_a_timeout_is_a_row_and_the_table_is_written_at_once(tmp_path):
    from benchmarks.gpu_checks import HELPERS, ddp
    from benchmarks.gpu_checks.harness import Check, main

    out = tmp_path / "t.md"
    checks = [
        Check("rng", ddp.check_rng, budget_s=20),
        Check("asleep", lambda device: (time.sleep(60), (True, ""))[1], budget_s=0.5),  # 1.5 s on CPU (three times)
        Check("rng_fresh", ddp.check_rng, budget_s=0.5, fresh=True),  # no interpreter starts in 1.5 s
    ]
    assert main(checks, HELPERS, "", ["--device", "cpu", "--budget", "60", "--out", str(out)]) == 1
    table = out.read_text()
    assert "| rng | PASS |" in table, table
    for name in ("asleep", "rng_fresh"):
        assert f"| {name} | TIMEOUT |" in table and "killed after 2 s (process group)" in table, table


def _child(pid: int, marker: str, deadline: float) -> int:
    """The child of ``pid`` whose command line holds ``marker``, once it has started. Other children may come and
    go meanwhile (an import that runs a tool in a subprocess): they are passed over, and so is a child forked but
    not yet exec'd, whose command line still reads as its parent's. A process that ends while it is polled is
    passed over too; ``pid`` ending first fails the test naming it."""
    while time.monotonic() < deadline:
        own = _read(f"/proc/{pid}/cmdline")
        children = _read(f"/proc/{pid}/task/{pid}/children")
        if own is None or children is None or not _running(pid):
            raise AssertionError(f"process {pid} ended before a child running {marker!r} started")
        for child in children.split():
            cmdline = _read(f"/proc/{child}/cmdline")
            if cmdline is not None and marker in cmdline and cmdline != own:
                return int(child)
        time.sleep(0.2)
    raise AssertionError(f"no child of {pid} running {marker!r}")


def _read(path: str) -> str | None:
    """The file's text, or None where its process has ended meanwhile."""
    try:
        return Path(path).read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits for whichever process adopted it to reap it)."""
    stat = _read(f"/proc/{pid}/stat")
    return stat is not None and stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def test_precision_table_states_the_targets():
    gpu_check = _load()
    fig = lambda speed, mb: {"imgs_per_s": speed, "peak_mb": mb}  # noqa: E731
    ok, table = gpu_check.precision_table(
        {
            "contiguous": {
                "32-true": fig(900, 30000),
                "bf16-mixed": fig(2600, 18000),
                "16-mixed": fig(2500, 24000),
            },
            "channels_last": {"32-true": fig(950, 29000), "bf16-mixed": fig(5100, 17000)},
        },
        "cuda",
    )
    assert ok and "| bf16-mixed | channels_last | 5100.0 | 5.37x | 17000 | 0.59x |" in table
    assert "best 5100, MET" in table and "worst 0.80x, MISSED" in table  # 16-mixed, contiguous: 24000 / 30000


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_a_bundle_runs_its_checks_in_one_process_a_row_each(tmp_path):
    # One interpreter for several checks: a check that raises is its own FAIL row and the next one runs in the same
    # process (it sees no process group left by the one before); at the bundle's limit the rows already reported
    # keep their result and the rest are TIMEOUT. A check without a CPU form is a SKIP row in its place.
    from benchmarks.gpu_checks import HELPERS
    from benchmarks.gpu_checks.harness import Bundle, Check, main

    pids = []

    def pid(device):
        import torch.distributed as dist

        pids.append(os.getpid())  # in the child: printed instead, see below
        return not dist.is_initialized(), f"pid {os.getpid()}"

    def leaves_a_group(device):
        import tempfile

        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
        return True, "a gloo group left behind"

    def boom(device):
        raise ValueError("a broken check")

    def asleep(device):
        time.sleep(60)
        return True, ""

    out = tmp_path / "t.md"
    bundle = Bundle(
        "b",
        (Check("group", leaves_a_group), Check("boom", boom), Check("gpu_only", pid, cpu=False),
         Check("after", pid), Check("asleep", asleep), Check("never", pid)),
        budget_s=3,  # 9 s on CPU
    )  # fmt: skip
    assert main([bundle], HELPERS, "", ["--device", "cpu", "--budget", "60", "--out", str(out)]) == 1
    table = out.read_text()
    rows = [line.split(" | ")[:2] for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == [["| group", "PASS"], ["| boom", "FAIL"], ["| gpu_only", "SKIP"], ["| after", "PASS"],
                        ["| asleep", "TIMEOUT"], ["| never", "TIMEOUT"]], table  # fmt: skip
    assert "ValueError: a broken check" in table and "killed after 9 s (process group)" in table
    assert not pids  # every check ran in the child, not here


def test_device_syncs_counts_the_runtime_synchronisations_copies_and_value_reads():
    from types import SimpleNamespace

    from benchmarks.gpu_checks.common import device_syncs

    names = ["aten::add", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize_v3020",
             "cudaMemcpyAsync", "Memcpy DtoH (Device -> Pageable)", "Memcpy HtoD (Pageable -> Device)",
             "Memcpy DtoH (Device -> Pinned)", "cudaStreamWaitEvent", "cudaLaunchKernel"]  # fmt: skip
    prof = SimpleNamespace(events=lambda: [SimpleNamespace(name=n) for n in names])
    assert device_syncs(prof) == (3, 2, 1)
    assert device_syncs(SimpleNamespace(events=list)) == (0, 0, 0)


@pytest.mark.slow
@pytest.mark.cli
@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_gpu_run_goes_end_to_end_on_cpu(tmp_path):
    # The device's one command, on CPU: the checkout installs offline, stage 0 passes (versions, test_compat,
    # the groups), gpu_check runs, and every output lies under $OUT: the table and each check's whole log.
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "SITE": str(tmp_path / "site")}
    proc = subprocess.run(
        ["bash", str(SCRIPT.parent / "gpu_run.sh"), "--device", "cpu", "--only", "multirank,flight_recorder,nccl1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=390,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    table = (out / "gpu_check.md").read_text()
    for name in ("multirank", "flight_recorder", "nccl1"):
        assert f"| {name} | PASS |" in table, table
    # the multi-rank scenario: both arms at both batches, SoloDDP's barrier monitored, the fast path at 128
    assert "| 16 | SoloDDP() | 17 | True | monitored | True |" in table, table
    assert "| 128 | SoloDDP() | 17 | False | monitored | False |" in table, table
    assert "| 128 | DDPStrategy() | 17 |" in table and "nothing in flight" in table, table
    # what comes back from the device: at most 8 files; the logs packed into one
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.md", "gpu_run.log", "logs.tar.gz", "versions.txt"]
    with tarfile.open(out / "logs.tar.gz") as logs:
        text = {m.name: logs.extractfile(m).read().decode() for m in logs.getmembers() if m.isfile()}
    assert "RESULT " in text["logs/single.log"] and "RESULT " in text["logs/multirank.log"]  # each whole output
    assert "passed" in text["stage0_compat.log"] and "groups: OK" in text["stage0_groups.log"]
    assert "torch " in (out / "versions.txt").read_text() and "the checkout installs" in proc.stdout
    assert (tmp_path / "site" / "checkout" / "lightning_solo" / "conf" / "config.yaml").is_file()
