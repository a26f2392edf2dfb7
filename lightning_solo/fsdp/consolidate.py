"""``python -m lightning_solo.consolidate CKPT_DIR OUT.ckpt``: one ordinary checkpoint file from a sharded one.
Verified first, gathered without a process group, written by ``SoloCheckpointIO``: ``state_dict`` of plain tensors,
``meta.pt``'s epoch, step, loops and callbacks, the optimizer with ``--optimizer``. See docs/checkpoints.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from lightning_solo.checkpoint.io import SoloCheckpointIO, load_weights_only
from lightning_solo.checkpoint.manifest import CheckpointVerificationError, verify
from lightning_solo.checkpoint.sharded import META, verify_sharded


def consolidate(src: str | os.PathLike, dst: str | os.PathLike, optimizer: bool = False) -> dict[str, Any]:
    """Write ``src`` (a sharded checkpoint directory) as the single file ``dst``; returns its manifest."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src, dst = Path(src), Path(dst)
    verify_sharded(src)
    meta = load_weights_only(src / META, map_location="cpu")
    with tempfile.TemporaryDirectory(dir=dst.parent if dst.parent.exists() else None) as tmp:
        gathered = Path(tmp) / "full.pt"
        dcp_to_torch_save(src, gathered)
        full = torch.load(gathered, map_location="cpu", weights_only=True)
    checkpoint = {**meta, "state_dict": full.pop("state_dict")}
    if optimizer:
        checkpoint["optimizer_states"] = [full[k] for k in sorted(full) if k.startswith("optimizer_")]
    SoloCheckpointIO().save_checkpoint(checkpoint, dst, storage_options={"consolidated_from": str(src)})
    return verify(dst)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_solo.consolidate", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="a sharded checkpoint directory (e.g. checkpoints/last.ckpt/)")
    parser.add_argument("output", help="the single file to write")
    parser.add_argument("--optimizer", action="store_true", help="keep the optimizer state (full, unsharded)")
    args = parser.parse_args(argv)
    try:
        manifest = consolidate(args.checkpoint, args.output, optimizer=args.optimizer)
    except CheckpointVerificationError as err:
        print(f"lightning_solo.fsdp.consolidate: error: {err}", file=sys.stderr)
        return 2
    print(f"{args.output}: global step {manifest.get('global_step')}, {manifest.get('size')} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
