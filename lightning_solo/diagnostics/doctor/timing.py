"""One rank's time split per optimizer step, in chart bins and running totals. See docs/diagnostics.md."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from lightning_solo._compat import torch as torch_compat
from lightning_solo.ddp.syncbn.wait import SYNCBN_WAIT

# One optimizer step's parts, summed; times in seconds.
FIELDS = ("steps", "data", "fwd_bwd", "optimizer", "comm", "samples", "loss", "loss_n")
STEPS, DATA, FWD_BWD, OPTIMIZER, COMM, SAMPLES, LOSS, LOSS_N = range(len(FIELDS))
_ITERATION, _AVG_COMM, _AVG_OVERLAP = torch_compat.DDP_TIMING_KEYS


class Sums:
    """Sums of :data:`FIELDS` over some steps; the loss stays a tensor on its device until :meth:`values`."""

    def __init__(self) -> None:
        self.v = [0.0] * len(FIELDS)
        self.loss: Any = 0.0
        self.losses: list[torch.Tensor] = []  # the open bin's, summed when it closes (no tensor op per step)
        self.pending: list[tuple[Any, Any, int]] = []  # CUDA intervals not read back yet: (start, end, field)

    def add(self, other: Sums, pending: bool = True) -> None:
        """Add ``other``'s sums, and its CUDA intervals unless ``pending`` is False (read back into both later)."""
        self.v = [a + b for a, b in zip(self.v, other.v)]
        self.loss = self.loss + other.loss
        if pending:
            self.pending += other.pending

    def values(self) -> list[float]:
        """The sums as floats (reads the loss back: call at a report, not per step)."""
        return [*self.v[:LOSS], float(self.loss), self.v[LOSS_N]]


class ExposedComm:
    """Exposed communication per synchronised iteration, from DDP's reducer timings."""

    def __init__(self, sample_rate: int = 1) -> None:
        self.sample_rate = sample_rate
        self._ddp: DistributedDataParallel | None = None
        self._base = (0, 0.0)  # (iterations recorded, their exposed nanoseconds) at the last read
        self._carry = (0, 0.0)  # what replaced wrappers recorded since the last read
        self._mean_s = 0.0
        self.iterations = 0  # DDP iterations read so far, over every wrapper followed

    def watch(self, model: Any) -> None:
        """Follow ``model``: a new DDP wrapper gets the sample rate, the one it replaced is read out."""
        SYNCBN_WAIT.listen(self)
        if model is self._ddp or not isinstance(model, DistributedDataParallel):
            return
        if self._ddp is not None:
            self.read_out(self._ddp)
        self._ddp, self._base = model, (0, 0.0)
        torch_compat.set_ddp_runtime_logging_sample_rate(model, self.sample_rate)

    def read_out(self, ddp: DistributedDataParallel) -> None:
        """Keep what ``ddp`` recorded for the next read and stop following it (SoloDDP's rewrap listener)."""
        if ddp is not self._ddp:
            return
        n, ns = self._recorded(ddp)
        self._carry = (self._carry[0] + n - self._base[0], self._carry[1] + ns - self._base[1])
        self._ddp, self._base = None, (0, 0.0)

    def release(self) -> None:
        """Stop following the DDP wrapper and timing SyncBN (at the end of fit)."""
        self._ddp = None
        SYNCBN_WAIT.unlisten(self)

    def mean_since_last_read(self) -> float:
        """Exposed communication seconds per iteration since the last call (the previous value if none since)."""
        n, ns = self._recorded(self._ddp) if self._ddp is not None else self._base  # between wrappers: (0, 0)
        count, total = n - self._base[0] + self._carry[0], ns - self._base[1] + self._carry[1]
        self._base, self._carry = (n, ns), (0, 0.0)
        self.iterations += count
        if count > 0:
            self._mean_s = max(0.0, total / count / 1e9)  # overlap can outlast communication by a hair
        return self._mean_s

    def _recorded(self, ddp: DistributedDataParallel) -> tuple[int, float]:
        data = torch_compat.ddp_logging_data(ddp)
        n = recorded_iterations(int(data.get(_ITERATION) or 0), self.sample_rate)
        exposed = int(data.get(_AVG_COMM) or 0) - int(data.get(_AVG_OVERLAP) or 0)
        return n, exposed * n  # DDP keeps running means over the recorded iterations

    def layout(self) -> dict[str, Any]:
        """Buckets and overlap as DDP reports them, for the remedies."""
        if self._ddp is None:
            return {}
        data = torch_compat.ddp_logging_data(self._ddp)
        sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
        comm = int(data.get(_AVG_COMM) or 0)
        return {
            "bucket_count": len([s for s in sizes.split(",") if s.strip()]),
            "gradient_mib": int(data.get("total_parameter_size_bytes") or 0) / 2**20,
            "bucket_cap_mb": int(data.get("bucket_cap_bytes") or 0) / 2**20,
            "overlap_fraction": int(data.get(_AVG_OVERLAP) or 0) / comm if comm else None,
        }


def recorded_iterations(iteration: int, rate: int) -> int:
    """How many of DDP's iterations 1..``iteration`` its reducer timed: 1-10, then every ``rate``-th."""
    if iteration <= 10:
        return max(0, iteration)
    return 10 + iteration // rate - 10 // rate


