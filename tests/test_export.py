"""``python -m lightning_solo.export``: the exported weights load into a fresh torchvision model with
``weights_only=True`` and give the trained model's outputs; so does the exported program."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import lightning as L
import pytest
import torch
import torchvision
from torch.utils.data import DataLoader, TensorDataset

from lightning_solo.app.export import plain_state_dict
from lightning_solo.app.models.classifier import ImageClassifier
from lightning_solo.callbacks import SoloCheckpoint
from lightning_solo.checkpoint.io import SoloCheckpointIO

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.cli
@pytest.mark.timeout(120)
def test_exported_weights_and_program_match_the_trained_model(tmp_path):
    torch.manual_seed(0)
    model = ImageClassifier("resnet18", num_classes=10, stem="imagenet")
    data = TensorDataset(torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,)))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        plugins=[SoloCheckpointIO()],
        logger=False,
        callbacks=[SoloCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1)],
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))  # BatchNorm statistics move, so eval outputs are non-trivial

    out = tmp_path / "export"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_solo.export",
            str(tmp_path / "ckpt" / "last.ckpt"),
            str(out),
            "--input-shape",
            "3",
            "64",
            "64",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads((out / "export.json").read_text())
    assert info["arch"] == "resnet18" and info["num_classes"] == 10 and info["global_step"] == 2
    assert info["files"]["weights"] == "weights.pt" and info["files"]["program"] == "model.pt2"

    images = torch.randn(3, 3, 64, 64)
    model.eval()
    with torch.no_grad():
        expected = model(images)
        fresh = torchvision.models.resnet18(num_classes=10)
        state = torch.load(out / "weights.pt", weights_only=True)
        assert not any(k.startswith(("model.", "module.")) for k in state)
        fresh.load_state_dict(state)  # strict: every key and shape matches the bare torchvision model
        assert torch.equal(fresh.eval()(images), expected)
        program = torch.export.load(out / "model.pt2").module()
        assert torch.allclose(program(images), expected, rtol=1e-5, atol=1e-6)
        assert program(images[:1]).shape == (1, 10)  # the batch dimension is dynamic


def test_plain_state_dict_strips_wrapper_prefixes():
    weight = torch.ones(2)
    sd = {"model.module.fc.weight": weight, "module.model._orig_mod.fc.bias": weight, "val_acc.tp": weight}
    assert set(plain_state_dict(sd, "model.")) == {"fc.weight", "fc.bias"}
    assert set(plain_state_dict({"module.fc.weight": weight})) == {"fc.weight"}
