"""``python -m lightning_solo.export CKPT OUTDIR``: a training checkpoint as deployable artefacts (docs/checkpoints.md)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_solo.checkpoint.io import SoloCheckpointIO
from lightning_solo.ddp.compiled_keys import eager_key


def plain_state_dict(state_dict: dict[str, Any], prefix: str | None = None) -> dict[str, torch.Tensor]:
    """``state_dict`` with wrapper prefixes removed and, if given, ``prefix`` (the attribute holding the
    network inside the LightningModule, e.g. ``"model."``); entries outside ``prefix`` are dropped."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        key = _strip_wrappers(key)
        if prefix:
            if not key.startswith(prefix):
                continue
            key = _strip_wrappers(key[len(prefix) :])
        out[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return out


def _strip_wrappers(key: str) -> str:
    """``key`` without DDP's ``module.`` and torch.compile's ``_orig_mod.`` levels."""
    key = eager_key(key)
    while key.startswith("module."):
        key = key[len("module.") :]
    return key


def export_checkpoint(
    ckpt_path: str | os.PathLike,
    outdir: str | os.PathLike,
    input_shape: Sequence[int] | None = None,
    prefix: str = "model.",
    onnx: bool | None = None,
    weights_only: bool = True,
) -> dict[str, Any]:
    """Export ``ckpt_path`` (verified on load) into ``outdir``; returns the ``export.json`` contents."""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    io = SoloCheckpointIO(weights_only=weights_only)
    checkpoint = io.load_checkpoint(ckpt_path, map_location="cpu")
    state_dict = checkpoint.get("state_dict", checkpoint)
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    if not any(_strip_wrappers(k).startswith(prefix) for k in state_dict):
        prefix = ""  # already a bare network's state_dict
    weights = plain_state_dict(state_dict, prefix)
    io.save_checkpoint(weights, outdir / "weights.pt")
    info: dict[str, Any] = {
        "source": os.path.abspath(ckpt_path),
        "global_step": checkpoint.get("global_step"),
        "epoch": checkpoint.get("epoch"),
        "files": {"weights": "weights.pt"},
        "load_weights": "net.load_state_dict(torch.load('weights.pt', weights_only=True))",
        "notes": [],
    }
    if "arch" not in hparams or "num_classes" not in hparams:  # not an ImageClassifier's checkpoint
        info["notes"].append("no arch/num_classes in hyper_parameters: exported the weights only")
    else:
        from lightning_solo.app.models.classifier import LOCAL_ARCHS, build_backbone

        arch, classes = hparams["arch"], int(hparams["num_classes"])
        stem, in_channels = hparams.get("stem", "imagenet"), int(hparams.get("in_channels", 3))
        net = build_backbone(arch, classes, stem, weights=None, in_channels=in_channels)
        net.load_state_dict(weights)  # strict: a mismatch here means the export is wrong, so fail loudly
        net.eval()
        default_shape = (3, 32, 32) if stem == "cifar" else (3, 224, 224)
        shape = tuple(input_shape or getattr(net, "input_shape", None) or default_shape)
        info.update(arch=arch, num_classes=classes, stem=stem, input_shape=list(shape))
        if stem != "imagenet" or in_channels != 3 or arch in LOCAL_ARCHS:
            info["notes"].append(
                "build the network with lightning_solo.app.models.classifier.build_backbone("
                f"{arch!r}, {classes}, {stem!r}, in_channels={in_channels})"
            )
        example = torch.randn(2, *shape)
        program = torch.export.export(
            net, (example,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=65536)},)
        )
        torch.export.save(program, outdir / "model.pt2")
        info["files"]["program"] = "model.pt2"
        info["load_program"] = "torch.export.load('model.pt2').module()(images)"
        want_onnx = importlib.util.find_spec("onnx") is not None if onnx is None else onnx
        if want_onnx:
            info["files"].update(_export_onnx(net, example, outdir / "model.onnx", info["notes"]))
        else:
            info["notes"].append("onnx is not installed: no model.onnx (pip install onnx onnxscript)")
    (outdir / "export.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _export_onnx(net: nn.Module, example: torch.Tensor, path: Path, notes: list[str]) -> dict[str, str]:
    dynamo = importlib.util.find_spec("onnxscript") is not None
    # The dynamo exporter (onnxscript) takes the batch dimension as a shape; the legacy one by axis name.
    batch = (
        {"dynamic_shapes": ({0: torch.export.Dim("batch", min=1, max=65536)},)}
        if dynamo
        else {"dynamic_axes": {"images": {0: "batch"}, "logits": {0: "batch"}}}
    )
    try:
        torch.onnx.export(
            net, (example,), str(path), input_names=["images"], output_names=["logits"], dynamo=dynamo, **batch
        )
    except Exception as err:  # noqa: BLE001 - the other artefacts are still good; say why this one is missing
        notes.append(f"ONNX export failed: {type(err).__name__}: {err}")
        return {}
    return {"onnx": path.name}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_solo.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a Lightning checkpoint (.ckpt), verified before use")
    parser.add_argument("outdir", help="directory for weights.pt, model.pt2, model.onnx, export.json")
    parser.add_argument("--input-shape", type=int, nargs="+", metavar="N", help="one sample's shape: 3 224 224")
    parser.add_argument("--prefix", default="model.", help="attribute path of the network in the LightningModule")
    parser.add_argument("--no-onnx", action="store_true", help="skip ONNX even when onnx is installed")
    parser.add_argument("--unsafe-pickle", action="store_true", help="weights_only=False: for trusted checkpoints")
    args = parser.parse_args(argv)
    onnx = False if args.no_onnx else None
    info = export_checkpoint(args.checkpoint, args.outdir, args.input_shape, args.prefix, onnx, not args.unsafe_pickle)
    for role, name in info["files"].items():
        print(f"{role:8s} {os.path.join(args.outdir, name)}")
    for note in info["notes"]:
        print(f"note: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
