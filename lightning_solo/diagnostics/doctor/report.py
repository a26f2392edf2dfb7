"""The doctor's report from every rank's sums: table, ``doctor.json`` and ``doctor.png``. See docs/diagnostics.md."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from lightning_solo.ddp.watchdog import heartbeat as hb
from lightning_solo.diagnostics.checks.collectives import gather_rows
from lightning_solo.diagnostics.doctor.timing import (
    COMM,
    DATA,
    FIELDS,
    FWD_BWD,
    LOSS,
    LOSS_N,
    OPTIMIZER,
    SAMPLES,
    STEPS,
    Sums,
)
from lightning_solo.diagnostics.doctor.verdict import RankTimes, Setup, diagnose, setting_call

# A rank's own work by SoloDDP's heartbeat; not backward, which holds the all-reduce where ranks wait for a straggler.
OWN_PHASES = (hb.DATA_WAIT, hb.TRAINING_STEP, hb.OPTIMIZER_STEP, hb.VALIDATION, hb.CHECKPOINT_SAVE)
EXTRA = ("peak_memory_mib", "memory_total_mib", "idle_cores", *(f"phase_s:{p}" for p in OWN_PHASES))


def straggler_phase(phase_s: list[dict[str, float]], rank: int, steps: int) -> tuple[str, float] | None:
    """The phase of ``rank``'s own work most over the other ranks' median, in ms per step, or ``None``."""
    others = [p for i, p in enumerate(phase_s) if i != rank]
    if not others or steps <= 0 or not any(phase_s[rank].values()):
        return None
    excess = {
        phase: 1e3 * (phase_s[rank].get(phase, 0.0) - statistics.median(o.get(phase, 0.0) for o in others)) / steps
        for phase in OWN_PHASES
    }
    phase = max(excess, key=excess.__getitem__)
    return (phase, excess[phase]) if excess[phase] > 0 else None


def gather_ranks(
    window: Sums, total: Sums, bins: list[Sums], extra: dict[str, float], device: torch.device
) -> list[dict[str, Any]]:
    """Every rank's window, total, ``extra`` and bins; a collective, called by every rank at the same step."""
    row = [*window.values(), *total.values(), *(float(extra.get(k, 0.0)) for k in EXTRA)]
    row += [value for bin_ in bins for value in bin_.values()]
    n, head = len(FIELDS), 2 * len(FIELDS) + len(EXTRA)
    return [
        {
            "window": values[:n],
            "total": values[n : 2 * n],
            **dict(zip(EXTRA, values[2 * n : head])),
            "bins": [values[i : i + n] for i in range(head, len(values), n)],
        }
        for values in gather_rows(torch.tensor(row, dtype=torch.float64, device=device)).tolist()
    ]


def rank_times(sums: list[float]) -> RankTimes:
    """Mean milliseconds per optimizer step; exposed communication is taken out of forward+backward."""
    ms = 1e3 / max(sums[STEPS], 1.0)
    comm = sums[COMM] * ms
    return RankTimes(sums[DATA] * ms, max(0.0, sums[FWD_BWD] * ms - comm), comm, sums[OPTIMIZER] * ms)


def _seconds(sums: list[float]) -> float:
    return sums[DATA] + sums[FWD_BWD] + sums[OPTIMIZER]  # communication is inside forward+backward


def _rate(sums: list[float]) -> float:
    return sums[SAMPLES] / _seconds(sums) if _seconds(sums) > 0 else 0.0


def throughput(per_rank: list[list[float]], reference: float | None = None) -> dict[str, float | None]:
    """Samples/s per device (mean of the ranks' own) and global (all samples over the slowest rank's time)."""
    own = [_rate(s) for s in per_rank]
    slowest = max(_seconds(s) for s in per_rank)
    global_ = sum(s[SAMPLES] for s in per_rank) / slowest if slowest > 0 else 0.0
    efficiency = global_ / (len(per_rank) * reference) if reference else None
    return {
        "global_samples_per_s": global_,
        "per_device_samples_per_s": sum(own) / len(own),
        "reference_samples_per_s": reference,
        "scaling_efficiency": efficiency,
    }


