"""The built wheel carries conf/ and runs from any directory, relaunched ranks included."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
import zipfile

import pytest

from tests.helpers import REPO, run_cli

pytestmark = [pytest.mark.cli, pytest.mark.multiproc]


@pytest.mark.timeout(400)
def test_wheel_installed_elsewhere_runs(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels), str(REPO)], check=True, timeout=300)
    wheel = next(wheels.glob("lightning_solo-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "lightning_solo/conf/config.yaml" in names
    assert "lightning_solo/conf/experiment/resnet_4gpu.yaml" in names

    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)  # torch etc. come from the system
    python = str(env_dir / "bin" / "python")
    subprocess.run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=300)
    where = subprocess.run([python, "-c", "import lightning_solo.run as r; print(r.__file__); print(r.config_path())"],
                           cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert where[0].startswith(str(env_dir)) and where[1] == "pkg://lightning_solo.conf"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = run_cli(["+experiment=quick_cpu", "data.image_size=8", "data.train_size=64", "data.val_size=32",
                    "trainer.max_epochs=1", "trainer.enable_progress_bar=false", "hydra.run.dir=run"],
                   cwd=elsewhere, timeout=240, python=python)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = elsewhere / "run"
    assert (run / ".hydra" / "config.yaml").exists() and (run / "train_ddp_process_1.log").exists()
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
