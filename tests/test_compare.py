"""benchmarks/compare.py: the four-contender comparison runs end to end at a tiny size, and every section's
table is built from its measurements (a benchmark, not a timed test: nothing here asserts a speed). The end-to-end
run launches each contender as one real rank process (``--world-size 1``): the launch, the worker and the tables
are the same code at any world size, and every fresh process costs the suite an interpreter's imports (~7 s)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from benchmarks import compare
from tests.helpers import REPO

CONTENDERS = (
    "no-communication ceiling",
    "hand-written torch DDP",
    'stock Lightning "ddp"',
    "SoloDDP()",
    compare.MALLOC_CEILING,
)


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tiny_comparison_runs_four_contenders_in_real_processes(tmp_path):
    out = tmp_path / "compare.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.compare",
            "--tiny",
            "--sections",
            "main,allreduce",
            "--world-size",
            "1",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=230,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    text = out.read_text()
    assert "nproc" in text and "python -m benchmarks.compare --tiny" in text
    for name in CONTENDERS:
        cells = r" \| ".join([r"([\d.]+)(?: \([^)]*\))?"] * 3 + [r"(\d+) \("])  # one round: no (min–max)
        row = re.search(rf"^\| {re.escape(name)} \| {cells}", text, re.M)
        assert row, f"no row for {name}:\n{text}"
        samples_per_s, cpu_ms, faults, rss_mb = map(float, row.groups())
        assert samples_per_s > 0 and cpu_ms > 0 and faults >= 0 and 300 < rss_mb < 10_000
    for ratio in (
        "SoloDDP / raw",
        "SoloDDP / stock",
        "SoloDDP / ceiling",
        "SoloDDP / ceiling with the same malloc setting",
    ):
        assert re.search(rf"^\| {re.escape(ratio)} \| [\d.]+ \| [\d.]+ \|", text, re.M), ratio
    for kind in ("fp32 all-reduce", "bf16 all-reduce (collective alone)", "bf16 hook"):
        assert re.search(rf"^\| {re.escape(kind)} \| [\d.]+ \| [\d.]+×", text, re.M), kind


def _fake_launch(spec: dict, world: int, timeout: float) -> dict:
    """Deterministic stand-in for a measurement: faster without communication, slower with more ranks."""
    speed = {"ceiling": 100.0, "raw": 90.0, "stock": 85.0, "solo": 84.0}[spec["kind"]] * world
    if spec.get("accumulate", 1) > 1 or "post_local_sgd" in str(spec.get("solo")):
        speed *= 2
    return {
        "samples_per_s": speed,
        "cpu_ms": 1000 * world / speed,
        "faults": 10.0,
        "peak_rss_mb": [1000 + world] * world,
        "grad_mb": 44.7,
        "loss": 1.0 + 0.01 * spec.get("accumulate", 1),
        "pieces": {"resume.rng_state": [0.002, 8], "SeededDataset.__getitems__": [0.004, 8]}
        if spec.get("profile")
        else None,
    }


def test_every_section_builds_its_table(monkeypatch):
    import lightning_solo.testing

    monkeypatch.setattr(compare, "launch", _fake_launch)
    collectives = {
        "_allreduce_rank": {
            "fp32 all-reduce": [0.035],
            "bf16 all-reduce (collective alone)": [0.021],
            "bf16 hook": [0.03],
        },
        "_barrier_rank": {"dist.barrier": [0.001], "monitored barrier (SoloDDP)": [0.002]},
    }
    monkeypatch.setattr(lightning_solo.testing, "run_ranks", lambda fn, world, *a, timeout: [collectives[fn.__name__]])
    args = compare.parse_args(["--tiny", "--rounds", "2"])
    main = compare.section_main(args)
    assert "| SoloDDP / stock | 0.988 (0.988–0.988) | 0.988 (0.988–0.988) |" in main
    assert "| SoloDDP / ceiling | 0.840" in main
    variants = compare.section_variants(args)
    assert "gradient_as_bucket_view=False" in variants and "comm_hook=powersgd" in variants
    scaling = compare.section_scaling(args)
    assert re.search(r"^\| 2 .*\| 1\.00 \|", scaling, re.M)  # the fake scales perfectly
    comm = compare.section_comm(args)
    assert re.search(r"^\| accumulate 4 batches \| [\d.]+ .*\| 2\.00 .*\| \+3\.0 % \|", comm, re.M)
    assert "post_local_sgd, period 4" in comm and "bucket_cap_mb=1" in comm
    assert "| bf16 all-reduce (collective alone) | 21.0 | 0.60× | 40 % |" in compare.section_allreduce(args)
    costs = compare.section_costs(args)
    assert "| SeededDataset.__getitems__ |" in costs and "no per-step RNG capture" in costs
    assert "| Lightning's per-batch SIGTERM broadcast |" in costs and "| no SIGTERM check at all |" in costs
    assert "monitored barrier (SoloDDP) 2.00 ms" in costs


@pytest.mark.timeout(120)
def test_every_ablation_and_the_profiler_find_what_they_patch():
    """The fake launch above never runs the workers' patches; here they run (in a fresh interpreter, since they
    patch modules), so a refactor that moves a piece breaks this test rather than the benchmark."""
    script = (
        "from benchmarks.compare_worker import ablate, profile_pieces\n"
        "for what in ('no_resumable_loader', 'no_sample_seeding', 'no_rng_capture', 'plain_barrier',\n"
        "             'lightning_sigterm_check', 'no_sigterm_check'):\n"
        "    ablate(what)\n"
        "from lightning_solo.ddp.resume.loader import SeededDataset\n"
        "import torch\n"
        "from torch.utils.data import TensorDataset\n"
        "spent = profile_pieces()\n"
        "SeededDataset(TensorDataset(torch.arange(4)), 0).__getitems__([(0, 1), (0, 2)])\n"
        "assert spent['SeededDataset.__getitems__'][1] == 1, dict(spent)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_order_check_and_the_local_sgd_probe_report_every_run(monkeypatch, capsys):
    from benchmarks import local_sgd_probe, order_check, sigterm_check

    monkeypatch.setattr(compare, "launch", _fake_launch)
    order_check.main(["--tiny", "--rounds", "4"])
    out = capsys.readouterr().out
    assert "| SoloDDP() | 168.0 " in out  # the fake: 84 samples/s per rank
    assert "SoloDDP/stock by samples/s: all rounds 0.988" in out and "second [0.988, 0.988]" in out
    sigterm_check.main(["--tiny", "--rounds", "2"])
    out = capsys.readouterr().out
    assert "| Lightning's per-batch SIGTERM broadcast | " in out and "| no SIGTERM check at all | " in out
    local_sgd_probe.main(["--tiny"])
    out = capsys.readouterr().out
    assert out.count("\n| ") == 7 and "| post_local_sgd, period 4 | 336.0 |" in out  # header + 6 runs


def test_the_local_sgd_loss_simulation_reports_every_run(monkeypatch, capsys):
    from benchmarks import local_sgd_loss

    monkeypatch.setattr(local_sgd_loss, "SPEC", {**local_sgd_loss.SPEC, "width": 16, "batches": 24, "warmup": 4})
    local_sgd_loss.main(["--orders", "0", "1"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(local_sgd_loss.RUNS)
    assert rows[0].endswith("| +0.0 %, +0.0 % | +0.0 % |")  # exact DDP against itself
    assert all(re.search(r"\| [\d.]+, [\d.]+ \|", row) for row in rows)  # a held-out loss per order
