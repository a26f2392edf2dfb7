"""Gradient communication for DDP: hooks chosen by name, registered on every device, resumable; and a
barrier that names the ranks that did not arrive.

Lightning registers ``ddp_comm_hook`` only on CUDA (a torch 1.8 limit that is long gone) and drops it
silently elsewhere; :class:`CommHook` registers on any backend (gloo on CPU included) and keeps the hook's
state (PowerSGD's iteration count, error feedback and warm-start memory; post-local-SGD's counters) in a
form that goes into a checkpoint and comes back on resume, whatever DDP's bucket layout is then.

Example::

    from lightning_solo import SoloDDP
    trainer = L.Trainer(devices=4, strategy=SoloDDP(comm_hook="powersgd", powersgd_rank=2))

    # on a raw DDP model (the process group is already initialised)
    hook = CommHook("fp16")
    print(hook.register(ddp_model))         # Decision: what was registered and why
    extra = hook.state_dict(ckpt_path)      # every rank: writes its error-feedback shard beside ckpt_path
"""

# No `from __future__ import annotations`: DDP inspects hook annotations at registration.
import glob
import hashlib
import io
import os
import re
import socket
import warnings
from datetime import timedelta
from math import prod
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel

from lightning_solo.decision import Decision

# batched_powerSGD_hook is deliberately absent: it fails an assertion in _orthogonalize in current torch.
COMM_HOOKS = (None, "fp16", "bf16", "powersgd", "post_local_sgd")
CHECKPOINT_KEY = "lightning_solo.comm_hook"
# DDP rebuilds its buckets once, at the start of its second iteration (later with static_graph); follow the
# layout for this many iterations after each registration, then stop checking.
_WATCH_ITERATIONS = 3


def check_bucket_cap_mb(bucket_cap_mb: Any) -> None:
    """DDP accepts a negative or zero bucket size and then misbehaves; refuse it up front."""
    if bucket_cap_mb is None:
        return
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
        raise ValueError(
            f"bucket_cap_mb={bucket_cap_mb!r} is not accepted: use a positive number of megabytes "
            "(DDP's default is 25) or None for the default"
        )


