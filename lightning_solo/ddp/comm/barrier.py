"""A barrier that names the ranks that did not arrive, the gloo side group it runs on under NCCL, and one
strategy's groups beside DDP's (:class:`SideGroups`)."""

import re
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_solo._compat import torch as torch_compat
from lightning_solo.core.cluster import gloo_interface_warning
from lightning_solo.core.decision import Decision

_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def monitored_barrier(name: str | None, timeout: timedelta, group=None) -> None:
    """A barrier that, on timeout, raises naming the ranks that did not arrive (rank 0 lists them all)."""
    try:
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as err:
        label = f"barrier {name!r}" if name else "barrier"
        found = _MISSING.search(str(err))
        if found:
            ranks = [int(r) for r in found.group(1).replace(",", " ").split()]
            raise RuntimeError(
                f"{label} timed out after {timeout.total_seconds():g} s: rank(s) {ranks} did not arrive. "
                "They are stuck or took another code path (a rank-dependent branch, an exception on that rank); "
                "their logs say which. Raise the limit with SoloDDP(timeout=...)."
            ) from err
        raise RuntimeError(
            f"{label} failed on rank {dist.get_rank()} after waiting up to {timeout.total_seconds():g} s: "
            f"rank 0's error names the ranks that did not arrive ({err})"
        ) from err


SIDE_GROUP_TIMEOUT = timedelta(seconds=60)  # a healthy creation takes seconds, a wrong interface the whole timeout
WITHOUT_SIDE_GROUP = (
    "the monitored barrier (a plain one, which cannot name the ranks that did not arrive)",
    "find_unused_parameters='auto''s fast path (find_unused_parameters=True: DDP searches the graph every step)",
    "the SIGTERM agreement and its checkpoint (Lightning's per-batch broadcast)",
    "uneven_data (as stock: uneven data hangs or fails)",
    "SlurmRequeue's asynchronous agreement (a synchronous one at each batch end)",
)


def without_side_group(why: str) -> str:
    """``why`` there is no gloo side group, then what runs on it in an NCCL job and what each falls back to."""
    return f"{why}; without it: " + "; ".join(WITHOUT_SIDE_GROUP)


def backend_for(backend: str, device_type: str) -> str | None:
    """The backend a group string (``"gloo"``, ``"cuda:nccl,cpu:gloo"``) uses for ``device_type`` (or ``None``)."""
    if ":" not in backend:
        return backend
    pairs = dict(part.strip().split(":", 1) for part in backend.split(",") if part.strip())
    return pairs.get(device_type)


_groups: tuple[Any, dict[str, Any]] | None = None  # (the default group, the groups made in it by name)


def group_per_world(name: str, make: Callable[[], Any]) -> Any:
    """The group called ``name`` in the current default group: ``make()``'s at the first call (a collective), the
    same one until the default group changes."""
    global _groups
    world = dist.group.WORLD
    if _groups is None or _groups[0] is not world:
        _groups = (world, {})
    if name not in _groups[1]:
        _groups[1][name] = make()
    return _groups[1][name]


def gloo_group(name: str, timeout: timedelta | None) -> Any:
    """The default group's gloo group called ``name`` (:func:`group_per_world`'s), with ``timeout``."""
    group = group_per_world(name, lambda: dist.new_group(backend="gloo", timeout=timeout, group_desc=name))
    if timeout is not None:
        torch_compat.set_group_timeout(timeout, group)  # a later strategy's own timeout
    return group


def barrier_group(
    timeout: timedelta,
    *,
    side_group: bool = True,
    create_timeout: timedelta = SIDE_GROUP_TIMEOUT,
    create: Callable[[timedelta], Any] = lambda timeout: gloo_group("solo_gloo", timeout),
    backend: str | None = None,
    device: torch.device | None = None,
) -> tuple[Any, Decision]:
    """The group :func:`monitored_barrier` runs on, and why (a collective): the world on gloo, else a gloo side
    group made by ``create`` within ``create_timeout``, or ``None`` (a plain barrier). See docs/ranks.md."""
    world, seconds = dist.group.WORLD, f"{timeout.total_seconds():g} s"
    backend = backend or dist.get_backend()
    if backend_for(backend, "cpu") == "gloo":
        return world, Decision("barrier", "monitored", f"names the ranks that did not arrive within {seconds}")
    if not side_group:
        return None, Decision(
            "barrier", "plain", "gloo side group turned off (SoloDDP(gloo_side_group=False)); evidence over the world"
        )
    if not dist.is_gloo_available():
        decision = Decision("barrier", "plain", without_side_group("gloo is unavailable in this torch build"))
        _warn_off(decision, True)
        return None, decision
    group, error = None, None
    try:
        group = create(create_timeout)
        torch_compat.set_group_timeout(timeout, group)  # bounded creation; then the run's own collective timeout
    except Exception as err:  # noqa: BLE001 - any failure means: no side group on this rank
        group, error = None, err
    made = torch.tensor([group is not None], dtype=torch.int32, device=device)
    dist.all_reduce(made, op=dist.ReduceOp.MIN)
    if not made.item():  # once, at setup
        why = f"this rank: {type(error).__name__}: {error}" if error else "another rank failed"
        decision = Decision(
            "barrier",
            "plain",
            without_side_group(
                f"the gloo side group could not be made within {create_timeout.total_seconds():g} s ({why}); "
                "set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on, or "
                "SoloDDP(gloo_side_group=False) to go without it and this warning"
            ),
        )
        _warn_off(decision, error is not None)  # rank 0, and each rank with its own error to tell
        return None, decision
    return group, Decision(
        "barrier", "monitored (gloo side group)", f"NCCL has no monitored barrier; names missing ranks after {seconds}"
    )


def _warn_off(decision: Decision, own: bool) -> None:
    if own or dist.get_rank() == 0:
        warnings.warn(f"SoloDDP: no gloo side group: {decision.reason}", stacklevel=3)


class SideGroups:
    """One strategy's groups beside DDP's, shared with later strategies in the same default group: ``barrier``
    (:func:`barrier_group`) and :meth:`side`, the side channel."""

    def __init__(self, gloo: bool = True) -> None:
        self.gloo = bool(gloo)
        self.barrier: Any = None
        self.made = False  # the barrier's group
        self._side: Any = None
        self._side_made = False

    def setup(self, timeout: timedelta, device: torch.device, warn_interface: bool = False) -> Decision | None:
        """The barrier's group, once there is a live process group; ``warn_interface``: check gloo's interface."""
        if self.made or not (dist.is_available() and dist.is_initialized()):
            return None
        if self.gloo and warn_interface and (warning := gloo_interface_warning()):
            warnings.warn(warning, stacklevel=3)
        self.barrier, decision = barrier_group(timeout, side_group=self.gloo, device=device)
        self.made = True
        return decision

    @property
    def side_group(self) -> Any:  # the side channel if :meth:`side` made it, else None
        return self._side

    def side(self, timeout: timedelta | None) -> Any:
        """The side group (gloo, apart from DDP's), made on first use; ``None`` without gloo."""
        if not self._side_made:
            self._side_made = True
            self._side = gloo_group("solo_side", timeout) if self.barrier is dist.group.WORLD else self.barrier
        return self._side
