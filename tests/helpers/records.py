"""Per-rank records: each rank of a fit writes what it saw to its own file, and the test reads all of them back.

A callback collects a dict on its rank and calls :func:`write_rank_record`; the test calls
:func:`read_rank_records` after ``trainer.fit``. ``.json`` for plain values, ``.pt`` for tensors.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def write_rank_record(out: Path, rank: int, record: dict[str, Any], suffix: str = ".json") -> None:
    path = Path(out) / f"rank{rank}{suffix}"
    if suffix == ".pt":
        torch.save(record, path)
    else:
        path.write_text(json.dumps(record, default=str))


def read_rank_records(out: Path, world: int = 2, suffix: str = ".json") -> list[dict[str, Any]]:
    paths = [Path(out) / f"rank{r}{suffix}" for r in range(world)]
    if suffix == ".pt":
        return [torch.load(p, weights_only=True) for p in paths]
    return [json.loads(p.read_text()) for p in paths]
