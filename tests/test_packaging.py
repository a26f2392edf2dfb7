"""The package's metadata has one source, and optional dependencies fail with the command that installs them."""

from __future__ import annotations

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
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "lightning_solo._version.__version__"
    }
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
    found = {
        ".".join(("lightning_solo", *init.parent.relative_to(root).parts))
        for init in root.rglob("__init__.py")
    }
    assert found - listed == set()
