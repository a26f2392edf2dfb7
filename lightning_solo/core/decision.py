"""The record of a choice lightning_solo made on the user's behalf: each automatic choice is one function
returning a :class:`Decision`; the strategy and callbacks keep them, and the run summary prints them."""

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
    """Mixin for the objects that choose on the user's behalf: ``decisions`` maps each setting to its latest
    :class:`Decision` (a choice made elsewhere, e.g. in a notebook's workers, goes into it directly)."""

    decisions: dict[str, Decision]

    def _decide(self, decision: Decision) -> Decision:
        self.decisions[decision.setting] = decision
        return decision

    def _keep(self, *decisions: Decision | None) -> None:
        """:meth:`_decide` each one given (``None``: nothing was decided)."""
        for decision in decisions:
            if decision is not None:
                self._decide(decision)
