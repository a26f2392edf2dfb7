"""Cost of the flight recorder on gloo: 2 processes (fork, 1 thread each) do ``--ops`` small all-reduces (4 floats,
after 200 to warm up) with ``TORCH_FR_BUFFER_SIZE=0`` (off; unset, torch 2.14.1 records 2000) and ``--buffer`` (on),
fresh processes each time (torch reads the variable once per process), interleaved round by round with the order
alternating. Prints the median per-collective time of each and their difference: the recording's cost.

    python benchmarks/bench_flight_recorder.py                      # ~30 s on 2 idle cores
    python benchmarks/bench_flight_recorder.py --rounds 10 --ops 5000 --buffer 2000
    python benchmarks/bench_flight_recorder.py --nprocs 1           # one rank: no network, the recording stands out
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_solo._compat.torch import flight_recorder_json


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, buffer: int, ops: int, nprocs: int, out: mp.SimpleQueue) -> None:
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(buffer)  # unset, torch 2.14.1 records 2000
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nprocs)
    t = torch.ones(4)
    for _ in range(200):
        dist.all_reduce(t)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(ops):
        dist.all_reduce(t)
    elapsed = time.perf_counter() - start
    if rank == 0:  # the recording was on (or off) as asked: the entries it holds
        recorded = len(json.loads(flight_recorder_json(False)).get("entries", []))
        assert recorded == min(buffer, ops + 201), recorded
        out.put(elapsed / ops)
    dist.destroy_process_group()


def per_op(buffer: int, ops: int, nprocs: int) -> float:
    queue = mp.get_context("fork").SimpleQueue()
    mp.start_processes(_worker, args=(_free_port(), buffer, ops, nprocs, queue), nprocs=nprocs, start_method="fork")
    return queue.get()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--buffer", type=int, default=2000)
    parser.add_argument("--nprocs", type=int, default=2)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            times[name].append(per_op(0 if name == "off" else args.buffer, args.ops, args.nprocs))
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    diffs = [b - a for a, b in zip(times["off"], times["on"])]
    print(
        f"{args.nprocs} process(es), {args.rounds} rounds, {args.ops} all-reduces of 4 floats, "
        f"TORCH_FR_BUFFER_SIZE={args.buffer}"
    )
    print(f"off: median {off * 1e6:.1f} us per all-reduce  {[round(t * 1e6, 1) for t in times['off']]}")
    print(f"on:  median {on * 1e6:.1f} us per all-reduce  {[round(t * 1e6, 1) for t in times['on']]}")
    print(
        f"recording: median of per-round differences {statistics.median(diffs) * 1e6:+.1f} us per collective "
        f"({(on / off - 1) * 100:+.1f} %)"
    )


if __name__ == "__main__":
    main()
