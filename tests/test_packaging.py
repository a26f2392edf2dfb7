"""The package's metadata has one source, and optional dependencies fail with the command that installs them."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import version as installed_version

import pytest

import lightning_solo
from lightning_solo.callbacks import WarmupScaledLR
from tests.helpers import REPO


def test_version_is_written_in_one_place():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lightning_solo._version.__version__"}
    assert lightning_solo.__version__ == installed_version("lightning_solo")


def test_matplotlib_is_an_optional_extra(tmp_path, monkeypatch):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("matplotlib") for dep in project["dependencies"])
    assert any(dep.startswith("matplotlib") for dep in project["optional-dependencies"]["plot"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    cb = WarmupScaledLR(reference_batch_size=256, warmup_steps=2)
    with pytest.raises(ImportError, match=r"pip install 'lightning_solo\[plot\]'"):
        cb.plot_schedule(tmp_path / "lr.png", global_batch=512, total_steps=10)
    assert not (tmp_path / "lr.png").exists()


def test_the_wheel_lists_every_package():
    # setuptools' explicit list: a subpackage left out installs without its modules (seen with ddp/watchdog).
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    root = REPO / "lightning_solo"
    found = {".".join(("lightning_solo", *init.parent.relative_to(root).parts)) for init in root.rglob("__init__.py")}
    assert found - listed == set()


@pytest.mark.timeout(120)
def test_importing_the_package_pauses_the_gc_while_lightning_loads_and_restores_the_callers_setting():
    # A fresh interpreter: here Lightning is loaded already. Without the pause the collector runs ~1,000 times while
    # Lightning loads (benchmarks/bench_startup.py: ~12 % of a process's start).
    code = (
        "import gc, importlib; count = lambda: sum(s['collections'] for s in gc.get_stats()); before = count(); "
        "import lightning_solo; during = count() - before; enabled = gc.isenabled(); "
        "gc.disable(); importlib.reload(lightning_solo); kept_off = not gc.isenabled(); "
        "print(during, enabled, kept_off, 'lightning' in __import__('sys').modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=110)
    assert proc.returncode == 0, proc.stderr[-4000:]
    during, enabled, kept_off, loaded = proc.stdout.split()
    # Paused: a collection or two before __init__ runs. On again after; left off where the caller had it.
    assert loaded == "True" and int(during) <= 5, proc.stdout
    assert enabled == "True" and kept_off == "True", proc.stdout
