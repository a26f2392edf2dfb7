"""One run on one GPU, at most 9 minutes, that checks the CUDA paths no CPU test can and prints one table.

Each check (or bundle of small single-process checks, one interpreter for them all, a row each) runs in a process
group of its own (``start_new_session``) under its own time limit; at the limit the whole group is killed (no
process left holding the GPU) and its unfinished rows say TIMEOUT. The table (PASS / FAIL / SKIP / TIMEOUT and
seconds per check) is rewritten after every check, so a run killed part-way still reports. The limits add up to
540 s. In this order (registry: ``benchmarks/gpu_checks/__init__.py``; one module per group: ``perf``,
``multirank``, ``ddp``, ``syncbn``, ``memory``; the harness: ``harness.py``):

* ``defaults_cost`` (benchmark, first): ResNet-50 bf16 channels_last at batch 256 and 16: a plain loop, stock
  ``DDPStrategy()``, bare ``SoloDDP()``, ``SoloDDP(find_unused_parameters=False)`` and ``SoloDDP()`` with the
  runner's default callbacks: ms and host syncs per step (≤ 1.05x stock, 1.10x with the callbacks; ≤ stock's syncs on a
  quiet step).
* ``multirank``: 2 processes on the one GPU (gloo on CUDA tensors: NCCL refuses two ranks on one device), the
  runner's callbacks, a BatchNorm model at per-device batch 16 (SyncBN on) and 128: ``SoloDDP()`` against stock
  ``DDPStrategy()`` (with ``sync_batchnorm=True`` at 16) in the same processes; device syncs and device-to-host
  copies per steady step (torch.profiler) no more than stock's, the barrier monitored, the fast path reached at
  128 with stock's weights.
* the bundle ``single``, one interpreter:

  * ``flight_recorder``: a one-rank NCCL group's flight-recorder record dumped and parsed: the last collective,
    its number, nothing in flight.
  * ``autobatch``: AutoBatchSize's predicted peak against the fit's allocated/reserved peak; a budget no batch
    fits comes back as too big (batch 1).
  * ``nccl1``: ``SoloDDP()`` on one GPU: an nccl group of world size 1, its monitored barrier (gloo side group)
    and a CUDA all-reduce inside the fit.
  * ``scaler``: ``16-mixed``: a step whose loss is made inf is skipped (weights held), the scale halves.
  * ``rng``: ``resume.rng_state()`` / ``set_rng_state()`` bring the CUDA generator back.
  * ``syncbn_cuda``: ``SoloDDP(sync_batchnorm=True)`` converts BatchNorm on the device for the fit, reverts after.
  * ``comm``: fp16/bf16/PowerSGD hooks on a one-rank nccl group; PowerSGD's state saved and resumed exactly.
  * ``resume``: a crash mid-epoch and a resume equal the uninterrupted run, dropout drawn on the device.
  * ``fsdp``: ``SoloFSDP``, BatchNorm inside: bf16 picked on a GPU; a resume from its sharded checkpoint equals
    the straight run; the checkpoint consolidates into a plain model.
  * ``preflight``: ``python -m lightning_solo.preflight`` with ``LOCAL_RANK=1`` on one GPU reports it, no crash.
  * ``syncbn_fn``: SyncBN's autograd function on a one-rank nccl group under ``set_sync_debug_mode("error")``:
    fp32/bf16/fp16 × NCHW/channels_last × affine on/off × 1d/2d/3d, random, cancelling and GradScaler-scaled
    dy, against fp64 with native BN's error beside it (2× native for fp16/bf16, 4× fp32); the portable kernels
    on the CUDA tensors too; ms and kernels per layer.
  * ``fork``: after CUDA is initialised, ``SoloDDP(start_method="fork")`` refuses with a clear error (GPU only).

* ``syncbn``: 2 processes on the GPU, rank 0's batch empty, bf16 autocast: against BN over the joined batch.
* ``rewrap``: 2 ranks re-wrap DDP twice (``find_unused_parameters="auto"``) with ``torch.cuda._sleep`` before
  each optimizer step (a full queue): replicas bit-identical, allocated memory before/after the re-wraps.
* ``notebook``: two fork-launched ``16-mixed`` fits in one clean parent: CUDA stays uninitialised there, the
  second fit runs.
* ``compile``: ``SoloDDP(compile=True)`` (inductor; ``aot_eager`` on CPU): compiled inside DDP's forward, no
  fallback to eager, no recompile over the fit, the weights after 6 steps within 1e-4 of the eager fit's.
* ``precision`` (benchmark, last): ``bench_precision.py``, ResNet-50 channels_last 224² × 256: fp32 (strict),
  bf16-mixed, 16-mixed: images/s and peak memory against the targets (bf16 ≥ 2× NVIDIA's A100 AMP figure of
  ~2,470 images/s; AMP peak memory ≤ 0.7× fp32).

How to read the table: ``benchmarks/RESULTS.md``, "gpu_check's table". The whole run keeps within ``--budget``
seconds (default 540): a check gets its own limit (three times it on CPU) or what is left, and is skipped when
under 15 s is left.

Usage::

    python benchmarks/gpu_check.py                                        # one GPU, ≤ 9 minutes: benchmarks/gpu_check.md
    python benchmarks/gpu_check.py --device cpu --out /tmp/gpu_check.md   # every check with a CPU form

Without CUDA (and no ``--device cpu``) it prints why and exits 0, having checked nothing. On CPU the checks run
at tiny sizes with gloo: the logic, not the figures. Exit status 1 when a check failed, timed out or did not
fit in the budget.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu_checks import CHECKS, HELPERS  # noqa: E402
from benchmarks.gpu_checks import harness as _harness  # noqa: E402
from benchmarks.gpu_checks.harness import render, run_check  # noqa: E402, F401 - the tests' seams
from benchmarks.gpu_checks.perf import precision_table  # noqa: E402, F401


def main(argv: list[str] | None = None) -> int:
    return _harness.main(CHECKS, HELPERS, __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
