"""The checks of ``benchmarks/gpu_check.py``, one :class:`~benchmarks.gpu_checks.harness.Check` per row, in the
order they run (correctness first, benchmarks last). A new check: a function ``(device) -> (ok, detail)`` in the
module of its group, and one line here."""

from benchmarks.gpu_checks import ddp, memory, perf, syncbn
from benchmarks.gpu_checks.harness import Check

CHECKS = (
    Check("nccl1", ddp.check_nccl1, 45),
    Check("scaler", ddp.check_scaler, 45),
    Check("rng", ddp.check_rng, 30),
    Check("syncbn_fn", syncbn.check_syncbn_fn, 75),
    Check("syncbn_cuda", syncbn.check_syncbn_cuda, 45),
    Check("syncbn", syncbn.check_syncbn, 60),
    Check("fork", ddp.check_fork, 60, cpu=False),
    Check("notebook", ddp.check_notebook, 90, fresh=True),  # its parent process must be a clean interpreter
    Check("rewrap", ddp.check_rewrap, 90),
    Check("comm", ddp.check_comm, 45),
    Check("resume", ddp.check_resume, 60),
    Check("autobatch", memory.check_autobatch, 60),
    Check("fsdp", memory.check_fsdp, 75),
    Check("preflight", ddp.check_preflight, 45),
    Check("compile", ddp.check_compile, 120),
    Check("defaults_cost", perf.check_defaults_cost, 150, benchmark=True),
    Check("precision", perf.check_precision, 150, benchmark=True),
)
#: Processes a check starts (``--check NAME --arg ...``): not rows of the table.
HELPERS = {"fork-child": ddp.fork_child, "rewrap-rank": ddp.rewrap_rank}
