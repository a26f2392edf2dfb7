"""End-of-fit advice from DDP's own logging data (unused parameters, ``static_graph``, comm hook, buckets), and
the words added to DDP's reducer errors. See docs/diagnostics.md."""

from __future__ import annotations

import re
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from lightning_solo._compat import torch as torch_compat
from lightning_solo.ddp.unused.policy import Phase, UnusedParameters

_MIB = 2**20
_REDUCER_ERRORS = ("Expected to mark a variable ready only once", "Expected to have finished reduction")
# Where DDP's reducer errors list parameter indices (presentation only).
_INDICES = re.compile(r"(?:did not receive grad for rank \d+|Parameter at index)[: ]+([\d ,]+)")


def _names(names: list[str], limit: int = 6) -> str:
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _ms(nanoseconds: Any) -> float:
    return (nanoseconds or 0) / 1e6


def ddp_advice(ddp: DistributedDataParallel, unused: UnusedParameters | None = None) -> list[str]:
    """Short actionable lines about ``ddp``'s run; ``unused``: SoloDDP's unused-parameter policy, if any."""
    data = torch_compat.ddp_logging_data(ddp)
    lines: list[str] = []
    static_graph = bool(getattr(ddp, "static_graph", False))
    graph_static = bool(data.get("can_set_static_graph") or torch_compat.ddp_graph_static(ddp))
    unused_bytes = int(data.get("unused_parameter_size") or 0)

    phase = unused.phase if unused is not None else Phase.USER
    if unused is not None and phase is Phase.EXCLUDING:
        lines.append(
            f"{len(unused.unused_names)} parameters ({unused.unused_bytes / _MIB:.2f} MiB) never receive a gradient "
            f"and are excluded from synchronisation; freeze (requires_grad=False) or remove them: "
            f"{_names(unused.unused_names)}"
        )
    elif ddp.find_unused_parameters and not static_graph:
        which = f" ({_names(unused.varying_names)})" if unused is not None and unused.varying_names else ""
        lines.append(
            f"find_unused_parameters=True: DDP searches the autograd graph every step; {unused_bytes / _MIB:.2f} MiB "
            f"of parameters got no gradient in the last sampled step{which}"
        )
        if graph_static and unused_bytes == 0 and phase is Phase.USER:
            lines.append(
                "no parameter went unused in the sampled steps: find_unused_parameters='auto' (SoloDDP's default) "
                "would take the fast path"
            )
        elif graph_static:
            lines.append(
                "DDP saw the same set of unused parameters on every step: static_graph=True would skip the per-step "
                "search (only if the model's control flow can never change)"
            )
    else:
        lines.append("every synchronised parameter received a gradient: DDP's fast path (find_unused_parameters=False)")

    # DDP re-buckets after its first iteration (in gradient-ready order); the rebuilt sizes are the live ones.
    layout = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
    sizes = [int(s) for s in str(layout).split(",") if s.strip()]
    cap = int(data.get("bucket_cap_bytes") or 0)
    total = int(data.get("total_parameter_size_bytes") or sum(sizes))
    comm, compute = _ms(data.get("avg_backward_comm_time")), _ms(data.get("avg_backward_compute_time"))
    overlap = _ms(data.get("avg_backward_compute_comm_overlap_time"))
    hook = data.get("comm_hook")
    timing = f" (backward: {compute:.1f} ms compute, {comm:.1f} ms communication, {overlap:.1f} ms overlapped)"
    timing = timing if comm or compute else ""
    if hook:
        lines.append(f"comm hook in use: {hook}{timing}")
    elif (
        int(data.get("world_size") or 1) > 1
        and comm > compute > 0
        and total > _MIB
        and getattr(ddp, "device_type", None) == "cuda"
    ):
        # Below ~1 MiB an all-reduce costs its latency, which compression does not shorten; over gloo on CPU the
        # hooks measured slower than exact all-reduce (benchmarks/RESULTS.md): advised on GPUs only.
        lines.append(
            f"no comm hook and communication exceeds backward compute{timing}: comm_hook='auto' measures bf16 "
            "(half the traffic), fp16 and PowerSGD against exact all-reduce and keeps the fastest"
        )
    else:
        lines.append(f"no comm hook: exact all-reduce{timing}")

    if sizes:
        line = f"{len(sizes)} gradient bucket(s) for {total / _MIB:.2f} MiB of gradients, bucket_cap_mb={cap / _MIB:g}"
        if len(sizes) == 1 and comm > overlap and total > 4 * _MIB:
            line += (
                f": one bucket is all-reduced only after the whole backward; bucket_cap_mb={max(1, total // 4 // _MIB)}"
                " lets communication overlap it"
            )
        lines.append(line)
    if not data.get("gradient_as_bucket_view"):
        lines.append("gradient_as_bucket_view=False: True saves one copy of the gradients (SoloDDP's default)")
    return lines


def explain_reducer_error(exception: BaseException, unused: UnusedParameters) -> None:
    """Add to a DDP reducer error what "auto" was doing, the parameters its indices stand for, and what to do.
    Only words are added; nothing is decided from the error's text."""
    text = str(exception)
    if not isinstance(exception, RuntimeError) or not any(m in text for m in _REDUCER_ERRORS):
        return
    indices = [int(i) for found in _INDICES.findall(text) for i in re.findall(r"\d+", found)]
    names = [name for i in indices if (name := unused.reducer_name(i)) is not None]
    named = f" DDP's parameter indices there are: {', '.join(names)}." if names else ""
    exception.args = (
        f"{text}\n\nSoloDDP (find_unused_parameters='auto', {unused.phase.value} phase, DDP built with "
        f"find_unused_parameters={unused.find_unused}) at synchronised step {unused.steps}.{named} Usual causes: "
        "a parameter used twice in one backward under reentrant activation checkpointing (pass "
        "use_reentrant=False), requires_grad changed inside training_step (change it at a batch boundary, "
        "in a callback), or an output of forward left out of the loss. Otherwise set "
        "find_unused_parameters=True.",
        *exception.args[1:],
    )
