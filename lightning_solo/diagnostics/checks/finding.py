"""Finding: one problem a check found, said with its fix, and the ranks it was found on.

Example::

    Finding("loader.pin_memory", "pin_memory is off on GPU: set DataLoader(pin_memory=True)", error=False)

Errors stop a run; warnings are printed (``Preflight(strict=True)`` makes them errors). Findings from several
ranks that say the same thing are merged into one that lists the ranks (:func:`merge`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Finding:
    """``check`` names what was checked (``"agree.torch"``, ``"env.RANK"``, ``"loader.num_workers"``)."""

    check: str
    message: str
    error: bool = False
    ranks: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = ""
        if self.ranks:
            where = f" (rank{'s' if len(self.ranks) > 1 else ''} {', '.join(map(str, self.ranks))})"
        return f"{'error' if self.error else 'warning'} [{self.check}]{where}: {self.message}"


def merge(per_rank: Iterable[tuple[int, Iterable[Finding]]]) -> list[Finding]:
    """One finding per distinct (check, message, severity), with every rank that reported it, in first-seen order."""
    merged: dict[tuple[str, str, bool], Finding] = {}
    for rank, findings in per_rank:
        for f in findings:
            key = (f.check, f.message, f.error)
            ranks = merged[key].ranks if key in merged else ()
            merged[key] = replace(f, ranks=tuple(sorted({*ranks, *f.ranks, rank})))
    return list(merged.values())
