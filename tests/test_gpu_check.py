"""benchmarks/gpu_check.py runs its figures only where a GPU is; here: it parses, without CUDA it says so and stops,
its table states the targets, and the checks of the CUDA paths run their logic on CPU at small sizes."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_help_lists_every_check():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    gpu_check = _load()
    for check in gpu_check.CHECKS:
        assert f"``{check}``" in out.stdout


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
        {"check": "rng", "ok": True, "detail": "a|b", "seconds": 1.0},
        {"check": "precision", "ok": False, "detail": "| precision | img/s |\n|---|---|", "seconds": 2.0},
    ]
    table = gpu_check.render(rows, "cuda")
    assert "| rng | PASS | 1.0 | a/b |" in table and "| precision | FAIL | 2.0 | table below |" in table
    skipped = gpu_check.render([{"check": "fork", "ok": None, "detail": "not run", "seconds": 0}], "cuda")
    assert "| fork | SKIPPED | 0 | not run |" in skipped


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
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cuda_paths_dry_run_on_cpu(tmp_path):
    # nccl1 runs on gloo here, scaler on real fp16 on CPU, syncbn_cuda on CPU: the logic of each check.
    gpu_check = _load()
    names = ["nccl1", "scaler", "syncbn_cuda", "solo_vs_plain"]
    assert (
        gpu_check.main(["--device", "cpu", "--only", ",".join(names), "--out", str(tmp_path / "t.md")]) == 0
    )
    table = (tmp_path / "t.md").read_text()
    for name in names:
        assert f"| {name} | PASS |" in table, table
    assert "weights held True" in table and "skipped_steps 1" in table
    assert "during fit: SoloSyncBatchNorm" in table and "after: BatchNorm2d" in table
