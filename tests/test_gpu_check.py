"""benchmarks/gpu_check.py runs its figures only where a GPU is; here: it parses, without CUDA it says so and stops,
its harness kills a check's whole process group at its limit, its table states the targets, and every check with
a CPU form runs its logic on CPU at tiny sizes; gpu_run.sh, the device's one command, runs end to end on CPU."""

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_help_lists_every_check(capsys):
    gpu_check = _load()
    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for check in gpu_check.CHECKS:
        assert f"``{check.name}``" in out
    # correctness first, benchmarks last, each in registry order
    from benchmarks.gpu_checks.harness import ordered

    kinds = [c.benchmark for c in ordered(gpu_check.CHECKS)]
    assert kinds == sorted(kinds) and {"defaults_cost", "precision"} <= {
        c.name for c in gpu_check.CHECKS if c.benchmark
    }


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
        "import sys; from benchmarks.gpu_checks.harness import _terminate_as_exit, run_group; _terminate_as_exit(); "
        f"run_group([sys.executable, '-c', {hang!r}], limit=120)"
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
        Check("asleep", lambda device: (time.sleep(60), (True, ""))[1], budget_s=0.5),  # 1 s on CPU (twice)
        Check("rng_fresh", ddp.check_rng, budget_s=0.5, fresh=True),  # no interpreter starts in 1 s
    ]
    assert main(checks, HELPERS, "", ["--device", "cpu", "--budget", "60", "--out", str(out)]) == 1
    table = out.read_text()
    assert "| rng | PASS |" in table, table
    for name in ("asleep", "rng_fresh"):
        assert f"| {name} | TIMEOUT |" in table and "killed after 1 s (process group)" in table, table


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


def _cpu_checks() -> list[str]:
    return [check.name for check in _load().CHECKS if check.cpu]


# Four runs of a quarter of the checks each, so that the suite's workers share them; together: every check.
_SHARES = 4


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("share", range(_SHARES))
def test_every_check_with_a_cpu_form_passes_on_cpu(tmp_path, share):
    # nccl1 runs on gloo here, scaler on real fp16 on CPU, syncbn_fn with the portable kernels: the logic of each.
    gpu_check = _load()
    names = _cpu_checks()[share::_SHARES]
    out = tmp_path / "t.md"
    args = ["--device", "cpu", "--budget", "600", "--only", ",".join(names), "--out", str(out)]
    assert gpu_check.main(args) == 0, out.read_text()
    table = out.read_text()
    for name in names:
        assert f"| {name} | PASS |" in table, table
    expected = {
        "scaler": ["weights held True", "skipped_steps 1"],
        "syncbn_cuda": ["during fit: BatchNorm2d synced", "after: BatchNorm2d"],
        "notebook": ["CUDA initialised here False"],
        "autobatch": ["said too big True"],
    }
    for name in names:
        for text in expected.get(name, []):
            assert text in table, table


def test_the_shares_cover_every_check_with_a_cpu_form():
    names = _cpu_checks()
    assert sorted(n for share in range(_SHARES) for n in names[share::_SHARES]) == sorted(names)
    assert {check.name for check in _load().CHECKS if not check.cpu} == {"fork"}  # the one without a CPU form


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
        ["bash", str(SCRIPT.parent / "gpu_run.sh"), "--device", "cpu", "--only", "nccl1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=390,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "| nccl1 | PASS |" in (out / "gpu_check.md").read_text()
    assert "RESULT " in (out / "logs" / "nccl1.log").read_text()  # the whole output, its result line too
    assert "passed" in (out / "stage0_compat.log").read_text()
    assert "groups: OK" in (out / "stage0_groups.log").read_text()
    assert "torch " in (out / "versions.txt").read_text() and "the checkout installs" in proc.stdout
    assert (tmp_path / "site" / "checkout" / "lightning_solo" / "conf" / "config.yaml").is_file()