def _positive_int(name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is not accepted: use an integer >= {minimum}")
    return value


class _PowerSGDState(powersgd.PowerSGDState):
    """torch's PowerSGD state, plus what is needed to move it between bucket layouts.

    ``pending`` holds error feedback and warm-start Qs per parameter name, waiting for the bucket that holds
    those parameters; ``layout`` records which parameters each bucket holds (followed while ``watch`` > 0,
    after which DDP no longer re-buckets).
    """

    __slots__ = ("names", "shapes", "pending", "layout", "watch", "seen", "serial")


def resumable_powerSGD_hook(
    state: _PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook``, carried across DDP's bucket rebuild and across checkpoint/resume.

    torch keys error feedback and warm-start memory by bucket index, which is only valid for one bucket layout;
    DDP rebuilds its buckets after its first iteration, so state restored from a checkpoint (or kept across a
    re-wrap) would land in the wrong buckets. For the first few iterations this hook checks the layout and
    re-assembles the state per parameter when it changes; afterwards it is ``powerSGD_hook`` itself.
    """
    if state.watch:
        _follow_layout(state, bucket)
    fut = powersgd.powerSGD_hook(state, bucket)
    if state.serial:
        # powerSGD_hook issues its 2nd and 3rd all-reduce from future callbacks. On gloo those run when the
        # previous one completes, in a background thread, so with several buckets the ranks can issue them
        # in different orders and gloo aborts ("Received data size doesn't match"). Finishing each bucket
        # before DDP hands over the next keeps the order identical on all ranks.
        fut.wait()
    return fut


def bf16_compress_any_build_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """torch's ``bf16_compress_hook`` under another name: DDP refuses that name on CPU-only torch builds,
    although gloo all-reduces bfloat16 fine."""
    return default._compress_hook(torch.bfloat16, process_group, bucket)


def _bf16_hook():
    if torch.version.cuda is None and torch.version.hip is None:
        return bf16_compress_any_build_hook
    return default.bf16_compress_hook


def _follow_layout(state: _PowerSGDState, bucket: dist.GradBucket) -> None:
    index, params = bucket.index(), bucket.parameters()
    ids = tuple(id(p) for p in params)
    if state.layout.get(index, ids) != ids:
        # DDP re-bucketed at this iteration's forward. Buckets already reduced in this iteration kept their
        # parameters (and may still be writing their state, on NCCL): leave them, move the rest.
        _to_pending(state, keep=state.seen)
    if index not in state.layout:
        state.layout[index] = ids
        if state.pending:
            buffer = bucket.buffer()
            _assemble(state, index, ids, buffer.device, buffer.dtype)
    state.seen.add(index)
    if bucket.is_last():
        state.seen = set()
        state.watch -= 1
        if state.watch == 0:
            left = sorted(set(state.pending.get("error", {})) | set(state.pending.get("q", {})))
            if left:
                warnings.warn(
                    f"PowerSGD state for {left} matched no DDP bucket and was dropped", stacklevel=2
                )
            # The layout is final now (DDP rebuilds once); keep it for state_dict().
            state.pending = {}


def _q_order(shapes: list[torch.Size], state: powersgd.PowerSGDState) -> list[tuple[int, int, int]]:
    """(position in bucket, Q length, P length) of the tensors PowerSGD compresses, in its memory order.

    Mirrors ``powerSGD_hook``: a tensor is viewed as (shape[0], rest), compressed when worth it, and the
    compressed ones are grouped by matrix shape in order of first appearance.
    """
    groups: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for pos, shape in enumerate(shapes):
        n = shape[0]
        m = prod(shape) // n
        rank = min(n, m, state.matrix_approximation_rank)
        if powersgd._should_compress(n, m, rank, state.min_compression_rate)[0]:
            groups.setdefault((n, m), []).append((pos, m * rank, n * rank))
    return [item for group in groups.values() for item in group]


def _per_parameter(
    state: _PowerSGDState, layout: dict[int, tuple[int, ...]]
) -> dict[str, dict[str, torch.Tensor]]:
    """The live per-bucket state, split per parameter name (views, no copies)."""
    out: dict[str, dict[str, torch.Tensor]] = {"error": {}, "q": {}}
    for index, ids in layout.items():
        names = [state.names[i] for i in ids]
        shapes = [state.shapes[i] for i in ids]
        if index in state.error_dict:
            chunks = state.error_dict[index].split([prod(s) for s in shapes])
            out["error"].update(zip(names, chunks))
        if index in state.q_memory_dict:
            order = _q_order(shapes, state)
            q = state.q_memory_dict[index]
            if (
                sum(length for _, length, _ in order) != q.numel()
            ):  # torch changed its Q layout: restart warm start
                continue
            chunks = q.split([length for _, length, _ in order])
            out["q"].update((names[pos], chunk) for (pos, _, _), chunk in zip(order, chunks))
    return out


def _to_pending(state: _PowerSGDState, keep: set[int] = frozenset()) -> None:
    """Move the per-bucket state (except buckets ``keep``) into per-parameter ``pending``."""
    moving = {index: ids for index, ids in state.layout.items() if index not in keep}
    for kind, tensors in _per_parameter(state, moving).items():
        state.pending.setdefault(kind, {}).update((name, t.clone()) for name, t in tensors.items())
    for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
        for index in [i for i in memory if i not in keep]:
            del memory[index]
    state.layout = {index: ids for index, ids in state.layout.items() if index in keep}


def _assemble(state: _PowerSGDState, index: int, ids: tuple[int, ...], device, dtype) -> None:
    names = [state.names[i] for i in ids]
    shapes = [state.shapes[i] for i in ids]
    errors = state.pending.get("error", {})
    if any(name in errors for name in names):
        state.error_dict[index] = torch.cat(
            [
                errors.pop(name).reshape(-1).to(device, dtype)
                if name in errors
                else torch.zeros(prod(s), device=device, dtype=dtype)
                for name, s in zip(names, shapes)
            ]
        )
    qs = state.pending.get("q", {})
    order = _q_order(shapes, state)
    found = [qs.pop(names[pos], None) for pos, _, _ in order]
    if order and all(q is not None and q.numel() == length for q, (_, length, _) in zip(found, order)):
        state.q_memory_dict[index] = torch.cat([q.reshape(-1) for q in found]).to(device, dtype)
        # P is overwritten before it is read; it only has to exist so that torch warm-starts from Q.
        p_length = sum(p for _, _, p in order)
        state.p_memory_dict[index] = torch.empty(p_length, device=device, dtype=dtype)


def _rng_state(rng) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = rng.get_state()
    return {
        "keys": torch.from_numpy(keys.astype("int64")),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _set_rng_state(rng, saved: dict[str, Any]) -> None:
    keys = saved["keys"].numpy().astype("uint32")
    rng.set_state(("MT19937", keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"]))


def node_groups(nodes: list[Any]) -> list[list[int]]:
    """The ranks of each node, given each rank's node (``nodes[rank]``), in order of first appearance."""
    groups: dict[Any, list[int]] = {}
    for rank, node in enumerate(nodes):
        groups.setdefault(node, []).append(rank)
    return list(groups.values())


def average_in_place(params: list[torch.Tensor], group: Any = None) -> None:
    """Average ``params`` over ``group`` (a collective), writing into each parameter's own storage.

    torch's ``average_parameters`` makes every ``p.data`` a view of one flat buffer: ``channels_last`` weights
    turn contiguous, convolutions re-layout on every call and DDP warns about mismatched strides.
    """
    if not params:
        return
    flat = torch.cat([p.detach().reshape(-1) for p in params])  # one all-reduce; reshape copies each once
    flat /= dist.get_world_size(group)
    dist.all_reduce(flat, group=group)
    for p, chunk in zip(params, flat.split([p.numel() for p in params])):
        p.detach().copy_(chunk.view(p.shape))  # copy_ honours p's strides


class InPlaceAverager(PeriodicModelAverager):
    """torch's ``PeriodicModelAverager`` (same ``period``/``warmup_steps``/``step``) averaging with
    :func:`average_in_place`, so parameters keep their memory layout."""

    def average_parameters(self, params) -> None:
        if self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0:
            average_in_place(list(params), self.process_group)
        self.step += 1


class CommHook:
    """A DDP gradient communication hook chosen by name, registered on any device, with checkpointable state.

    Args:
        name: ``None`` (exact all-reduce), ``"fp16"``/``"bf16"`` (compress gradients to 16 bits),
            ``"powersgd"`` (low-rank compression with error feedback), or ``"post_local_sgd"`` (local steps,
            parameters averaged every ``local_sgd_period`` steps after ``local_sgd_warmup`` synchronous ones).
        powersgd_rank: PowerSGD's matrix approximation rank (higher: more accurate, more bytes).
        powersgd_start_iter: steps of exact all-reduce before PowerSGD starts compressing (>= 2).
        local_sgd_period: post-local-SGD: average parameters across all ranks every this many steps.
        local_sgd_warmup: post-local-SGD: fully synchronous steps before local steps start.

    Example::

        hook = CommHook("powersgd", powersgd_rank=2, powersgd_start_iter=100)
        decision = hook.register(ddp_model)        # any backend: gloo, nccl
        state = hook.state_dict(path)              # every rank: its own error-feedback shard beside path
        hook.load_state_dict(state, path)          # every rank, before or after register()
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 1000,
        local_sgd_period: int = 4,
        local_sgd_warmup: int = 100,
    ) -> None:
        if name not in COMM_HOOKS:
            raise ValueError(
                f"comm_hook={name!r} is not accepted: use one of {COMM_HOOKS} "
                "(batched PowerSGD is not offered: it is broken in current torch)"
            )
        self.name = name
        self.powersgd_rank = _positive_int("powersgd_rank", powersgd_rank)
        # torch requires > 1 with error feedback/warm start: DDP re-buckets after its first iteration.
        self.powersgd_start_iter = _positive_int("powersgd_start_iter", powersgd_start_iter, minimum=2)
        self.local_sgd_period = _positive_int("local_sgd_period", local_sgd_period)
        self.local_sgd_warmup = _positive_int("local_sgd_warmup", local_sgd_warmup, minimum=0)
        self.state: Any = None
        self.hook: Any = None
        self.averager: Any = None
        self._saved: dict[str, Any] = {}
        self._saved_path: Any = None

    @property
    def averaging_period(self) -> int | None:
        """The model-averaging period Lightning's DDPStrategy needs for post-local-SGD, else None."""
        return self.local_sgd_period if self.name == "post_local_sgd" else None

    def register(self, ddp: DistributedDataParallel, *, node: Any = None) -> Decision:
        """Register the hook on ``ddp`` (every backend) and return the decision for the run summary.

        ``node`` names this rank's node (default: its hostname); post-local-SGD all-reduces gradients within
        the ranks of each node, whatever their rank numbers. Calling it again on a new DDP wrapper of the same
        module keeps the hook's state.
        """
        if self.name is None:
            return Decision("comm_hook", None, "exact all-reduce in the gradients' dtype (DDP's default)")
        if self.name in ("fp16", "bf16"):
            self.hook = default.fp16_compress_hook if self.name == "fp16" else _bf16_hook()
            _register_ddp_comm_hook(model=ddp, ddp_comm_hook=self.hook)
            error = "~1e-3" if self.name == "fp16" else "~1e-2"
            return Decision(
                "comm_hook",
                self.name,
                f"gradients all-reduced in {self.name}: half the bytes, {error} relative error",
            )
        if self.name == "powersgd":
            return self._register_powersgd(ddp)
        return self._register_post_local_sgd(ddp, socket.gethostname() if node is None else node)

    def _register_powersgd(self, ddp: DistributedDataParallel) -> Decision:
        if self.state is None:
            self.state = _PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start_iter,
            )
            self.state.pending = {}
        else:  # a re-wrap: bring the state into per-parameter form for the new buckets
            _to_pending(self.state)
        named = list(ddp.module.named_parameters())
        self.state.names = {id(p): name for name, p in named}
        self.state.shapes = {id(p): p.shape for _, p in named}
        self.state.layout, self.state.seen, self.state.watch = {}, set(), _WATCH_ITERATIONS
        # Only NCCL on CUDA tensors runs the hook's chained collectives in issue order (see the hook).
        self.state.serial = backend_for(dist.get_backend(ddp.process_group), ddp.device_type) != "nccl"
        self.hook = resumable_powerSGD_hook
        self._apply_saved()
        _register_ddp_comm_hook(model=ddp, ddp_comm_state=self.state, ddp_comm_hook=self.hook)
        serial = (
            "; on gloo each bucket finishes before the next, to keep collectives in order"
            if self.state.serial
            else ""
        )
        return Decision(
            "comm_hook",
            "powersgd",
            f"PowerSGD rank {self.powersgd_rank} with error feedback after {self.powersgd_start_iter} exact steps "
            f"(torch's powerSGD_hook; its batched variant is broken in current torch){serial}",
        )

    def _register_post_local_sgd(self, ddp: DistributedDataParallel, node: Any) -> Decision:
        world = dist.get_world_size()
        if self.state is None:
            nodes: list[Any] = [None] * world
            dist.all_gather_object(nodes, node)
            groups = node_groups(nodes)
            if 1 < len(groups) < world:
                # Ranks of a node need not be contiguous (SLURM's cyclic distribution): group by the real node.
                subgroup, _ = dist.new_subgroups_by_enumeration(groups)
                sizes = sorted({len(g) for g in groups})
                between = f"gradients all-reduced within each of {len(groups)} nodes ({'/'.join(map(str, sizes))} ranks)"
            else:  # one node (or one process per node): nothing cheaper to all-reduce over than the world
                subgroup, between = None, "no gradient communication"
            self.state = post_local.PostLocalSGDState(
                process_group=None,
                subgroup=subgroup,
                start_localSGD_iter=self.local_sgd_warmup,
                post_local_gradient_allreduce=subgroup is not None,
            )
            self._between = between
        self.hook = post_local.post_localSGD_hook
        self._apply_saved()
        _register_ddp_comm_hook(model=ddp, ddp_comm_state=self.state, ddp_comm_hook=self.hook)
        return Decision(
            "comm_hook",
            "post_local_sgd",
            f"{self.local_sgd_warmup} synchronous steps, then {self._between} between steps and parameters "
            f"averaged over all {world} ranks every {self.local_sgd_period} steps",
        )

    def attach_averager(self, averager: PeriodicModelAverager) -> PeriodicModelAverager:
        """Post-local-SGD: take Lightning's ``PeriodicModelAverager`` and return the one to use instead: same
        schedule, but averaging in place (see :func:`average_in_place`)."""
        self.averager = InPlaceAverager(averager.period, averager.warmup_steps, averager.process_group)
        self._apply_saved()
        return self.averager

    def average_parameters(self, module: torch.nn.Module) -> None:
        """Average ``module``'s trainable parameters over all ranks now (collective)."""
        average_in_place([p for p in module.parameters() if p.requires_grad])

    def state_dict(self, checkpoint_path: Any = None) -> dict[str, Any]:
        """The hook's state for a checkpoint. A collective for PowerSGD: call it on every rank.

        PowerSGD's error feedback differs per rank and is as large as the gradients, so it is never gathered:
        with ``checkpoint_path``, each rank writes its own atomically into :func:`shard_dir` beside it and
        the result (for rank 0's checkpoint) records every shard's sha256; without (a notebook parent's copy
        for the next fit, small models), every rank's is gathered. Q memory and counters are the same on all
        ranks.
        """
        if self.state is None:
            return {}
        if self.name == "post_local_sgd":
            step = self.averager.step if self.averager is not None else None
            return {"hook": self.name, "iter": self.state.iter, "averager_step": step}
        state = self.state
        live = _per_parameter(state, state.layout)
        errors = {**state.pending.get("error", {}), **live["error"]}
        qs = {**state.pending.get("q", {}), **live["q"]}
        mine = {name: t.detach().cpu().clone() for name, t in errors.items()}
        saved = {
            "hook": self.name,
            "world_size": dist.get_world_size(),
            "iter": state.iter,
            "rng": _rng_state(state.rng),
            "stats": [
                state.total_numel_before_compression,
                state.total_numel_after_compression,
                state.next_stats_report,
            ],
            "q": {name: t.detach().cpu().clone() for name, t in qs.items()},
        }
        if checkpoint_path is None:  # for a notebook's next fit: every rank's, gathered (a collective)
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine)
            return {**saved, "error": gathered}
        digests: list[Any] = [None] * dist.get_world_size()
        stem = os.path.join(shard_dir(checkpoint_path), f"rank{dist.get_rank()}")
        dist.all_gather_object(digests, _write_shard(stem, mine))
        return {**saved, "shards": {"dir": os.path.basename(shard_dir(checkpoint_path)), "sha256": digests}}

    def load_state_dict(self, saved: dict[str, Any] | None, checkpoint_path: Any = None) -> None:
        """Take back :meth:`state_dict`'s result, on every rank; applied now or at :meth:`register`.
        ``checkpoint_path``: the checkpoint it came from, beside which this rank's shard is read."""
        if not saved:
            return
        if saved.get("hook") != self.name:
            warnings.warn(
                f"the checkpoint holds state for comm_hook={saved.get('hook')!r}, this run uses {self.name!r}: ignored",
                stacklevel=2,
            )
            return
        # Kept as given until a rank applies it (a notebook parent holds it without a process group).
        self._saved, self._saved_path = dict(saved), checkpoint_path
        if self.state is not None:
            self._apply_saved()

    def _this_ranks_errors(self, saved: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        world, rank = dist.get_world_size(), dist.get_rank()
        if saved.get("world_size", world) != world:
            warnings.warn(
                f"PowerSGD error feedback was saved with {saved['world_size']} ranks and this run has {world}: it "
                "restarts from zero",
                stacklevel=2,
            )
            return None
        if "shards" in saved:
            return _read_shard(self._saved_path, saved["shards"], rank)
        if isinstance(saved.get("error"), list):  # every rank's, gathered (a notebook's second fit)
            return saved["error"][rank]
        return saved.get("error")

    def _apply_saved(self) -> None:
        saved, state = self._saved, self.state
        if not saved or state is None:
            return
        if self.name == "post_local_sgd":
            state.iter = saved["iter"]
            if self.averager is not None and saved.get("averager_step") is not None:
                self.averager.step = saved["averager_step"]
                self._saved = {}
            return
        state.iter = saved["iter"]
        _set_rng_state(state.rng, saved["rng"])
        state.total_numel_before_compression, state.total_numel_after_compression, state.next_stats_report = (
            saved["stats"]
        )
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        state.pending = {"q": dict(saved["q"]), "error": dict(self._this_ranks_errors(saved) or {})}
        state.layout, state.seen, state.watch = {}, set(), _WATCH_ITERATIONS
        self._saved = {}


# PowerSGD error feedback, one file per rank: <checkpoint>.powersgd/rank<r>.<sha256 prefix>.pt. The digest in
# the name keeps the files a checkpoint references intact while the same path is saved again (last.ckpt).
_SHARD_SUFFIX = ".powersgd"


def shard_dir(checkpoint_path: Any) -> str:
    """The folder of a checkpoint's PowerSGD shards; remove it with the checkpoint:
    ``shutil.rmtree(shard_dir(path), ignore_errors=True)``."""
    return os.fspath(checkpoint_path) + _SHARD_SUFFIX


def _write_shard(stem: str, errors: dict[str, torch.Tensor]) -> str:
    """Write atomically (temporary file, fsync, rename) and return the sha256 of the bytes."""
    buffer = io.BytesIO()
    torch.save(errors, buffer)
    data = buffer.getbuffer()
    digest = hashlib.sha256(data).hexdigest()
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    path = f"{stem}.{digest[:16]}.pt"
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    # This rank's shards of earlier saves to this path: the newest stays, the checkpoint file on disk may
    # still be that save's until rank 0 has replaced it.
    older = sorted((p for p in glob.glob(f"{glob.escape(stem)}.*.pt") if p != path), key=os.path.getmtime)
    for stale in older[:-1]:
        os.remove(stale)
    return digest


def _read_shard(checkpoint_path: Any, record: dict[str, Any], rank: int) -> dict[str, torch.Tensor]:
    if checkpoint_path is None:
        raise ValueError("this PowerSGD state keeps its error feedback in shard files: pass checkpoint_path")
    # Beside the file itself (last.ckpt may be a link), under the name recorded when it was saved (or copied).
    folder = os.path.join(os.path.dirname(os.path.realpath(checkpoint_path)), record["dir"])
    digest = record["sha256"][rank]
    path = os.path.join(folder, f"rank{rank}.{digest[:16]}.pt")
    problem = None
    if not os.path.isfile(path):
        problem = "is missing"
    else:
        with open(path, "rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != digest:
                problem = "does not match the sha256 the checkpoint recorded (damaged or from another save)"
    if problem:
        raise RuntimeError(
            f"PowerSGD error feedback of rank {rank} for {os.fspath(checkpoint_path)!r}: {path!r} {problem}. "
            f"Each rank's shard is written beside the checkpoint, in {record['dir']!r}; copy that folder with "
            "the checkpoint, or resume from another checkpoint."
        )
    return torch.load(path, mmap=True, weights_only=True)


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


def backend_for(backend: str, device_type: str) -> str | None:
    """The backend a group string uses for ``device_type`` tensors: ``"gloo"`` for any device, and
    ``"cuda:nccl,cpu:gloo"`` per device (``None`` when that device has none)."""
    if ":" not in backend:
        return backend
    pairs = dict(part.strip().split(":", 1) for part in backend.split(",") if part.strip())
    return pairs.get(device_type)


def _new_gloo_group(timeout: timedelta):
    return dist.new_group(backend="gloo", timeout=timeout)


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
    failed on any rank: the ranks agree over the world group, so they all take the same path.
    ``backend``/``device`` default to the world's backend and the device its collectives use.
    """
    world, seconds = dist.group.WORLD, f"{timeout.total_seconds():g} s"
    backend = backend or dist.get_backend()
    if backend_for(backend, "cpu") == "gloo":
        return world, Decision("barrier", "monitored", f"names the ranks that did not arrive within {seconds}")
    if not side_group:
        return None, Decision(
            "barrier", "plain", "gloo side group turned off (SoloDDP(gloo_side_group=False)); evidence over the world"
        )
    if not dist.is_gloo_available():
        return None, Decision("barrier", "plain", "gloo is unavailable, so a timed-out barrier cannot name the missing ranks")
    group, error = None, None
    try:
        group = create(create_timeout)
        dist.set_timeout(timeout, group)  # bounded creation; then the run's own collective timeout
    except Exception as err:  # noqa: BLE001 - any failure means: no side group on this rank
        group, error = None, err
    made = torch.tensor([group is not None], dtype=torch.int32, device=device or _world_device(backend))
    dist.all_reduce(made, op=dist.ReduceOp.MIN)
    if not made.item():  # once, at setup
        why = f"this rank: {type(error).__name__}: {error}" if error else "another rank failed"
        return None, Decision(
            "barrier",
            "plain",
            f"the gloo side group could not be made within {create_timeout.total_seconds():g} s ({why}); "
            "set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on, or "
            "SoloDDP(gloo_side_group=False) to skip it",
        )
    return group, Decision(
        "barrier", "monitored (gloo side group)", f"NCCL has no monitored barrier; names missing ranks after {seconds}"
    )


def _world_device(backend: str) -> torch.device:
    if backend_for(backend, "cuda") is not None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
