"""The ranks' gathered facts compared (pure: every rank reaches the same verdict). See docs/diagnostics.md."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence

from lightning_solo.diagnostics.checks.facts import RankFacts
from lightning_solo.diagnostics.checks.finding import Finding, merge, ranks_text

_FIXES = {
    "device": "Mixed device models run at the pace of the slowest; use one model per job",
    "driver": "Install the same driver on every node",
    "cuda_visible_devices": "Give every node the same number of visible GPUs",
    "env.OMP_NUM_THREADS": "Export the same OMP_NUM_THREADS to every rank (torchrun sets 1)",
    "env.MASTER_ADDR": "Start every rank with one MASTER_ADDR: ranks meet there",
    "env.MASTER_PORT": "Start every rank with one MASTER_PORT: ranks meet there",
    "env.WORLD_SIZE": "Start every rank with the same WORLD_SIZE",
}
_ENV_FIX = "Export the same value to every rank (a job script that sets it on some nodes only?)"
_VERSION_FIX = "Install the same versions on every node (one container image or environment for the job)"


def disagreements(facts: Sequence[Mapping[str, str | None]], ignore: Collection[str] = ()) -> list[Finding]:
    """An error per fact (``facts[r]``: rank r's) not the same on every rank; the ranks off the most common
    value (on a tie, rank 0's) are the odd ones. A missing fact counts as ``None``."""
    keys = sorted({k for f in facts for k in f} - set(ignore))
    found = []
    for key in keys:
        by_value: dict[str | None, list[int]] = defaultdict(list)
        for rank, rank_facts in enumerate(facts):
            by_value[rank_facts.get(key)].append(rank)
        if len(by_value) < 2:
            continue
        # rarest first; the reference (most ranks, then rank 0's) last
        groups = sorted(by_value.items(), key=lambda item: (len(item[1]), -item[1][0]))
        values = "; ".join(f"{value!r} on {ranks_text(ranks)}" for value, ranks in groups)
        odd = sorted(r for _, ranks in groups[:-1] for r in ranks)
        fix = _FIXES.get(key, _ENV_FIX if key.startswith("env.") else _VERSION_FIX)
        found.append(
            Finding(f"agree.{key}", f"{key} differs across ranks: {values}. {fix}.", error=True, ranks=tuple(odd))
        )
    return found


def shared_devices(ranks: Sequence[RankFacts]) -> list[Finding]:
    """An error for ranks on one host that use the same GPU, or the same local rank on an accelerator."""
    found = []
    local_rank = lambda f: f.local_rank if f.device != "cpu" else None  # noqa: E731
    for what, key in (("GPU", lambda f: f.device_id), ("LOCAL_RANK", local_rank)):
        owners: dict[tuple, list[int]] = defaultdict(list)
        for f in ranks:
            if key(f) is not None:
                owners[(f.host, key(f))].append(f.rank)
        for (host, value), sharing in owners.items():
            if len(sharing) > 1:
                message = (
                    f"{ranks_text(sharing)} on host {host} share {what} {value}: each rank needs its own device. "
                    "Start one process per device (torchrun --nproc-per-node=<GPUs>, srun --ntasks-per-node), "
                    "and let the launcher set LOCAL_RANK."
                )
                found.append(Finding(f"placement.{what.lower()}", message, error=True, ranks=tuple(sharing)))
    return found


def check(ranks: Sequence[RankFacts], ignore: Collection[str] = ()) -> list[Finding]:
    """Everything the gathered facts say: disagreements, shared devices, and each rank's own findings."""
    return [
        *disagreements([f.shared for f in ranks], ignore),
        *shared_devices(ranks),
        *merge((f.rank, f.findings) for f in ranks),
    ]
