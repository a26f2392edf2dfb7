"""DDP steps outside the reducer (as accumulation's ``no_sync`` and post-local-SGD's local steps run them) on
2 gloo processes forked from a fresh one (glibc's malloc as the imports left it, as in a spawned process), counting each step's page faults: 12 steps with glibc's malloc as a process starts,
then 12 after :func:`lightning_solo.core.cpu_malloc.decide`.

    python tests/scripts/malloc_steps.py OUT_DIR

Each rank writes OUT_DIR/rank<k>.json: for every step (``default``, ``reuse``) its minor page faults and by how
many bytes the memory glibc's malloc holds from the kernel grew (``*_growth``, negative when it gave memory back),
the gradients' size in 4 KiB pages and the ``cpu_malloc`` decision.
"""

import ctypes
import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_solo.core import cpu_malloc
from lightning_solo.testing import free_port


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]  # fmt: skip


def malloc_held() -> int:
    """Bytes glibc's malloc holds from the kernel: its heaps (``arena``) and its mapped blocks (``hblkhd``)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.arena + info.hblkhd


def rank_main(rank: int, port: int, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    width = 2048  # 16 MiB weight matrices
    net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    ddp = nn.parallel.DistributedDataParallel(net, gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(8, width), torch.randint(10, (8,))

    def steps(phase: str) -> None:
        faults, growth = record.setdefault(phase, []), record.setdefault(f"{phase}_growth", [])
        for _ in range(12):
            start, held = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, malloc_held()
            optimizer.zero_grad()
            with ddp.no_sync():
                nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
            growth.append(malloc_held() - held)

    record: dict = {}
    steps("default")
    record["decision"] = cpu_malloc.decide(reuse=True).as_dict()
    steps("reuse")
    record["grad_pages"] = sum(p.numel() * p.element_size() for p in net.parameters()) // 4096
    dist.destroy_process_group()
    (out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(rank_main, args=(free_port(), out), nprocs=2, start_method="fork")
