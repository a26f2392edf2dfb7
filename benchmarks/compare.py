"""SoloDDP beside a hand-written torch DDP loop, stock Lightning ``ddp`` and the no-communication ceiling.

Every measurement starts ``--world-size`` fresh processes the way torchrun does (``compare_worker.py``), so a
rank's peak RSS is its contender's alone; contenders run interleaved (round r runs each once, the order rotated
by one every round) and the tables show medians with min–max over rounds. Ratios are medians of the per-round
ratios (the paired measurements), so load that shifts between rounds cancels. Beside the
wall-clock samples/s, each rank's CPU time per batch (``time.process_time``, all its threads) counts the work a
contender does and not the time it waits, for a peer or for a core another job holds: on a shared machine it is
the steadier figure. Same model, data, per-device batch
and thread count for every contender; throughput is counted over the batches after ``--warmup`` (SoloDDP's
``find_unused_parameters="auto"`` decides at batch 4 and re-wraps; the window starts after it).

Sections (``--sections``, comma-separated):

* ``main``: the four contenders on ``--workload`` (default: ResNet-18, CIFAR stem, 3×32×32, batch 32 per rank).
* ``variants``: SoloDDP's comm hooks (none, fp16, bf16, powersgd), ``find_unused_parameters`` (auto, True,
  False), ``gradient_as_bucket_view`` on/off with its peak-RSS effect; stock ``ddp`` for reference.
* ``scaling``: raw DDP and SoloDDP at 1, 2, 4 processes (``--scaling``), efficiency = samples/s at N over
  N × samples/s at 1. More processes than cores oversubscribe the machine, and the table says so.
* ``comm``: the communication-bound workload (an MLP of ``--comm-layers`` × ``--comm-width``², small batch)
  and the levers: comm hooks, gradient accumulation (fewer all-reduces), post-local-SGD, bucket size; the
  held-out loss after the same number of samples beside the speed.
* ``allreduce``: the all-reduce alone, fp32 vs bf16 (and the bf16 hook's cast + all-reduce + cast back).
* ``costs``: where SoloDDP's own per-step time goes: each piece timed where it is called, and ablations that
  switch one piece off (resumable loader, per-step RNG capture, the unused-parameter policy, monitored barrier),
  or put Lightning's per-batch SIGTERM broadcast back in place of SoloDDP's asynchronous agreement.

Usage::

    python -m benchmarks.compare --out benchmarks/compare.md               # everything (~45 min on 2 cores)
    python -m benchmarks.compare --sections main --rounds 8                # the four contenders only
    python -m benchmarks.compare --tiny --sections main,comm,allreduce     # a smoke run (~40 s)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.compare_worker import RESULT

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("main", "variants", "scaling", "comm", "allreduce", "costs")
MALLOC_CEILING = "ceiling, with SoloDDP's malloc setting"


# ------------------------------------------------------------------ measuring


def launch(spec: dict, world: int, timeout: float) -> dict:
    """One measurement: ``world`` fresh rank processes; samples/s over the slowest rank's window."""
    from lightning_solo.testing import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        OMP_NUM_THREADS=str(spec["threads"]),
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.compare_worker", json.dumps(spec)],
            cwd=ROOT,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "NODE_RANK": "0"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    ranks = []
    for p, log in zip(procs, logs):
        line = next((x for x in log.splitlines() if x.startswith(RESULT)), None)
        if p.returncode or line is None:
            raise RuntimeError(f"a rank of {spec} failed (exit {p.returncode}):\n{log[-3000:]}")
        ranks.append(json.loads(line[len(RESULT) :]))
    return {
        "samples_per_s": world * ranks[0]["samples"] / max(r["seconds"] for r in ranks),
        "cpu_ms": statistics.mean(r["cpu_ms_per_batch"] for r in ranks),
        "faults": statistics.mean(r["page_faults_per_batch"] for r in ranks),
        "peak_rss_mb": [round(r["peak_rss_mb"]) for r in ranks],
        "grad_mb": ranks[0]["grad_mb"],
        "loss": ranks[0]["loss"],
        "pieces": ranks[0].get("pieces"),
    }


