"""benchmarks/gpu_check.py runs only where a GPU is; here: it parses, and without CUDA it says so and stops."""

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
    for check in ("rewrap", "syncbn", "rng", "fork", "precision", "fsdp"):
        assert f"``{check}``" in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_cuda_it_skips_with_a_message(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--out", str(tmp_path / "table.md")]) == 0
    assert "SKIPPED, CUDA is not available" in capsys.readouterr().out
    assert not (tmp_path / "table.md").exists()
    rows = [
        {"check": "rng", "ok": True, "detail": "a|b", "seconds": 1.0},
        {"check": "precision", "ok": False, "detail": "| precision | img/s |\n|---|---|", "seconds": 2.0},
    ]
    table = gpu_check.render(rows, "cuda")
    assert "| rng | PASS | 1.0 | a/b |" in table and "| precision | FAIL | 2.0 | table below |" in table