def summarize(
    gathered: list[dict[str, Any]], which: str, setup: Setup, reference: float | None = None
) -> dict[str, Any]:
    """The report over ``which`` ("window": since the last report, "total": since the warm-up)."""
    per_rank = [g[which] for g in gathered]
    steps = int(per_rank[0][STEPS])
    if steps == 0:
        return {"steps": 0, "world_size": len(gathered), "verdict": None}
    times = [rank_times(s) for s in per_rank]
    setup = dataclasses.replace(
        setup,
        idle_cores=int(min(g["idle_cores"] for g in gathered)),
        memory_fraction=max(
            (g["peak_memory_mib"] / g["memory_total_mib"] for g in gathered if g["memory_total_mib"]), default=None
        ),
    )
    verdict = diagnose(times, setup)
    rows = [
        {
            "rank": rank,
            "step_ms": t.step_ms,
            **dataclasses.asdict(t),
            "samples_per_s": _rate(sums),
            "peak_memory_mib": g["peak_memory_mib"],
            "loss": sums[LOSS] / sums[LOSS_N] if sums[LOSS_N] else None,
        }
        for rank, (sums, t, g) in enumerate(zip(per_rank, times, gathered))
    ]
    step_ms = sum(t.step_ms for t in times) / len(times)
    straggler: dict[str, Any] = {
        "rank": verdict.straggler,
        "behind_ms": verdict.behind_ms,
        "behind_fraction": verdict.behind_ms / step_ms if step_ms else 0.0,
        "phase": None,
        "phase_excess_ms": None,
    }
    if verdict.straggler is not None:
        phases = [{p: g.get(f"phase_s:{p}", 0.0) for p in OWN_PHASES} for g in gathered]
        if (found := straggler_phase(phases, verdict.straggler, steps)) is not None:
            straggler["phase"], straggler["phase_excess_ms"] = found
    return {
        "steps": steps,
        "world_size": len(gathered),
        "device": setup.device,
        "ranks": rows,
        "throughput": throughput(per_rank, reference),
        "straggler": straggler,
        "verdict": {
            "bound": verdict.bound,
            "shares": verdict.shares,
            "remedies": [dataclasses.asdict(r) for r in verdict.remedies],
            "text": str(verdict),
        },
    }


def series(gathered: list[dict[str, Any]], bin_ends: list[int]) -> dict[str, Any]:
    """Per bin and rank, for the chart: ms per step of each part, samples/s, mean loss."""
    n = len(bin_ends)
    ranks: list[dict[str, Any]] = []
    for g in gathered:
        bins = g["bins"][:n]
        times = [dataclasses.asdict(rank_times(b)) for b in bins]
        ranks.append(
            {
                **{part: [t[part] for t in times] for part in ("data_ms", "compute_ms", "comm_ms", "optimizer_ms")},
                "loss": [b[LOSS] / b[LOSS_N] if b[LOSS_N] else None for b in bins],
                "samples": [b[SAMPLES] for b in bins],
                "seconds": [_seconds(b) for b in bins],
                "steps": [max(b[STEPS], 1.0) for b in bins],
            }
        )
    global_ = [throughput([g["bins"][i] for g in gathered])["global_samples_per_s"] for i in range(n)]
    return {"step": list(bin_ends), "global_samples_per_s": global_, "ranks": ranks}