def interleave(
    contenders: dict[str, tuple[dict, int]], rounds: int, timeout: float, pause: float = 0.0
) -> dict[str, list[dict]]:
    """Each round runs every contender once, in an order rotated by one per round; results per round.
    ``pause``: seconds of idle before each run, so that one run's teardown does not slow the next."""
    names = list(contenders)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            spec, world = contenders[name]
            time.sleep(pause)
            results[name].append(launch(spec, world, timeout))
            got = results[name][-1]
            print(
                f"  round {r + 1}/{rounds}  {name:<34} {got['samples_per_s']:9.1f} samples/s  "
                f"CPU {got['cpu_ms']:8.1f} ms/batch  {got['faults']:7.0f} faults/batch  "
                f"peak RSS {got['peak_rss_mb']} MB" + (f"  loss {got['loss']:.4f}" if got["loss"] else ""),
                file=sys.stderr,
                flush=True,
            )
    return results


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def sps(runs: list[dict]) -> list[float]:
    return [run["samples_per_s"] for run in runs]


def ratios(results: dict[str, list[dict]], a: str, b: str) -> list[float]:
    return [x / y for x, y in zip(sps(results[a]), sps(results[b]))]


def faults(runs: list[dict]) -> list[float]:
    return [run["faults"] for run in runs]


def cpu(runs: list[dict]) -> list[float]:
    return [run["cpu_ms"] for run in runs]


def cpu_ratios(results: dict[str, list[dict]], a: str, b: str) -> list[float]:
    """a/b as a speed: b's CPU time per batch over a's (> 1: a does less work per batch)."""
    return [y / x for x, y in zip(cpu(results[a]), cpu(results[b]))]


def versus(results: dict[str, list[dict]], name: str, default: str) -> str:
    """One table row's middle cells: samples/s, its per-round ratio to ``default``, CPU ms per batch, its ratio."""
    return (
        f"{spread(sps(results[name]))} | {spread(ratios(results, name, default), '{:.3f}')} | "
        f"{spread(cpu(results[name]))} | {spread(cpu_ratios(results, name, default), '{:.3f}')}"
    )


def rss(runs: list[dict]) -> str:
    every = [mb for run in runs for mb in run["peak_rss_mb"]]
    return f"{statistics.median(every):.0f} ({min(every)}–{max(every)})"


def base_spec(args: argparse.Namespace, **overrides: Any) -> dict:
    spec = dict(
        workload=args.workload,
        batch=args.batch,
        batches=args.batches,
        warmup=args.warmup,
        threads=args.threads,
        lr=args.lr,
        width=args.comm_width,
        layers=args.comm_layers,
    )
    return {**spec, **overrides}


def workload_line(args: argparse.Namespace, world: int, spec: dict) -> str:
    what = {
        "resnet18": "ResNet-18 (CIFAR stem, 11.2 M params) on random 3×32×32 images",
        "mlp": f"MLP {spec['layers']}×{spec['width']}² + head; 10 classes, each a random {spec['width']}-d direction × 0.1 plus unit noise",
        "digits": "small_cnn (66 k params) on the handwritten digits 1×8×8",
    }[spec["workload"]]
    return (
        f"{what}; {world} gloo processes × {spec['threads']} thread(s); batch {spec['batch']} per rank; "
        f"{spec['batches'] - spec['warmup']} timed batches after {spec['warmup']} warm-up; {args.rounds} rounds."
    )


# ------------------------------------------------------------------ sections


