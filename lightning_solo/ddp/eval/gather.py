"""Every rank's per-sample results on one process in dataset order, written to one file. See docs/evaluation.md."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_solo.core import ranks


def gather_rows(indices: torch.Tensor, values: torch.Tensor, dst: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every rank's ``(indices, values)`` rows on rank ``dst``, sorted by index (``None`` elsewhere). One
    collective per call, on every rank. Raises ``ValueError`` when an index came from more than one row."""
    payload = (indices.detach().cpu().long(), values.detach().cpu())
    if ranks.world_size() == 1:
        parts = [payload]
    else:
        received: list | None = [None] * ranks.world_size() if ranks.rank() == dst else None
        dist.gather_object(payload, received, dst=dst)
        if received is None:
            return None
        parts = received
    parts = [p for p in parts if len(p[0])]
    if not parts:
        return torch.empty(0, dtype=torch.long), values.detach().cpu()[:0]
    index = torch.cat([p[0] for p in parts])
    value = torch.cat([p[1] for p in parts])
    order = torch.argsort(index, stable=True)
    index, value = index[order], value[order]
    repeated = index[1:][index[1:] == index[:-1]]
    if len(repeated):
        raise ValueError(
            f"{len(repeated)} sample(s) were evaluated more than once (first: index {int(repeated[0])}): "
            "the loader was not split exactly (SoloDDP(exact_eval=True) does it for Lightning's samplers)"
        )
    return index, value


def write_predictions(path: str | os.PathLike, indices: torch.Tensor, values: torch.Tensor) -> Path:
    """Write the rows atomically: ``.csv`` gives ``index,prediction`` (``prediction_0..`` for vectors, one row a
    sample); any other suffix a ``torch.save`` of ``{"index", "prediction"}`` tensors."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp")
    if path.suffix == ".csv":
        if values.dim() > 2:
            raise ValueError(f"a CSV holds one number or one vector per sample, got shape {tuple(values.shape)}")
        table = values.reshape(len(values), -1)
        columns = ["prediction"] if values.dim() == 1 else [f"prediction_{k}" for k in range(table.shape[1])]
        lines = [",".join(["index", *columns])]
        lines += [",".join(map(str, [i, *row])) for i, row in zip(indices.tolist(), table.tolist())]
        temp.write_text("\n".join(lines) + "\n")
    else:
        torch.save({"index": indices, "prediction": values}, temp)
    os.replace(temp, path)
    return path