class StepTimer:
    """One rank's time split (CUDA events, else the host clock) in bins of ``bin_steps``, doubled past ``max_bins``."""

    def __init__(
        self, device: torch.device, comm: ExposedComm | None = None, bin_steps: int = 16, max_bins: int = 256
    ) -> None:
        self.cuda = device.type == "cuda"
        self.loss_scale = 1.0  # automatic optimization divides the loss by the accumulation steps: undo it
        self.event = torch.cuda.Event  # the CUDA clock's marks (a test may pass its own)
        self.comm = comm or ExposedComm()
        self.recording = False
        self.bin_steps, self.max_bins = bin_steps, max_bins
        self.bins: list[Sums] = []
        self.bin_ends: list[int] = []  # the optimizer step (counted from recording) each bin ends at
        self.window, self.total = Sums(), Sums()
        self._open = Sums()
        self._steps = 0
        self._start: Any = None
        self._opt: Any = None
        self._last_end: Any = None

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = self.event(enable_timing=True)
        event.record()
        return event

    def _interval(self, start: Any, end: Any, field: int) -> None:
        if not self.recording:
            return
        if self.cuda:
            self._open.pending.append((start, end, field))
        else:
            self._open.v[field] += end - start

    def batch_start(self) -> None:
        self._start, self._opt = self._mark(), None
        if self._last_end is not None:
            self._interval(self._last_end, self._start, DATA)

    def before_optimizer(self) -> None:
        if self._opt is None and self._start is not None:  # the first optimizer of the batch ends fwd+bwd
            self._opt = self._mark()
            self._interval(self._start, self._opt, FWD_BWD)

    def batch_end(self, samples: int, loss: torch.Tensor | None) -> bool:
        """Close the micro-batch; True when it ended an optimizer step."""
        end = self._mark()
        stepped = self._opt is not None
        self._take_syncbn_wait()  # before this batch's own interval, so that a bin's last event is its latest
        if self._start is not None:
            self._interval(*((self._opt, end, OPTIMIZER) if stepped else (self._start, end, FWD_BWD)))
        self._last_end, self._start = end, None
        if self.recording:
            self._open.v[SAMPLES] += samples
            if loss is not None:
                self._open.losses.append(loss)
                self._open.v[LOSS_N] += 1
            if stepped:
                self._open.v[STEPS] += 1
                self._steps += 1
                if self._open.v[STEPS] >= self.bin_steps:
                    self.close_bin()
        return stepped

    def _take_syncbn_wait(self) -> None:
        """SyncBN's waits since the last batch: communication, inside forward+backward."""
        seconds, events = SYNCBN_WAIT.take() if self.comm in SYNCBN_WAIT else (0.0, [])
        if self.recording:
            self._open.v[COMM] += seconds
            self._open.pending += [(start, end, COMM) for start, end in events]

    def skip_gap(self) -> None:
        """The time until the next batch is not data wait (validation ran, a checkpoint was saved)."""
        self._last_end = None

    def start(self) -> None:
        """Start recording (after the warm-up steps): DDP's sums count from here."""
        self.recording = True
        self.comm.mean_since_last_read()

    def close_bin(self) -> None:
        """Close the open bin (every ``bin_steps`` steps, and at each report so that windows hold whole bins)."""
        bin_, self._open = self._open, Sums()
        if bin_.v[STEPS] == 0 and not bin_.pending:
            self._open = bin_  # nothing in it yet
            return
        bin_.v[COMM] += self.comm.mean_since_last_read() * bin_.v[STEPS]  # SyncBN's waits are in already
        if bin_.losses:
            bin_.loss = torch.cat([t.reshape(1) for t in bin_.losses]).double().sum() * self.loss_scale
            bin_.losses = []
        self._resolve(self.bins[-1] if self.bins else None)  # the previous bin's events are long done
        self.bins.append(bin_)
        self.bin_ends.append(self._steps)
        self.window.add(bin_, pending=False)  # its CUDA intervals join them when read back
        self.total.add(bin_, pending=False)
        if len(self.bins) >= self.max_bins:  # halve the resolution: merge neighbours (same on every rank)
            for first, second in zip(self.bins[::2], self.bins[1::2]):
                first.add(second)
            ends = self.bin_ends
            self.bins = self.bins[::2]
            self.bin_ends = [ends[min(i + 1, len(ends) - 1)] for i in range(0, len(ends), 2)]
            self.bin_steps *= 2

    def _resolve(self, bin_: Sums | None) -> None:
        """Read back ``bin_``'s CUDA intervals into it and into the window and total."""
        if bin_ is None or not bin_.pending:
            return
        bin_.pending[-1][1].synchronize()  # the last end event: all before it on the stream are done too
        for start, end, field in bin_.pending:
            seconds = start.elapsed_time(end) / 1e3
            bin_.v[field] += seconds
            self.window.v[field] += seconds
            self.total.v[field] += seconds
        bin_.pending = []

    def take_window(self) -> Sums:
        """The sums since the previous call (a report): closes the open bin and reads back every interval."""
        self.close_bin()
        for bin_ in self.bins:
            self._resolve(bin_)
        window, self.window = self.window, Sums()
        return window