def section_main(args: argparse.Namespace) -> str:
    spec = base_spec(args)
    w = args.world_size
    contenders = {
        "no-communication ceiling": ({**spec, "kind": "ceiling"}, w),
        "hand-written torch DDP": ({**spec, "kind": "raw"}, w),
        'stock Lightning "ddp"': ({**spec, "kind": "stock"}, w),
        "SoloDDP()": ({**spec, "kind": "solo"}, w),
        MALLOC_CEILING: ({**spec, "kind": "ceiling", "cpu_malloc_reuse": True}, w),
    }
    res = interleave(contenders, args.rounds, args.timeout, args.pause)
    ceiling, raw, stock, solo, like_ceiling = contenders
    lines = [
        "### The four contenders",
        "",
        workload_line(args, w, spec)
        + " The fifth row is the ceiling with SoloDDP's allocator setting (`lightning_solo.core.cpu_malloc`).",
        "",
        "| contender | samples/s median (min–max) | CPU ms per batch (mean of ranks) | page faults per batch | "
        "per-rank peak RSS MB |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {spread(sps(res[name]))} | {spread(cpu(res[name]))} | {spread(faults(res[name]), '{:.0f}')} "
        f"| {rss(res[name])} |"
        for name in contenders
    ]
    pairs = [
        ("SoloDDP / raw", solo, raw),
        ("SoloDDP / stock", solo, stock),
        ("SoloDDP / ceiling", solo, ceiling),
        ("SoloDDP / ceiling with the same malloc setting", solo, like_ceiling),
        ("raw / ceiling", raw, ceiling),
        ("stock / raw", stock, raw),
    ]
    lines += [
        "",
        "| ratio (per round, median (min–max)) | by samples/s (wall) | by CPU time per batch |",
        "|---|---|---|",
    ]
    lines += [
        f"| {label} | {spread(ratios(res, a, b), '{:.3f}')} | {spread(cpu_ratios(res, a, b), '{:.3f}')} |"
        for label, a, b in pairs
    ]
    lines += [
        "",
        f"Gradients: {res[solo][0]['grad_mb']:.1f} MB per rank (fp32). Peak RSS SoloDDP − stock: "
        f"{_rss_delta(res[solo], res[stock]):+.0f} MB.",
    ]
    return "\n".join(lines)


def _rss_delta(a: list[dict], b: list[dict]) -> float:
    med = lambda runs: statistics.median(mb for run in runs for mb in run["peak_rss_mb"])  # noqa: E731
    return med(a) - med(b)


