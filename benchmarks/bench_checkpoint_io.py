"""What crash safety costs: save and load time of SoloCheckpointIO against Lightning's TorchCheckpointIO.

One process, a checkpoint-shaped dict of ``--mb`` MiB of fp32 tensors (weights + a same-size optimizer
state), written into the same directory. Each round runs every variant once, in an order that rotates
each round; figures are medians over rounds and ratios are against Lightning's writer in the same rounds.

* ``lightning``: ``TorchCheckpointIO`` (buffers the whole file in RAM, stages it through ``$TMPDIR``,
  renames; no fsync)
* ``solo``: same-directory temp file streamed by ``torch.save`` with sha256 on the fly, fsync of file and
  directory, structural read-back (size + manifest), ``os.replace`` (the default)
* ``solo, full verify``: plus a full re-read and re-hash before the rename (``verify_after_write=True``)
* ``solo, no fsync``: the default minus the fsyncs, to show what durability costs

Loads: ``torch.load`` against ``SoloCheckpointIO.load_checkpoint`` (sha256 verification, then load).

    python benchmarks/bench_checkpoint_io.py                 # 64 MiB, 5 rounds
    python benchmarks/bench_checkpoint_io.py --mb 512 --rounds 7 --dir /path/on/the/real/disk
"""

import argparse
import os
import statistics
import tempfile
import time
import tracemalloc

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lightning_solo.checkpoint.io import SoloCheckpointIO


def make_checkpoint(mb: int) -> dict:
    n = mb * (1 << 20) // 8  # half weights, half optimizer state, fp32
    side = int(n**0.5)
    weights = {f"layer{i}.weight": torch.randn(side // 4, side) for i in range(4)}
    momentum = {i: {"momentum_buffer": torch.randn(side // 4, side)} for i in range(4)}
    return {
        "global_step": 1,
        "epoch": 0,
        "state_dict": weights,
        "optimizer_states": [{"state": momentum, "param_groups": [{"lr": 0.1, "params": [0, 1, 2, 3]}]}],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()

    checkpoint = make_checkpoint(args.mb)
    savers = {
        "lightning": TorchCheckpointIO(),
        "solo": SoloCheckpointIO(),
        "solo, full verify": SoloCheckpointIO(verify_after_write=True),
        "solo, no fsync": SoloCheckpointIO(fsync=False),
    }
    times: dict[str, list[float]] = {name: [] for name in [*savers, "load: torch.load", "load: solo (verify+load)"]}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        names = list(savers)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                path = os.path.join(directory, f"{name.replace(' ', '').replace(',', '_')}.ckpt")
                start = time.perf_counter()
                savers[name].save_checkpoint(checkpoint, path)
                times[name].append(time.perf_counter() - start)
            solo_file = os.path.join(directory, "solo.ckpt")
            loads = [
                ("load: torch.load", lambda p=solo_file: torch.load(p, weights_only=True)),
                ("load: solo (verify+load)", lambda p=solo_file: SoloCheckpointIO().load_checkpoint(p)),
            ]
            for name, fn in loads if r % 2 else loads[::-1]:
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
        size = os.path.getsize(os.path.join(directory, "solo.ckpt")) / (1 << 20)
        peak = {}
        for name in ("lightning", "solo"):  # Python-heap peak of one save: Lightning's in-RAM copy shows here
            tracemalloc.start()
            savers[name].save_checkpoint(checkpoint, os.path.join(directory, "peak.ckpt"))
            peak[name] = tracemalloc.get_traced_memory()[1] / (1 << 20)
            tracemalloc.stop()

    print(f"checkpoint {size:.1f} MiB, {args.rounds} rounds, medians")
    print(f"{'variant':28s} {'s':>8s} {'MiB/s':>8s} {'vs lightning':>13s}")
    base = statistics.median(times["lightning"])
    load_base = statistics.median(times["load: torch.load"])
    for name, values in times.items():
        median = statistics.median(values)
        ref = load_base if name.startswith("load") else base
        print(f"{name:28s} {median:8.3f} {size / median:8.0f} {median / ref:12.2f}x")
    print("extra Python heap during one save: " + ", ".join(f"{k} {v:.1f} MiB" for k, v in peak.items()))


if __name__ == "__main__":
    main()
