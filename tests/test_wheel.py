"""The built wheel carries conf/ and runs from any directory, relaunched ranks included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO, TINY_RUN, run_cli

pytestmark = [pytest.mark.cli, pytest.mark.multiproc]


def _venv_seeing_this_interpreters_packages(env_dir: Path) -> str:
    """A venv whose python sees what this interpreter imports (torch, lightning, ...) but no lightning_solo.

    ``venv.create(system_site_packages=True)`` would give the *base* interpreter's packages, which inside a
    venv are not this one's; so the new venv lists this interpreter's import path in a ``.pth`` file instead,
    after its own site-packages, leaving out every directory that holds a lightning_solo (a checkout on
    PYTHONPATH, an editable install): the wheel under test is the only copy it can import.
    """
    venv.create(env_dir, system_site_packages=False, with_pip=False)
    python = str(env_dir / "bin" / "python")
    site_dir = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        env=_env(),
    ).stdout.strip()
    paths = [p for p in sys.path if p and Path(p).is_dir() and not (Path(p) / "lightning_solo").exists()]
    Path(site_dir, "_parent_interpreter.pth").write_text("".join(f"{p}\n" for p in dict.fromkeys(paths)))
    return python


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_wheel_installed_elsewhere_runs(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(REPO),
        ],
        check=True,
        timeout=300,
    )
    wheel = next(wheels.glob("lightning_solo-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "lightning_solo/conf/config.yaml" in names
    assert "lightning_solo/conf/experiment/resnet_4gpu.yaml" in names
    assert "lightning_solo/py.typed" in names  # PEP 561: the package ships its type hints
    assert "lightning_solo/app/data/optdigits.tes.gz" in names  # the default data

    env_dir = tmp_path / "venv"
    python = _venv_seeing_this_interpreters_packages(env_dir)
    for var in (
        "PYTHONPATH",
        "PYTHONHOME",
        "VIRTUAL_ENV",
    ):  # the venv's python imports the wheel, not a checkout
        monkeypatch.delenv(var, raising=False)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", str(wheel)],
        check=True,
        timeout=300,
    )
    where = subprocess.run(
        [
            python,
            "-c",
            "import lightning_solo.app.run as r; from lightning_solo.app.data.digits import load_digits;"
            "print(r.__file__); print(r.config_path()); print(len(load_digits()[1]))",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert where[0].startswith(str(env_dir)) and where[1:] == ["pkg://lightning_solo.conf", "1797"]

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_cli(
        [
            *TINY_RUN,
            "trainer.enable_progress_bar=false",
            "hydra.run.dir=run",
        ],
        cwd=elsewhere,
        timeout=240,
        python=python,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = elsewhere / "run"
    assert (run / ".hydra" / "config.yaml").exists() and (run / "train_ddp_process_1.log").exists()
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
