"""scripts/lightning_examples.py: its pure parts, and one example run both ways when a Lightning checkout is given."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lightning_examples", ROOT / "scripts" / "lightning_examples.py")
ex = sys.modules["lightning_examples"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up there
_spec.loader.exec_module(ex)

TRACEBACK = "Traceback (most recent call last):\n  File x\n[rank0]: RuntimeError: boom\nframe #0: c10::Error\n"


@pytest.mark.parametrize(
    ("returncode", "log", "expected"),
    [
        (0, "", "pass"),
        (None, "", "timeout"),
        (1, "ValueError: bad\n", "fail: ValueError: bad"),
        (1, TRACEBACK, "fail: RuntimeError: boom"),
        (1, "Killed\n", "fail: exit 1"),
    ],
)
def test_outcome(returncode, log, expected):
    assert ex.outcome(returncode, log) == expected


def test_compare_states():
    a = {"w": torch.ones(2), "n": torch.tensor(3)}
    assert ex.compare_states(a, {"w": torch.ones(2), "n": torch.tensor(3)}) == "equal"
    assert ex.compare_states(a, {"w": torch.ones(2)}).startswith("keys differ")
    assert ex.compare_states(a, {"w": torch.ones(3), "n": torch.tensor(3)}).startswith("w: torch.float32[2]")
    assert ex.compare_states(a, {"w": torch.tensor([1.0, 1.5]), "n": torch.tensor(3)}) == "w: max |diff| 0.5"
    assert ex.compare_states(a, {"w": torch.ones(2), "n": torch.tensor(4)}) == "n: max |diff| -"
    close = {"w": torch.tensor([1.0, 1.0 + 2**-20]), "n": torch.tensor(3)}
    assert ex.compare_states(a, close, atol=1e-5).startswith("close")
    assert ex.compare_states(a, close).startswith("w: max |diff|")


def test_compare_metrics():
    assert ex.compare_metrics({"a": 1.0}, {"a": 1.0}) == "equal"
    assert ex.compare_metrics({"a": 1.0}, {"a": 2.0}) == "a: 1.0 vs 2.0"
    assert ex.compare_metrics({"a": 1.0}, {}) == "a: 1.0 vs None"
    assert ex.compare_metrics({"a": 1.0}, {"a": 1.00001}, rtol=1e-4).startswith("close")
    assert ex.compare_metrics({"a": 1.0}, {"a": 1.001}, rtol=1e-4) == "a: 1.0 vs 1.001"


@pytest.mark.parametrize(
    ("stock", "solo", "weights", "agree"),
    [
        ("pass", "pass", "equal", True),
        ("pass", "pass", "close: max |diff| 1e-06 <= 1e-05", True),
        ("pass", "pass", "w: max |diff| 0.5", False),
        ("pass", "fail: E: x", "-", False),  # SoloDDP fails where stock passes: a drop-in break
        ("fail: E: x", "fail: E: x", "-", True),
        ("fail: E: x", "fail: F: y", "-", True),  # stock fails: SoloDDP need not match it
        ("fail: E: x", "pass", "-", True),
    ],
)
def test_verdict(stock, solo, weights, agree):
    assert ex.verdict(stock, solo, weights, "equal") is agree


def test_row_compares_with_the_fallback_and_solo_off_arms():
    state = {"state_dict": {"w": torch.ones(1)}, "metrics": {"loss": 0.5}}
    other = {"state_dict": {"w": torch.zeros(1)}, "metrics": {"loss": 0.7}}
    passed = {"outcome": "pass", "seconds": 6.0, "result": state}
    stock = {"outcome": "fail: RuntimeError: unused", "seconds": 5.0, "result": None}
    r = ex.row("reinforce_learn_Qnet", {"stock": stock, "solo": passed, "fallback": passed})
    assert (r["weights"], r["metrics"], r["agree"], r["seconds"]) == ("equal", "equal", True, "5 / 6 / 6")
    assert r["stock"].endswith("with find_unused_parameters=True: pass")
    # SoloDDP's defaults differ by a Decision: its off switches must give stock's weights
    arms = {"stock": passed, "solo": {**passed, "result": other}, "solo_off": passed}
    r = ex.row("imagenet", arms)
    assert r["agree"] is True
    assert r["weights"].startswith("with sync_batchnorm=False, exact_resume=False: equal; defaults: w:")
    assert ex.row("imagenet", {**arms, "solo_off": {**passed, "result": other}})["agree"] is False
    assert ex.row("imagenet", {**arms, "solo": {**stock, "result": None}})["agree"] is False  # defaults must run
    assert ex.row("x", {"stock": passed, "solo": {**stock, "result": None}})["agree"] is False


@pytest.mark.multiproc
@pytest.mark.cli
@pytest.mark.timeout(120)
def test_bug_report_model_both_ways(tmp_path):
    src = os.environ.get("LIGHTNING_SRC")
    if not src or not (Path(src) / "examples" / "pytorch" / "bug_report").is_dir():
        pytest.skip("set LIGHTNING_SRC to a Lightning checkout holding examples/pytorch to run its examples")
    out = tmp_path / "report.md"
    cmd = [sys.executable, str(ROOT / "scripts" / "lightning_examples.py"), src, "--only", "bug_report_model"]
    proc = subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| bug_report_model | pass | pass | equal | equal | yes | equal / equal |" in out.read_text()