def format_table(report: dict[str, Any], title: str = "TrainingDoctor") -> str:
    """The report as a few lines for the log."""
    if not report.get("steps"):
        return f"{title}: no optimizer step measured after the warm-up"
    head = f"{'rank':>4}  {'step ms':>8}  {'data':>7}  {'compute':>7}  {'comm':>7}  {'optim':>7}  {'samples/s':>9}  {'peak MiB':>8}  {'loss':>8}"
    lines = ["", f"{title}: {report['steps']} steps, {report['world_size']} rank(s), {report['device']}", head]
    for r in report["ranks"]:
        loss = f"{r['loss']:8.4g}" if r["loss"] is not None else f"{'-':>8}"
        lines.append(
            f"{r['rank']:>4}  {r['step_ms']:8.2f}  {r['data_ms']:7.2f}  {r['compute_ms']:7.2f}  {r['comm_ms']:7.2f}"
            f"  {r['optimizer_ms']:7.2f}  {r['samples_per_s']:9.1f}  {r['peak_memory_mib']:8.0f}  {loss}"
        )
    tp = report["throughput"]
    line = f"throughput: {tp['global_samples_per_s']:.1f} samples/s global, {tp['per_device_samples_per_s']:.1f} per device"
    if tp["scaling_efficiency"] is not None:
        line += f"; scaling efficiency {tp['scaling_efficiency']:.2f} vs {tp['reference_samples_per_s']:.1f} samples/s on one process"
    lines.append(line)
    s = report["straggler"]
    if s["rank"] is not None:
        line = f"slowest rank: {s['rank']}, {s['behind_ms']:.2f} ms ({s['behind_fraction']:.0%} of the step) behind the others"
        if s.get("phase") is not None:
            line += f", most of it in {s['phase']} (+{s['phase_excess_ms']:.2f} ms per step, by its heartbeat)"
        lines.append(line)
    lines.append(f"verdict: {report['verdict']['text']}")
    for i, r in enumerate(report["verdict"]["remedies"], 1):
        lines.append(f"  {i}. {setting_call(r['setting'], r['value'])}: {r['action']} (~{r['gain']:.0%} of the step)")
    return "\n".join(lines)


def write_json(content: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(content, indent=1, default=str))
    tmp.replace(path)  # a reader never sees half a report


PARTS = (("data_ms", "data wait"), ("compute_ms", "forward+backward"), ("comm_ms", "exposed comm"),
         ("optimizer_ms", "optimizer"))  # fmt: skip


def plot_doctor(series: dict[str, Any], path: str | Path, title: str = "TrainingDoctor") -> Path | None:
    """Write the chart to ``path``; ``None`` when matplotlib is missing or there is nothing to plot."""
    try:
        from matplotlib.figure import Figure  # not pyplot: leaves the user's backend (a notebook's) alone
    except ImportError:
        return None
    steps, ranks = series["step"], series["ranks"]
    if not steps or not ranks:
        return None
    fig = Figure(figsize=(8, 9))
    split, speed, loss = fig.subplots(3, 1, sharex=True)
    # Each bin is drawn over its steps; the split is the mean rank's (ranks wait for each other).
    edges = [steps[0] - ranks[0]["steps"][0], *steps]

    def held(values: list[Any]) -> list[Any]:
        return [*values, values[-1]]

    stacked = [held([sum(r[key][i] for r in ranks) / len(ranks) for i in range(len(steps))]) for key, _ in PARTS]
    split.stackplot(edges, stacked, labels=[label for _, label in PARTS], step="post")
    split.set_ylabel("ms per step (mean rank)")
    split.legend(loc="upper right", fontsize="small")
    speed.plot(edges, held(series["global_samples_per_s"]), drawstyle="steps-post")
    speed.set_ylabel("samples/s (all ranks)")
    speed.set_ylim(bottom=0)
    for rank, r in enumerate(ranks):
        points = [(s, v) for s, v in zip(edges, held(r["loss"])) if v is not None]
        if points:
            loss.plot(*zip(*points), drawstyle="steps-post", label=f"rank {rank}")
    loss.set_ylabel("loss")
    loss.set_xlabel("optimizer step")
    if len(ranks) <= 16:
        loss.legend(loc="upper right", fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return path
