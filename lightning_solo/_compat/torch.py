"""Private torch names the pack uses, one accessor each. Checked on torch 2.11.0 and 2.14.1 (tests/test_compat.py
on each)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode

CHECKED_ON = "torch 2.11.0 and 2.14.1"

# Base classes the pack checks against or subclasses (checked on torch 2.11.0 and 2.14.1).
BatchNormBase = _BatchNorm
DispatchMode = TorchDispatchMode

# DDP's own names the pack reads or sets (checked on torch 2.11.0 and 2.14.1); the compat test asserts each exists.
DDP_IGNORED_FLAG = "_ddp_ignored"  # set by DDP on each parameter it ignores
DDP_IGNORE_LIST = "_ddp_params_and_buffers_to_ignore"  # the module attribute DDP reads its ignore list from
# Keys of DDP's logging data TrainingDoctor reads (lightning_solo/diagnostics/timing.py); the compat test runs DDP.
DDP_TIMING_KEYS = ("iteration", "avg_backward_comm_time", "avg_backward_compute_comm_overlap_time")


def unregister_parameter(module: torch.nn.Module, name: str) -> None:
    """Undo ``register_parameter``: ``del module._parameters[name]`` (checked on torch 2.11.0 and 2.14.1)."""
    del module._parameters[name]


def ddp_logging_data(ddp: DistributedDataParallel) -> dict[str, Any]:
    """``DistributedDataParallel._get_ddp_logging_data()`` (checked on torch 2.11.0 and 2.14.1)."""
    return ddp._get_ddp_logging_data()


def set_ddp_runtime_logging_sample_rate(ddp: DistributedDataParallel, rate: int) -> None:
    """``DistributedDataParallel._set_ddp_runtime_logging_sample_rate(rate)``: the reducer records its timings
    on iterations 1-10 and then every ``rate``-th (default 100) (checked on torch 2.11.0 and 2.14.1)."""
    ddp._set_ddp_runtime_logging_sample_rate(rate)


def ddp_graph_static(ddp: DistributedDataParallel) -> bool:
    """``ddp.reducer._ddp_graph_static()`` (checked on torch 2.11.0 and 2.14.1)."""
    return bool(ddp.reducer._ddp_graph_static())


def local_used_map(ddp: DistributedDataParallel) -> torch.Tensor:
    """``ddp.reducer._get_local_used_map()``: which parameters this step used, all-reduced over the ranks
    under ``find_unused_parameters=True`` (checked on torch 2.11.0 and 2.14.1)."""
    return ddp.reducer._get_local_used_map()


def mark_ready(ddp: DistributedDataParallel, index: int) -> None:
    """``ddp.reducer._autograd_hook(index)``: mark parameter ``index`` ready, as its gradient hook would
    (checked on torch 2.11.0 and 2.14.1)."""
    ddp.reducer._autograd_hook(index)


def remove_autograd_hooks(ddp: DistributedDataParallel) -> None:
    """``DistributedDataParallel._remove_autograd_hooks()`` (checked on torch 2.11.0 and 2.14.1)."""
    ddp._remove_autograd_hooks()


def set_params_to_ignore(module: torch.nn.Module, names: list[str]) -> None:
    """``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` (checked on torch 2.11.0 and
    2.14.1)."""
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)


def should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """``powerSGD_hook._should_compress(...)[0]``: whether PowerSGD compresses an n×m matrix at this rank
    (checked on torch 2.11.0 and 2.14.1)."""
    return powerSGD_hook._should_compress(n, m, rank, min_compression_rate)[0]


def compress_hook(dtype: torch.dtype, process_group: Any, bucket: Any) -> torch.futures.Future:
    """``default_hooks._compress_hook``: all-reduce a bucket in ``dtype`` (checked on torch 2.11.0 and 2.14.1)."""
    return default_hooks._compress_hook(dtype, process_group, bucket)


def scaler_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """``GradScaler._scale``: the scale tensor, ``None`` before the first ``scale()`` (checked on torch 2.11.0
    and 2.14.1)."""
    return scaler._scale


def scaler_init_scale(scaler: torch.amp.GradScaler) -> float:
    """``GradScaler._init_scale`` (checked on torch 2.11.0 and 2.14.1)."""
    return scaler._init_scale


def set_group_timeout(timeout: Any, group: Any) -> None:
    """``torch.distributed.set_timeout(timeout, group)``: the group's timeout for its later collectives; on a torch
    without it (2.11.0), ``distributed_c10d._set_pg_timeout`` (checked on torch 2.11.0 and 2.14.1, where the
    private one warns that it is deprecated)."""
    set_timeout = getattr(torch.distributed, "set_timeout", None)
    if set_timeout is None:
        set_timeout = torch.distributed.distributed_c10d._set_pg_timeout
    set_timeout(timeout, group)


def default_store() -> Any:
    """``torch.distributed.distributed_c10d._get_default_store()``: the default process group's store, which the
    watchdog clones for its heartbeats (checked on torch 2.11.0 and 2.14.1)."""
    return torch.distributed.distributed_c10d._get_default_store()


def dynamo_counters() -> Any:
    """``torch._dynamo.utils.counters``: Dynamo's per-process counters (``frames``: ``total``/``ok`` compiled
    frames; ``unimplemented``: why a frame fell back to eager; ``aot_autograd``: ``total`` graphs handed to
    AOTAutograd, one per DDPOptimizer split) (checked on torch 2.11.0 and 2.14.1)."""
    from torch._dynamo.utils import counters

    return counters


def optimize_ddp() -> Any:
    """``torch._dynamo.config.optimize_ddp``: ``True``/``"ddp_optimizer"`` splits a graph compiled inside DDP's
    forward at DDP's bucket boundaries (checked on torch 2.11.0 and 2.14.1)."""
    import torch._dynamo

    return torch._dynamo.config.optimize_ddp


# ``torch.compile(module)`` returns ``torch._dynamo.eval_frame.OptimizedModule``, which holds the module as its child
# ``_orig_mod``: a compiled submodule's state-dict keys read ``net._orig_mod.weight`` (checked on torch 2.11.0 and
# 2.14.1).
COMPILED_CHILD = "_orig_mod"


def is_compiled_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is what ``torch.compile(module)`` returns (``torch._dynamo.eval_frame.OptimizedModule``;
    checked on torch 2.11.0 and 2.14.1)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def flight_recorder_json(nccl: bool) -> bytes:
    """This process's flight-recorder record as torch's JSON: ``torch._C._distributed_c10d._dump_nccl_trace_json``
    (NCCL's process groups) or ``_dump_fr_trace_json`` (gloo's), every entry, completed ones too (checked on torch
    2.11.0 and 2.14.1; the NCCL one only where torch was built with NCCL)."""
    from torch._C import _distributed_c10d as c10d

    dump = c10d._dump_nccl_trace_json if nccl else c10d._dump_fr_trace_json  # type: ignore[attr-defined]
    return dump(includeCollectives=True, onlyActive=False)


def dataloader_next_code() -> Any:
    """The code object of ``torch.utils.data.dataloader._BaseDataLoaderIter.__next__``: a frame running it holds
    the iterator as ``self`` (the watchdog reads the training thread's stack; checked on torch 2.14.1)."""
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    return _BaseDataLoaderIter.__next__.__code__


def dataloader_start_codes() -> frozenset[Any]:
    """The code objects that make a loader's iterator (``DataLoader.__iter__``, ``DataLoader._get_iterator``,
    ``_MultiProcessingDataLoaderIter.__init__``, which starts the workers): a frame running one is an epoch's loader
    starting (checked on torch 2.14.1)."""
    from torch.utils.data.dataloader import DataLoader, _MultiProcessingDataLoaderIter

    functions = (DataLoader.__iter__, DataLoader._get_iterator, _MultiProcessingDataLoaderIter.__init__)
    return frozenset(f.__code__ for f in functions)


def batches_yielded(iterator: Any) -> int | None:
    """``_BaseDataLoaderIter._num_yielded``: the batches a loader's iterator has handed out this epoch (``None``: not
    such an iterator; checked on torch 2.14.1)."""
    value = getattr(iterator, "_num_yielded", None)
    return value if isinstance(value, int) else None
