"""NCCL's flight recorder, on by default for NCCL runs: the last collectives of every rank, dumped on a timeout.

Example::

    decision, env = decide_flight_recorder("nccl", os.environ)
    os.environ.update(env)            # before the process group is created

torch records nothing unless ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is set before the NCCL process group is made; with
``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` each rank writes its record (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, default
``/tmp/nccl_trace_rank_<rank>``) when a collective times out. A user's own setting of either is kept.
Unverified here: no GPU has run it in this project's tests (the decision and the environment are tested).
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning_solo.core.decision import Decision

TRACE_BUFFER_SIZE = 2000  # collectives remembered per rank (torch's docs use 2000)
_BUFFER, _DUMP = "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"


def decide_flight_recorder(
    backend: str | None, environ: Mapping[str, str]
) -> tuple[Decision | None, dict[str, str]]:
    """What to add to the environment (nothing the user set) and the decision; ``None`` without NCCL."""
    if backend is None or "nccl" not in backend:
        return None, {}
    if _BUFFER in environ:
        return Decision("nccl_flight_recorder", f"{_BUFFER}={environ[_BUFFER]}", "set by the user"), {}
    env = {_BUFFER: str(TRACE_BUFFER_SIZE)}
    if _DUMP not in environ:
        env[_DUMP] = "1"
    return (
        Decision(
            "nccl_flight_recorder",
            ", ".join(f"{k}={v}" for k, v in env.items()),
            "each rank keeps its last collectives and dumps them on a collective timeout; set "
            f"{_BUFFER}=0 to turn it off",
        ),
        env,
    )
