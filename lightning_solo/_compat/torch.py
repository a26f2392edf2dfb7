"""Private torch names the pack uses, one accessor each, checked on torch 2.11.0 and 2.14.1 (tests/test_compat.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

# Base classes the pack checks against or subclasses (checked on torch 2.11.0 and 2.14.1).
BatchNormBase = _BatchNorm
DispatchMode = TorchDispatchMode

# DDP's own names the pack reads or sets (checked on torch 2.11.0 and 2.14.1); the compat test asserts each exists.
DDP_IGNORED_FLAG = "_ddp_ignored"  # set by DDP on each parameter it ignores
DDP_IGNORE_LIST = "_ddp_params_and_buffers_to_ignore"  # the module attribute DDP reads its ignore list from
# Keys of DDP's logging data TrainingDoctor reads (lightning_solo/diagnostics/timing.py); the compat test runs DDP.
DDP_TIMING_KEYS = ("iteration", "avg_backward_comm_time", "avg_backward_compute_comm_overlap_time")
# Functions used as they are (checked on torch 2.11.0 and 2.14.1): ``compress_hook(dtype, process_group, bucket)``.
set_params_to_ignore = DistributedDataParallel._set_params_and_buffers_to_ignore_for_model
compress_hook: Callable[..., torch.futures.Future] = default_hooks._compress_hook


def unregister_parameter(module: torch.nn.Module, name: str) -> None:
    """Undo ``register_parameter``: ``del module._parameters[name]`` (checked on torch 2.11.0 and 2.14.1)."""
    del module._parameters[name]


def ddp_logging_data(ddp: DistributedDataParallel) -> dict[str, Any]:
    """``DistributedDataParallel._get_ddp_logging_data()`` (checked on torch 2.11.0 and 2.14.1)."""
    return ddp._get_ddp_logging_data()


def set_ddp_runtime_logging_sample_rate(ddp: DistributedDataParallel, rate: int) -> None:
    """``DistributedDataParallel._set_ddp_runtime_logging_sample_rate(rate)``: timings on iterations 1-10, then every
    ``rate``-th (checked on torch 2.11.0 and 2.14.1)."""
    ddp._set_ddp_runtime_logging_sample_rate(rate)


def ddp_graph_static(ddp: DistributedDataParallel) -> bool:
    """``ddp.reducer._ddp_graph_static()`` (checked on torch 2.11.0 and 2.14.1)."""
    return bool(ddp.reducer._ddp_graph_static())


def local_used_map(ddp: DistributedDataParallel) -> torch.Tensor:
    """``ddp.reducer._get_local_used_map()``: the parameters this step used (checked on torch 2.11.0 and 2.14.1)."""
    return ddp.reducer._get_local_used_map()


def mark_ready(ddp: DistributedDataParallel, index: int) -> None:
    """``ddp.reducer._autograd_hook(index)``: parameter ``index`` ready (checked on torch 2.11.0 and 2.14.1)."""
    ddp.reducer._autograd_hook(index)


def remove_autograd_hooks(ddp: DistributedDataParallel) -> None:
    """``DistributedDataParallel._remove_autograd_hooks()`` (checked on torch 2.11.0 and 2.14.1)."""
    ddp._remove_autograd_hooks()


def should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """``powerSGD_hook._should_compress(...)[0]``: PowerSGD compresses n×m (checked on torch 2.11.0 and 2.14.1)."""
    return powerSGD_hook._should_compress(n, m, rank, min_compression_rate)[0]


def scaler_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """``GradScaler._scale``, ``None`` before the first ``scale()`` (checked on torch 2.11.0 and 2.14.1)."""
    return scaler._scale


def scaler_init_scale(scaler: torch.amp.GradScaler) -> float:
    """``GradScaler._init_scale`` (checked on torch 2.11.0 and 2.14.1)."""
    return scaler._init_scale


def set_group_timeout(timeout: Any, group: Any) -> None:
    """``torch.distributed.set_timeout(timeout, group)``, or ``distributed_c10d._set_pg_timeout`` where it is missing
    (checked on torch 2.11.0 and 2.14.1)."""
    set_timeout = getattr(torch.distributed, "set_timeout", None)
    if set_timeout is None:
        set_timeout = torch.distributed.distributed_c10d._set_pg_timeout
    set_timeout(timeout, group)


def default_store() -> Any:
    """``distributed_c10d._get_default_store()``: the default group's store (checked on torch 2.11.0 and 2.14.1)."""
    return torch.distributed.distributed_c10d._get_default_store()


def dynamo_counters() -> Any:
    """``torch._dynamo.utils.counters``: Dynamo's per-process counters (``frames``, ``unimplemented``,
    ``aot_autograd``: one graph per DDPOptimizer split) (checked on torch 2.11.0 and 2.14.1)."""
    from torch._dynamo.utils import counters

    return counters


def optimize_ddp() -> Any:
    """``torch._dynamo.config.optimize_ddp``: splitting at DDP's buckets (checked on torch 2.11.0 and 2.14.1)."""
    import torch._dynamo

    return torch._dynamo.config.optimize_ddp


# The compiled module, ``OptimizedModule``'s child: keys read ``net._orig_mod.weight`` (torch 2.11.0 and 2.14.1).
COMPILED_CHILD = "_orig_mod"


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a ``torch.compile`` ``OptimizedModule`` (checked on torch 2.11.0 and 2.14.1)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def flight_recorder_json(nccl: bool) -> bytes:
    """This process's flight-recorder record, every entry, as torch's JSON: ``c10d._dump_nccl_trace_json`` (NCCL) or
    ``_dump_fr_trace_json`` (gloo) (checked on torch 2.11.0 and 2.14.1; NCCL's only where built with it)."""
    from torch._C import _distributed_c10d as c10d

    dump = c10d._dump_nccl_trace_json if nccl else c10d._dump_fr_trace_json  # type: ignore[attr-defined]
    return dump(includeCollectives=True, onlyActive=False)


def dataloader_next_code() -> Any:
    """The code of ``_BaseDataLoaderIter.__next__``, whose frame holds the iterator as ``self`` (checked on 2.14.1)."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    return _BaseDataLoaderIter.__next__.__code__


def dataloader_start_codes() -> frozenset[Any]:
    """The code that makes a loader's iterator (``DataLoader.__iter__``, ``._get_iterator``,
    ``_MultiProcessingDataLoaderIter.__init__``: workers start) (checked on torch 2.14.1)."""
    from torch.utils.data.dataloader import DataLoader, _MultiProcessingDataLoaderIter

    functions = (DataLoader.__iter__, DataLoader._get_iterator, _MultiProcessingDataLoaderIter.__init__)
    return frozenset(f.__code__ for f in functions)


def batches_yielded(iterator: Any) -> int | None:
    """``_BaseDataLoaderIter._num_yielded``, ``None`` for another object (checked on torch 2.14.1)."""
    value = getattr(iterator, "_num_yielded", None)
    return value if isinstance(value, int) else None
