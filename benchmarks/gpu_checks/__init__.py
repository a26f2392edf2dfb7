"""The checks of ``benchmarks/gpu_check.py`` in the order they run, each a row of the table; a
:class:`~benchmarks.gpu_checks.harness.Bundle` runs its small single-process checks in one interpreter. A new check:
a function ``(device) -> (ok, detail)`` in the module of its group, and one line here. The limits (seconds on a
GPU, twice on CPU) add up to 540."""

from benchmarks.gpu_checks import ddp, memory, multirank, perf, syncbn
from benchmarks.gpu_checks.harness import Bundle, Check

CHECKS = (
    Check("defaults_cost", perf.check_defaults_cost, 115),
    Check("multirank", multirank.check_multirank, 70),
    Bundle(
        "single",
        (
            Check("flight_recorder", ddp.check_flight_recorder),  # first: the recorder reads its size once
            Check("autobatch", memory.check_autobatch),  # early: the device's memory still clean
            Check("nccl1", ddp.check_nccl1),
            Check("scaler", ddp.check_scaler),
            Check("rng", ddp.check_rng),
            Check("syncbn_cuda", syncbn.check_syncbn_cuda),
            Check("comm", ddp.check_comm),
            Check("resume", ddp.check_resume),
            Check("fsdp", memory.check_fsdp),
            Check("preflight", ddp.check_preflight),
            Check("syncbn_fn", syncbn.check_syncbn_fn),
            Check("fork", ddp.check_fork, cpu=False),  # last: it leaves CUDA initialised
        ),
        120,
    ),
    Check("syncbn", syncbn.check_syncbn, 35),
    Check("rewrap", ddp.check_rewrap, 40),
    Check("notebook", ddp.check_notebook, 45, fresh=True),  # its parent process must be a clean interpreter
    Check("compile", ddp.check_compile, 55),
    Check("precision", perf.check_precision, 60),
)
#: Processes a check starts (``--check NAME --arg ...``): not rows of the table.
HELPERS = {"rewrap-rank": ddp.rewrap_rank, "multirank-rank": multirank.multirank_rank}
