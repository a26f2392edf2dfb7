"""torch's flight recorder, on with the watchdog: each rank's last collectives, read into a stalled run's verdict.
See docs/multi-node.md ("The flight recorder's evidence"); the NCCL path has not run on a GPU here."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_solo.core.decision import Decision

# Collectives remembered per rank (torch's docs and torch 2.14.1's gloo default); cost: benchmarks/RESULTS.md.
TRACE_BUFFER_SIZE = 2000
_FR, _NCCL, _DUMP = "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"

# A rank's summary: process group name -> its last collective there, and whether it is in flight.
PgLast = Mapping[str, Any]  # {"desc", "seq", "op", "state", "pending"}
Summary = Mapping[str, PgLast]


def decide_flight_recorder(backend: str | None, environ: Mapping[str, str]) -> tuple[Decision | None, dict[str, str]]:
    """What to add to the environment (nothing the user set) and the decision; ``None`` without a backend."""
    if backend is None:
        return None, {}
    nccl = "nccl" in backend
    if user := [k for k in (_FR, _NCCL) if k in environ]:
        return Decision("flight_recorder", ", ".join(f"{k}={environ[k]}" for k in user), "set by the user"), {}
    env = {_FR: str(TRACE_BUFFER_SIZE)}  # the older name, read too, warns that it is deprecated
    if nccl and _DUMP not in environ:
        env[_DUMP] = "1"
    reason = (
        "each rank keeps its last collectives (whatever the torch version's default): at a hang the watchdog writes "
        "them to hang/rank<r>.fr.json and says in its line which rank issued one the others never entered; set "
        f"{_FR}=0 to turn it off"
    )
    return Decision("flight_recorder", ", ".join(f"{k}={v}" for k, v in env.items()), reason), env


def summarize(dump: str | bytes) -> dict[str, dict[str, Any]]:
    """A rank's flight-recorder dump (torch's JSON), per process group: its last collective and whether in flight."""
    # A group's collectives complete in order: its last one tells whether the rank waits there.
    lasts: dict[str, dict[str, Any]] = {}
    for entry in json.loads(dump).get("entries", []):
        pg = str(entry["process_group"][0])
        if pg not in lasts or int(entry.get("record_id", 0)) > int(lasts[pg].get("record_id", 0)):
            lasts[pg] = entry
    summary = {}
    for pg, e in lasts.items():
        pending = not e.get("retired") and e.get("state") != "completed"
        summary[pg] = {
            "desc": e["process_group"][1], "seq": e["p2p_seq_id"] if e.get("is_p2p") else e["collective_seq_id"],
            "op": e["profiling_name"], "state": e.get("state", ""), "pending": pending,
        }  # fmt: skip
    return summary


def _label(pg: str, last: PgLast | None) -> str:
    desc = last.get("desc") if last else None
    return desc if desc and desc != "undefined" else f"process group {pg}"


def _op(last: PgLast) -> str:
    # gloo's entries stay "scheduled"; NCCL's say whether the kernel started: worth a word there only.
    state = last.get("state")
    return f"{last['op']} #{last['seq']}" + (f" ({state})" if state and state != "scheduled" else "")


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _pg_part(pg: str, lasts: dict[int, PgLast | None]) -> tuple[str | None, tuple[int, ...]]:
    """The words for one process group, and the ranks it shows waiting; ``None`` when nothing is in flight."""
    label = _label(pg, next((v for v in lasts.values() if v), None))
    waits = {r: last for r, last in lasts.items() if last is not None and last["pending"]}
    if not waits:
        return None, ()
    waiting = list(waits)
    idle = [r for r in lasts if r not in waits]
    ops = {r: _op(last) for r, last in waits.items()}
    if idle:
        issued = (
            f"{_ranks(waiting)} issued {ops[waiting[0]]}"
            if len(set(ops.values())) == 1
            else ", ".join(f"rank {r} issued {ops[r]}" for r in waiting)
        )
        theirs = "; ".join(
            f"rank {r}'s last there: {_op(last)}" if (last := lasts[r]) else f"rank {r} has none recorded there"
            for r in idle
        )
        return f"{issued} on {label}, which {_ranks(idle)} never entered ({theirs})", tuple(waiting)
    if len(waits) == 1:  # the only rank with a record
        return f"rank {waiting[0]} waits in {ops[waiting[0]]} on {label}", tuple(waiting)
    if len({last["op"] for last in waits.values()}) == 1:
        seqs = {last["seq"] for last in waits.values()}
        at = f"#{seqs.pop()}" if len(seqs) == 1 else ", ".join(f"rank {r} #{v['seq']}" for r, v in waits.items())
        return f"every rank waits in {waits[waiting[0]]['op']} on {label} ({at})", tuple(waiting)
    each = ", ".join(f"rank {r} {ops[r]}" for r in waiting)
    return f"the ranks wait in different collectives on {label}: {each}", tuple(waiting)


def clause(summaries: Mapping[int, Summary | None], lead: Sequence[int] = ()) -> str | None:
    """The flight recorder's words for the verdict's line from every rank's summary (``None``: no record from it);
    ``None`` when no rank recorded anything. ``lead``: the ranks the verdict names, whose groups come first."""
    have = {r: s for r, s in sorted(summaries.items()) if s is not None}
    missing = sorted(r for r, s in summaries.items() if s is None)
    pgs = sorted({pg for s in have.values() for pg in s}, key=lambda pg: (len(pg), pg))
    if not pgs:
        return None
    parts: list[tuple[bool, str]] = []
    quiet = []
    for pg in pgs:
        lasts = {r: s.get(pg) for r, s in have.items()}
        words, waiting = _pg_part(pg, lasts)
        if words is None:
            quiet.append((pg, lasts))
        else:
            parts.append((not set(waiting) & set(lead), words))
    text = [words for _, words in sorted(parts, key=lambda p: p[0])]
    if not text:  # nothing in flight anywhere: where each rank's record ends
        for pg, lasts in quiet:
            label = _label(pg, next((v for v in lasts.values() if v), None))
            done = {r: last for r, last in lasts.items() if last is not None}
            if len({(v["seq"], v["op"]) for v in done.values()}) == 1 and len(done) == len(lasts):
                last = next(iter(done.values()))
                who = "every rank" if len(done) > 1 else f"rank {next(iter(done))}"
                text.append(f"{who} at {_op(last)} on {label}")
            else:
                each = ", ".join(f"rank {r} #{v['seq']} {v['op']}" for r, v in done.items())
                text.append(f"last on {label}: {each}")
        text[0] = "nothing in flight; " + text[0]
    if missing:
        text.append(f"no record from {_ranks(missing)}")
    return "flight recorder: " + "; ".join(text)


def _blocks(mine: PgLast, theirs: PgLast | None) -> bool:
    """Whether a rank in flight in ``mine`` waits on ``theirs``: an earlier one, none, or another op at that number."""
    if theirs is None or theirs["seq"] < mine["seq"]:
        return True
    return theirs["seq"] == mine["seq"] and theirs["op"] != mine["op"]


def deadlock(summaries: Mapping[int, Summary | None]) -> tuple[int, ...] | None:
    """The ranks in a collective mismatch (a cycle, each in flight in one the next never entered), or ``None``."""
    have = {r: s for r, s in summaries.items() if s is not None}
    edges: dict[int, set[int]] = {r: set() for r in have}
    for a, mine in have.items():
        for pg, last in mine.items():
            if last["pending"]:
                edges[a] |= {b for b, theirs in have.items() if b != a and _blocks(last, theirs.get(pg))}
    for start in sorted(have):  # a cycle through ``start``: the graph has a node per rank
        path, seen = [start], {start}
        stack = [iter(sorted(edges[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                seen.discard(path.pop())
                continue
            if nxt == start:
                return tuple(sorted(path))
            if nxt not in seen and nxt > start:
                path.append(nxt)
                seen.add(nxt)
                stack.append(iter(sorted(edges[nxt])))
    return None
