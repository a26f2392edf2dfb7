"""Per-rank records: each rank of a fit writes what it saw to its own file, and the test reads all of them back.

:class:`RankRecorder` is the callback. Each keyword named after a Lightning hook says what to read there: a
tuple of names from :data:`READERS`, or a dict ``{key: name or function(trainer, module)}``. The values read
once are kept under their key, those read at every batch as a list. With ``out``, the record goes to
``out/rank{r}.json`` (``.pt`` to keep tensors) when the fit ends, read back by :func:`read_rank_records`;
without, it stays in ``recorder.record`` in the process that ran the fit (the notebook launcher carries
``state_dict()`` s back to the parent, and this callback has none).

    recorder = RankRecorder(tmp_path, on_train_batch_end={"steps": "params"}, on_fit_end=("decisions",))
    trainer = L.Trainer(..., strategy=SoloDDP(start_method="fork"), callbacks=[recorder])
    trainer.fit(model)
    rank0, rank1 = read_rank_records(tmp_path)
"""

from __future__ import annotations

import copy
import itertools
import json
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.nn.utils import parameters_to_vector

Reader = Callable[[L.Trainer, L.LightningModule], Any]


def _decisions(trainer: L.Trainer, module: L.LightningModule) -> dict[str, dict]:
    decisions = getattr(trainer.strategy, "decisions", {})  # stock strategies keep none
    return json.loads(json.dumps({k: d.as_dict() for k, d in decisions.items()}, default=str))


_SERIALS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_NEXT = itertools.count()


def _wrapper(trainer: L.Trainer, module: L.LightningModule) -> int:
    """The strategy's model as a serial number, one per object. Not ``id()``: a re-wrap frees the old DDP
    wrapper before it builds the next, which may then take the same address."""
    model = trainer.strategy.model
    if model not in _SERIALS:
        _SERIALS[model] = next(_NEXT)
    return _SERIALS[model]


READERS: dict[str, Reader] = {
    "params": lambda trainer, module: parameters_to_vector(module.parameters()).detach().clone(),
    "named_params": lambda trainer, module: {n: p.detach().clone().flatten() for n, p in module.named_parameters()},
    "state": lambda trainer, module: {  # a module's extra state (get_extra_state) is not a tensor
        k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        for k, v in module.state_dict().items()
    },
    "decisions": _decisions,  # the strategy's, as dicts (setting, value, reason)
    "wrapper": _wrapper,  # the DDP wrapper (or module) training runs through, as a serial number
    "global_step": lambda trainer, module: trainer.global_step,
    "lr": lambda trainer, module: trainer.optimizers[0].param_groups[0]["lr"],
    "optimizer": lambda trainer, module: copy.deepcopy(trainer.optimizers[0].state_dict()),
}

ONCE = ("on_train_start", "on_train_end", "on_fit_end")
EACH_BATCH = ("on_train_batch_start", "on_train_batch_end")
Fields = tuple[str, ...] | Mapping[str, str | Reader]


class RankRecorder(L.Callback):
    """What this rank saw at the hooks named by the keywords: written to ``out`` when the fit ends, or kept."""

    def __init__(
        self,
        out: Path | None = None,
        *,
        on_train_start: Fields = (),
        on_train_batch_start: Fields = (),
        on_train_batch_end: Fields = (),
        on_train_end: Fields = (),
        on_fit_end: Fields = (),
        suffix: str = ".json",
    ) -> None:
        given = dict(
            on_train_start=on_train_start, on_train_batch_start=on_train_batch_start,
            on_train_batch_end=on_train_batch_end, on_train_end=on_train_end, on_fit_end=on_fit_end,
        )  # fmt: skip
        self.readers = {hook: _readers(fields) for hook, fields in given.items()}
        self.out, self.suffix = out, suffix
        self.record: dict[str, Any] = {}

    def setup(self, trainer, pl_module, stage):
        self.record = {key: [] for hook in EACH_BATCH for key in self.readers[hook]}

    def _read(self, hook: str, trainer, pl_module) -> None:
        for key, read in self.readers[hook].items():
            if hook in ONCE:
                self.record[key] = read(trainer, pl_module)
            else:
                self.record[key].append(read(trainer, pl_module))

    def on_train_start(self, trainer, pl_module):
        self._read("on_train_start", trainer, pl_module)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._read("on_train_batch_start", trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._read("on_train_batch_end", trainer, pl_module)

    def on_train_end(self, trainer, pl_module):
        self._read("on_train_end", trainer, pl_module)

    def on_fit_end(self, trainer, pl_module):  # after the strategy's teardown
        self._read("on_fit_end", trainer, pl_module)
        if self.out is not None:
            write_rank_record(self.out, trainer.global_rank, self.record, self.suffix)
            self.record = {}


def _readers(fields: Fields) -> dict[str, Reader]:
    if not isinstance(fields, Mapping):
        fields = {name: name for name in fields}
    return {key: READERS[read] if isinstance(read, str) else read for key, read in fields.items()}


def write_rank_record(out: Path, rank: int, record: dict[str, Any], suffix: str = ".json") -> None:
    path = Path(out) / f"rank{rank}{suffix}"
    if suffix == ".pt":
        torch.save(record, path)
    else:
        path.write_text(json.dumps(record, default=_plain))


def read_rank_records(out: Path, world: int = 2, suffix: str = ".json") -> list[dict[str, Any]]:
    paths = [Path(out) / f"rank{r}{suffix}" for r in range(world)]
    if suffix == ".pt":
        return [torch.load(p, weights_only=True) for p in paths]
    return [json.loads(p.read_text()) for p in paths]


def _plain(value: Any) -> Any:
    """JSON for what ``json`` cannot write itself: a tensor as its (nested) list of numbers, else ``str``."""
    return value.tolist() if isinstance(value, torch.Tensor) else str(value)


class LastGrads(L.Callback):
    """Each rank's gradients at its last optimizer step (after DDP's all-reduce), in ``out/grads{rank}.pt``."""

    def __init__(self, out: str | Path) -> None:
        self.out = Path(out)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}
        torch.save(grads, self.out / f"grads{trainer.global_rank}.pt")


def watchdog_reports(output: str) -> list[tuple[int, str]]:
    """The watchdog's reports (a busy rank, the run not ended) as each rank printed them: (rank, line), in order."""
    reports = []
    for text in output.splitlines():
        head, sep, line = text.partition("] SoloDDP watchdog report: ")
        if sep and head.startswith("[rank: "):
            reports.append((int(head.removeprefix("[rank: ")), "SoloDDP watchdog report: " + line))
    return reports


def watchdog_lines(output: str) -> dict[int, str]:
    """The watchdog's verdict as each rank printed it (``[rank: r] SoloDDP watchdog: ...``), by rank. Every rank
    prints the same line: a rank printing another's, or twice, fails here."""
    lines: dict[int, str] = {}
    for text in output.splitlines():
        head, sep, line = text.partition("] SoloDDP watchdog: ")
        if sep and head.startswith("[rank: "):
            rank = int(head.removeprefix("[rank: "))
            assert rank not in lines, f"rank {rank} printed twice:\n{lines[rank]}\n{text}"
            lines[rank] = "SoloDDP watchdog: " + line
    assert len(set(lines.values())) <= 1, lines
    assert "SoloDDP watchdog:" not in "\n".join(t for t in output.splitlines() if not t.startswith("[rank: ")), output[
        -4000:
    ]  # no line without its rank
    return lines
