"""The moments of a training step at which SoloDDP calls its features: a feature takes part by returning
``{moment: callable}`` from ``step_hooks()``; one that is off or done returns nothing and costs no call
(docs/soloddp.md, "Per-step moments")."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

MOMENTS = ("batch", "boundary", "batch_start", "step", "backward", "optimizer_step", "after_step", "collective")


class Component(Protocol):
    def step_hooks(self) -> Mapping[str, Callable[..., Any]]: ...


class StepHooks:
    """Each moment's callables, rebuilt (:meth:`rebuild`) when a feature starts or stops taking part."""

    def __init__(self) -> None:
        self.by_moment: dict[str, list[Callable[..., Any]]] = {m: [] for m in MOMENTS}

    def rebuild(self, components: Iterable[Component]) -> None:
        by_moment: dict[str, list[Callable[..., Any]]] = {m: [] for m in MOMENTS}
        for component in components:
            for moment, fn in component.step_hooks().items():
                by_moment[moment].append(fn)  # a KeyError names a moment that does not exist
        self.by_moment = by_moment

    def around(self, moment: str, *args: Any) -> contextlib.AbstractContextManager[Any]:
        """A context inside every context ``moment``'s callables return (at least one), the first outermost."""
        fns = self.by_moment[moment]
        return fns[0](*args) if len(fns) == 1 else _all(fns, args)


@contextlib.contextmanager
def _all(fns: list[Callable[..., Any]], args: tuple[Any, ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for fn in fns:
            stack.enter_context(fn(*args))
        yield


class Listeners:
    """Callables held weakly (a bound method through its object) for this process: a copy or a pickle holds none."""

    def __init__(self) -> None:
        self._refs: list[Callable[[], Callable[..., Any] | None]] = []

    def add(self, fn: Callable[..., Any]) -> None:
        self._refs.append(weakref.WeakMethod(fn) if inspect.ismethod(fn) else weakref.ref(fn))

    def __call__(self, *args: Any) -> None:
        for ref in self._refs:
            if (fn := ref()) is not None:
                fn(*args)

    def clear(self) -> None:
        self._refs = []

    def __getstate__(self) -> dict[str, Any]:
        return {"_refs": []}