def section_variants(args: argparse.Namespace) -> str:
    spec = {**base_spec(args), "kind": "solo"}
    w = args.world_size
    start = max(2, args.warmup)  # PowerSGD compresses from this step on (default 1000: never, in a short run)
    contenders = {
        "SoloDDP() (comm_hook=None, auto, views on)": (spec, w),
        "comm_hook=fp16": ({**spec, "solo": {"comm_hook": "fp16"}}, w),
        "comm_hook=bf16": ({**spec, "solo": {"comm_hook": "bf16"}}, w),
        f"comm_hook=powersgd (rank 1, from step {start})": (
            {**spec, "solo": {"comm_hook": "powersgd", "powersgd_start_iter": start}},
            w,
        ),
        "find_unused_parameters=True": ({**spec, "solo": {"find_unused_parameters": True}}, w),
        "find_unused_parameters=False": ({**spec, "solo": {"find_unused_parameters": False}}, w),
        "gradient_as_bucket_view=False": ({**spec, "solo": {"gradient_as_bucket_view": False}}, w),
        'stock Lightning "ddp" (views off)': ({**spec, "kind": "stock"}, w),
    }
    res = interleave(contenders, args.rounds, args.timeout, args.pause)
    default = next(iter(contenders))
    lines = [
        "### SoloDDP variants",
        "",
        workload_line(args, w, spec),
        "",
        "| variant | samples/s | vs SoloDDP() (per round) | CPU ms per batch | vs SoloDDP() by CPU | "
        "per-rank peak RSS MB | Δ RSS vs SoloDDP() MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in contenders:
        lines.append(
            f"| {name} | {versus(res, name, default)} | {rss(res[name])} | {_rss_delta(res[name], res[default]):+.0f} |"
        )
    lines += ["", f"Gradients: {res[default][0]['grad_mb']:.1f} MB per rank (fp32)."]
    return "\n".join(lines)


def section_scaling(args: argparse.Namespace) -> str:
    spec = base_spec(args)
    sizes = [int(s) for s in args.scaling.split(",")]
    contenders = {}
    for n in sizes:
        contenders[f"raw DDP × {n}"] = ({**spec, "kind": "raw"}, n)
        contenders[f"SoloDDP × {n}"] = ({**spec, "kind": "solo"}, n)
    res = interleave(contenders, args.rounds, args.timeout, args.pause)
    cores = os.cpu_count() or 1
    lines = [
        "### Scaling: 1, 2, 4 processes",
        "",
        workload_line(args, args.world_size, spec).split("; ", 1)[0]
        + f"; batch {spec['batch']} per rank (the global batch grows with N); {cores} cores here"
        + (
            f": {max(sizes)} processes × {spec['threads']} thread(s) oversubscribe them."
            if max(sizes) * spec["threads"] > cores
            else "."
        ),
        "",
        "| processes | raw DDP samples/s | raw efficiency | SoloDDP samples/s | SoloDDP efficiency | SoloDDP / raw |",
        "|---|---|---|---|---|---|",
    ]
    one_raw = statistics.median(sps(res[f"raw DDP × {sizes[0]}"])) / sizes[0]
    one_solo = statistics.median(sps(res[f"SoloDDP × {sizes[0]}"])) / sizes[0]
    for n in sizes:
        raw, solo = (
            statistics.median(sps(res[f"raw DDP × {n}"])),
            statistics.median(sps(res[f"SoloDDP × {n}"])),
        )
        over = " (oversubscribed)" if n * spec["threads"] > cores else ""
        lines.append(
            f"| {n}{over} | {spread(sps(res[f'raw DDP × {n}']))} | {raw / (n * one_raw):.2f} | "
            f"{spread(sps(res[f'SoloDDP × {n}']))} | {solo / (n * one_solo):.2f} | "
            f"{spread(ratios(res, f'SoloDDP × {n}', f'raw DDP × {n}'), '{:.3f}')} |"
        )
    return "\n".join(lines)


def section_comm(args: argparse.Namespace) -> str:
    spec = base_spec(
        args,
        workload="mlp",
        batch=args.comm_batch,
        batches=args.comm_batches,
        warmup=args.comm_warmup,
        lr=args.comm_lr,
    )
    w, solo = args.world_size, {**spec, "kind": "solo"}
    start = max(2, spec["warmup"])
    contenders = {
        "no-communication ceiling": ({**spec, "kind": "ceiling"}, w),
        MALLOC_CEILING: ({**spec, "kind": "ceiling", "cpu_malloc_reuse": True}, w),
        "hand-written torch DDP": ({**spec, "kind": "raw"}, w),
        "SoloDDP() exact": (solo, w),
        "comm_hook=fp16": ({**solo, "solo": {"comm_hook": "fp16"}}, w),
        "comm_hook=bf16": ({**solo, "solo": {"comm_hook": "bf16"}}, w),
        "comm_hook=powersgd (rank 1)": (
            {**solo, "solo": {"comm_hook": "powersgd", "powersgd_start_iter": start}},
            w,
        ),
        "accumulate 4 batches": ({**solo, "accumulate": 4}, w),
        "accumulate 4, lr × 4": ({**solo, "accumulate": 4, "lr": 4 * spec["lr"]}, w),
        **{
            f"post_local_sgd, period {period}": (
                {
                    **solo,
                    "solo": {
                        "comm_hook": "post_local_sgd",
                        "local_sgd_warmup": start,
                        "local_sgd_period": period,
                    },
                },
                w,
            )
            for period in (4, 8, 16)
        },
        "bucket_cap_mb=1": ({**solo, "solo": {"bucket_cap_mb": 1}}, w),
        "bucket_cap_mb=100": ({**solo, "solo": {"bucket_cap_mb": 100}}, w),
    }
    res = interleave(contenders, args.rounds, args.timeout, args.pause)
    exact = "SoloDDP() exact"
    exact_loss = statistics.median(run["loss"] for run in res[exact])
    lines = [
        "### Communication-bound workload and its levers",
        "",
        workload_line(args, w, spec) + f" SGD lr {spec['lr']}, momentum 0.9; post-local-SGD and PowerSGD start "
        f"at step {start}. Loss: cross-entropy on 512 held-out samples after the run (the same samples seen by "
        "every lever; post-local-SGD's replicas averaged at the end).",
        "",
        "| lever | samples/s | vs exact DDP (per round) | CPU ms per batch | page faults per batch | "
        "held-out loss | Δ loss vs exact |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in contenders:
        loss = statistics.median(run["loss"] for run in res[name])
        lines.append(
            f"| {name} | {spread(sps(res[name]))} | {spread(ratios(res, name, exact), '{:.2f}')} | "
            f"{spread(cpu(res[name]))} | {statistics.median(faults(res[name])):.0f} | {loss:.4f} | "
            f"{100 * (loss - exact_loss) / exact_loss:+.1f} % |"
        )
    lines += ["", f"Gradients: {res[exact][0]['grad_mb']:.1f} MB per rank (fp32)."]
    return "\n".join(lines)


def _allreduce_rank(rank: int, world: int, numel: int, iters: int, rounds: int, threads: int) -> dict:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    grad = torch.randn(numel)
    half = grad.to(torch.bfloat16)

    def fp32() -> None:
        dist.all_reduce(grad.clone())

    def bf16_collective() -> None:
        dist.all_reduce(half.clone())

    def bf16_hook() -> None:  # what the bf16 hook does to a bucket: cast, all-reduce, divide, cast back
        compressed = grad.to(torch.bfloat16).div_(world)
        dist.all_reduce(compressed)
        grad.copy_(compressed)

    kinds = {
        "fp32 all-reduce": fp32,
        "bf16 all-reduce (collective alone)": bf16_collective,
        "bf16 hook": bf16_hook,
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(rounds):
        for name, fn in kinds.items():
            fn()  # warm
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            dist.barrier()
            times[name].append((time.perf_counter() - start) / iters)
    return times


def section_allreduce(args: argparse.Namespace) -> str:
    from lightning_solo.testing import run_ranks

    times = run_ranks(
        _allreduce_rank,
        args.world_size,
        args.allreduce_numel,
        args.allreduce_iters,
        args.rounds,
        args.threads,
        timeout=args.timeout,
    )[0]
    fp32 = statistics.median(times["fp32 all-reduce"])
    lines = [
        "### The all-reduce alone: fp32 vs bf16",
        "",
        f"{args.allreduce_numel / 1e6:.1f} M fp32 elements, {args.world_size} gloo processes × {args.threads} "
        f"thread(s), {args.allreduce_iters} calls per kind per round, {args.rounds} rounds, interleaved.",
        "",
        "| what | ms per call | time vs fp32 | time cut |",
        "|---|---|---|---|",
    ]
    for name, values in times.items():
        med = statistics.median(values)
        lines.append(
            f"| {name} | {spread([v * 1e3 for v in values])} | {med / fp32:.2f}× | {100 * (1 - med / fp32):.0f} % |"
        )
    return "\n".join(lines)


def _barrier_rank(rank: int, world: int, iters: int) -> dict:
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_solo.ddp import comm

    kinds = {
        "dist.barrier": lambda: dist.barrier(),
        "monitored barrier (SoloDDP)": lambda: comm.monitored_barrier("bench", timedelta(seconds=60)),
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(iters):
        for name, fn in kinds.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def costs_spec(args: argparse.Namespace) -> dict:
    """SoloDDP() on the costs workload: short steps, where a per-step cost shows."""
    return {
        **base_spec(args, workload=args.costs_workload, batch=args.costs_batch, batches=args.costs_batches),
        "kind": "solo",
    }


def section_costs(args: argparse.Namespace) -> str:
    spec = costs_spec(args)
    w = args.world_size
    contenders = {
        "SoloDDP() (pieces timed)": ({**spec, "profile": True}, w),
        "SoloDDP()": (spec, w),
        "no resumable loader": ({**spec, "ablate": ["no_resumable_loader"]}, w),
        "no per-sample RNG seeding": ({**spec, "ablate": ["no_sample_seeding"]}, w),
        "no per-step RNG capture": ({**spec, "ablate": ["no_rng_capture"]}, w),
        "find_unused_parameters=False (no policy)": ({**spec, "solo": {"find_unused_parameters": False}}, w),
        "plain barrier": ({**spec, "ablate": ["plain_barrier"]}, w),
        "Lightning's per-batch SIGTERM broadcast": ({**spec, "ablate": ["lightning_sigterm_check"]}, w),
        "no SIGTERM check at all": ({**spec, "ablate": ["no_sigterm_check"]}, w),
        'stock Lightning "ddp"': ({**spec, "kind": "stock"}, w),
        "hand-written torch DDP": ({**spec, "kind": "raw"}, w),
    }
    res = interleave(contenders, args.rounds, args.timeout, args.pause)
    default = "SoloDDP()"
    batches = spec["batches"]
    step_s = 1 / statistics.median(sps(res[default])) * spec["batch"] * w
    lines = [
        "### Where SoloDDP's per-step time goes",
        "",
        workload_line(args, w, spec),
        "",
        "| ablation | samples/s | vs SoloDDP() (per round) | CPU ms per batch | vs SoloDDP() by CPU |",
        "|---|---|---|---|---|",
    ]
    for name in contenders:
        lines.append(f"| {name} | {versus(res, name, default)} |")
    pieces: dict[str, list[float]] = {}
    for run in res["SoloDDP() (pieces timed)"]:
        for name, (seconds, _calls) in (run["pieces"] or {}).items():
            pieces.setdefault(name, []).append(seconds / batches * 1e6)
    lines += [
        "",
        f"Time inside each piece, rank 0, per training batch (a step here takes {step_s * 1e3:.1f} ms):",
        "",
        "| piece | µs per batch | share of a step |",
        "|---|---|---|",
    ]
    for name, values in sorted(pieces.items(), key=lambda kv: -statistics.median(kv[1])):
        lines.append(f"| {name} | {spread(values)} | {statistics.median(values) / (step_s * 1e6):.2%} |")
    from lightning_solo.testing import run_ranks

    barriers = run_ranks(_barrier_rank, w, 20 * args.rounds, timeout=args.timeout)[0]
    lines += [
        "",
        "Barriers (not in the step loop: Lightning calls them at setup, teardown and checkpoints), "
        f"{20 * args.rounds} calls each, alternating: "
        + "; ".join(f"{name} {spread([t * 1e3 for t in ts], '{:.2f}')} ms" for name, ts in barriers.items())
        + ".",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------ driver


def machine_line() -> str:
    import lightning
    import torch

    model = platform.processor() or "?"
    with contextlib.suppress(OSError, StopIteration):
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{datetime.date.today().isoformat()}; nproc {os.cpu_count()}; {model}; load average {load}; "
        f"torch {torch.__version__}, lightning {lightning.__version__}, Python {platform.python_version()}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {SECTIONS}")
    p.add_argument("--rounds", type=int, default=None, help="default 5 (1 with --tiny)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    p.add_argument("--workload", default="resnet18", choices=("resnet18", "mlp", "digits"))
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--batches", type=int, default=26, help="batches per rank per measurement, warm-up included")
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--scaling", default="1,2,4", help="process counts for the scaling section")
    p.add_argument("--comm-width", type=int, default=2048)
    p.add_argument("--comm-layers", type=int, default=3)
    p.add_argument("--comm-batch", type=int, default=8)
    p.add_argument("--comm-batches", type=int, default=160)
    p.add_argument("--comm-warmup", type=int, default=16)
    p.add_argument("--comm-lr", type=float, default=0.01)
    p.add_argument("--allreduce-numel", type=int, default=11_173_962, help="default: ResNet-18's parameters")
    p.add_argument("--allreduce-iters", type=int, default=10)
    p.add_argument("--costs-workload", default="digits", choices=("resnet18", "mlp", "digits"))
    p.add_argument("--costs-batch", type=int, default=32)
    p.add_argument("--costs-batches", type=int, default=200)
    p.add_argument("--timeout", type=float, default=900, help="seconds per measurement")
    p.add_argument("--pause", type=float, default=0.0, help="idle seconds before each measurement")
    p.add_argument("--tiny", action="store_true", help="smallest sizes: checks the harness, measures nothing")
    p.add_argument("--out", type=Path, help="also write the markdown here")
    args = p.parse_args(argv)
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS))
    if unknown:
        p.error(f"unknown section(s) {unknown}; accepted: {SECTIONS}")
    if args.tiny:
        args.rounds = args.rounds or 1
        args.workload, args.batch, args.batches, args.warmup = "mlp", 4, 8, 2
        args.comm_width, args.comm_layers, args.comm_batch, args.comm_batches, args.comm_warmup = (
            64,
            2,
            4,
            8,
            2,
        )
        args.allreduce_numel, args.allreduce_iters, args.scaling = 10_000, 2, "1,2"
        args.costs_workload, args.costs_batch, args.costs_batches = "mlp", 4, 8
    args.rounds = args.rounds or 5
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    command = "python -m benchmarks.compare " + " ".join(argv if argv is not None else sys.argv[1:])
    parts = [f"`{command.strip()}` — {machine_line()}"]
    for name in args.sections.split(","):
        print(f"[compare] section {name}", file=sys.stderr, flush=True)
        parts.append(globals()[f"section_{name}"](args))
    parts.append(f"Wall time {time.monotonic() - started:.0f} s; load average at the end {os.getloadavg()[0]:.1f}.")
    text = "\n\n".join(parts) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
