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
    """A barrier that, on timeout, raises naming the ranks that did not arrive (gloo / CPU-capable groups).

    Rank 0 waits for every rank (``wait_all_ranks``) so its error lists all missing ranks; the others fail
    with a pointer to rank 0's error.
    """
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


# Creating the gloo side group connects every pair of ranks over the network interface gloo picks from the
# hostname; on a wrong one it would wait the whole collective timeout. Healthy creation takes seconds.
SIDE_GROUP_TIMEOUT = timedelta(seconds=60)


# What runs on the gloo side group of an NCCL job, and what each does without it.
WITHOUT_SIDE_GROUP = (
    "the monitored barrier (a plain one, which cannot name the ranks that did not arrive)",
    "find_unused_parameters='auto''s fast path (find_unused_parameters=True: DDP searches the graph every step)",
    "the SIGTERM agreement and its checkpoint (Lightning's per-batch broadcast)",
    "uneven_data (as stock: uneven data hangs or fails)",
    "SlurmRequeue's asynchronous agreement (a synchronous one at each batch end)",
)


def without_side_group(why: str) -> str:
    """``why`` there is no gloo side group, then what that turns off and what each falls back to."""
    return f"{why}; without it: " + "; ".join(WITHOUT_SIDE_GROUP)


def backend_for(backend: str, device_type: str) -> str | None:
    """The backend a group string uses for ``device_type`` tensors: ``"gloo"`` for any device, and
    ``"cuda:nccl,cpu:gloo"`` per device (``None`` when that device has none)."""
    if ":" not in backend:
        return backend
    pairs = dict(part.strip().split(":", 1) for part in backend.split(",") if part.strip())
    return pairs.get(device_type)


_groups: tuple[Any, dict[str, Any]] | None = None  # (the default group, the groups made in it by name)


def group_per_world(name: str, make: Callable[[], Any]) -> Any:
    """The group called ``name`` in the current default group: ``make()``'s at the first call (a group creation is a
    collective: call it on every rank alike), the same group at every later call until the default group changes.

    A group keeps its connections and their threads until the default group is destroyed, so one made per strategy
    instance would leave them behind each fit in a notebook or in processes that run many fits.
    """
    global _groups
    world = dist.group.WORLD
    if _groups is None or _groups[0] is not world:
        _groups = (world, {})
    if name not in _groups[1]:
        _groups[1][name] = make()
    return _groups[1][name]


def gloo_group(name: str, timeout: timedelta | None) -> Any:
    """The default group's gloo group called ``name`` (named in flight records and the watchdog's verdict), with
    ``timeout``: :func:`group_per_world`'s, made once and shared by every later strategy."""
    group = group_per_world(name, lambda: dist.new_group(backend="gloo", timeout=timeout, group_desc=name))
    if timeout is not None:
        torch_compat.set_group_timeout(timeout, group)  # a later strategy's own timeout
    return group


def _new_gloo_group(timeout: timedelta):
    return gloo_group("solo_gloo", timeout)


def barrier_group(
    timeout: timedelta,
    *,
    side_group: bool = True,
    create_timeout: timedelta = SIDE_GROUP_TIMEOUT,
    create=_new_gloo_group,
    backend: str | None = None,
    device: torch.device | None = None,
) -> tuple[Any, Decision]:
    """The group :func:`monitored_barrier` (and the unused-parameter evidence) runs on, and why: a collective,
    call it on every rank, once.

    The world when it runs CPU tensors on gloo (``"gloo"``, ``"cuda:nccl,cpu:gloo"``). For NCCL, which has no
    monitored barrier, a gloo side group made by ``create`` within ``create_timeout``; ``None`` (a plain
    barrier, evidence over the world) when ``side_group`` is False, gloo is unavailable, or the creation
    failed on any rank: the ranks agree over the world group, so they all take the same path. The last two
    warn (rank 0, and a rank whose own creation failed), naming what goes without it (:data:`WITHOUT_SIDE_GROUP`).
    ``backend``/``device`` default to the world's backend and the device its collectives use.
    """
    world, seconds = dist.group.WORLD, f"{timeout.total_seconds():g} s"
    backend = backend or dist.get_backend()
    if backend_for(backend, "cpu") == "gloo":
        return world, Decision("barrier", "monitored", f"names the ranks that did not arrive within {seconds}")
    if not side_group:
        return None, Decision(
            "barrier",
            "plain",
            "gloo side group turned off (SoloDDP(gloo_side_group=False)); evidence over the world",
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
    made = torch.tensor([group is not None], dtype=torch.int32, device=device or _world_device(backend))
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
        "barrier",
        "monitored (gloo side group)",
        f"NCCL has no monitored barrier; names missing ranks after {seconds}",
    )


def _warn_off(decision: Decision, own: bool) -> None:
    if own or dist.get_rank() == 0:
        warnings.warn(f"SoloDDP: no gloo side group: {decision.reason}", stacklevel=3)


def _world_device(backend: str) -> torch.device:
    if backend_for(backend, "cuda") is not None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class SideGroups:
    """One strategy's groups beside DDP's, made at its first setup on every rank alike (a group creation is a
    collective), kept across its fits and shared with later strategies in the same default group
    (:func:`gloo_group`): ``barrier``, the monitored barrier's group (:func:`barrier_group`; ``None``: the plain
    barrier), and :meth:`side`, the side channel.

    Example::

        groups = SideGroups(gloo=True)                       # SoloDDP(gloo_side_group=True)
        decision = groups.setup(timeout, device, warn_interface=True)   # each setup; the first makes them
        groups.side(timeout)                                 # the unused-parameter evidence, the agreements
    """

    def __init__(self, gloo: bool = True) -> None:
        self.gloo = bool(gloo)
        self.barrier: Any = None
        self.made = False  # the barrier's group
        self._side: Any = None
        self._side_made = False

    def setup(self, timeout: timedelta, device: torch.device, warn_interface: bool = False) -> Decision | None:
        """The barrier's group, the first time there is a live process group (none where ``init_process_group``
        is mocked, as in Lightning's own strategy tests: the next setup makes it). ``warn_interface``: warn when
        gloo would pick a network interface other nodes may not reach (one rank per node says it)."""
        if self.made or not (dist.is_available() and dist.is_initialized()):
            return None
        if self.gloo and warn_interface and (warning := gloo_interface_warning()):
            warnings.warn(warning, stacklevel=3)
        self.barrier, decision = barrier_group(timeout, side_group=self.gloo, device=device)
        self.made = True
        return decision

    @property
    def side_group(self) -> Any:
        """The side channel if :meth:`side` made it, else ``None``."""
        return self._side

    def side(self, timeout: timedelta | None) -> Any:
        """The side group, made on first use: apart from DDP's, for the collectives "auto" issues while DDP may
        still hold buckets back (the fast path's usage map, a gradient-carrying all_gather's backward), and the
        agreements: gloo matches collectives per group. ``None`` without gloo ("auto" then stays on True)."""
        if not self._side_made:
            self._side_made = True
            if self.barrier is dist.group.WORLD:  # the world runs gloo (on CPU tensors): a group of its own
                self._side = gloo_group("solo_side", timeout)
            else:  # the gloo side group of an nccl job, or None where gloo could not be had in time
                self._side = self.barrier
        return self._side
