"""Finding: one problem a check found, with its fix and the ranks it was found on."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Finding:
    """``check`` names what was checked (``"agree.torch"``, ``"env.RANK"``, ``"loader.num_workers"``)."""

    check: str
    message: str
    error: bool = False
    ranks: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = f" ({ranks_text(self.ranks)})" if self.ranks else ""
        return f"{'error' if self.error else 'warning'} [{self.check}]{where}: {self.message}"


def ranks_text(ranks: Sequence[int]) -> str:
    """``"rank 1"``, ``"ranks 1, 2"``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def merge(per_rank: Iterable[tuple[int, Iterable[Finding]]]) -> list[Finding]:
    """One finding per distinct (check, message, severity), with every rank that reported it, in first-seen order."""
    merged: dict[tuple[str, str, bool], Finding] = {}
    for rank, findings in per_rank:
        for f in findings:
            key = (f.check, f.message, f.error)
            ranks = merged[key].ranks if key in merged else ()
            merged[key] = replace(f, ranks=tuple(sorted({*ranks, *f.ranks, rank})))
    return list(merged.values())
