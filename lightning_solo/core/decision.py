"""The record of a choice lightning_solo made on the user's behalf.

Every automatic choice (unused parameters, SyncBN, precision, lr scale, comm hook, ...) is made in one
function that returns a :class:`Decision`; the strategy and callbacks keep them, and the run summary
prints them. Nothing is decided silently, nothing twice.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Decision:
    """What was chosen for ``setting`` and why."""

    setting: str
    value: Any
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.setting} = {self.value!r} ({self.reason})"


class DecisionLog:
    """Mixin for the objects that choose on the user's behalf (strategy, precision plugin, callbacks):
    ``self.decisions`` maps each setting to its latest :class:`Decision`; the run summary reads it."""

    decisions: dict[str, Decision]

    def _decide(self, decision: Decision) -> Decision:
        self.decisions[decision.setting] = decision
        return decision

    def record(self, decision: Decision) -> Decision:
        """Keep ``decision``, made on this owner's behalf elsewhere (the runner's restart resume, a notebook's
        forked fit), for the run summary; quietly, where an owner's ``_decide`` also announces its own choices."""
        self.decisions[decision.setting] = decision
        return decision
