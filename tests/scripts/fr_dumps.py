"""Real flight-recorder dumps for the clause's table test: 2 gloo processes (fork), ``TORCH_FR_BUFFER_SIZE`` set,
each rank writing its dump (``lightning_solo._compat.torch.flight_recorder_json``) at three moments:

    python tests/scripts/fr_dumps.py OUT_DIR        # OUT_DIR/rank<r>.<moment>.json

* ``agree``: both ranks ran an all_reduce and a broadcast on the default group;
* ``extra``: then rank 1 issued one more all_reduce on it, which rank 0 never entered;
* ``two_groups``: then rank 0 issued an all_reduce on a second group ("side"), which rank 1 never entered.

The extra collectives stay in flight: each rank leaves with ``os._exit``, not waiting for them.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_solo._compat.torch import flight_recorder_json
from lightning_solo.testing import free_port


def main(rank: int, port: int, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    side = dist.new_group(backend="gloo", group_desc="side")
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    time.sleep(0.2)  # gloo retires a finished collective just after it returns
    (out / f"rank{rank}.agree.json").write_bytes(flight_recorder_json(False))
    dist.barrier(side)  # both dumped before either issues its extra one (a barrier on the side group, recorded)
    works = []
    if rank == 1:
        works.append(dist.all_reduce(t, async_op=True))
    time.sleep(0.2)
    (out / f"rank{rank}.extra.json").write_bytes(flight_recorder_json(False))
    if rank == 0:
        works.append(dist.all_reduce(t, group=side, async_op=True))
    time.sleep(0.2)
    (out / f"rank{rank}.two_groups.json").write_bytes(flight_recorder_json(False))
    os._exit(0)


if __name__ == "__main__":
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")
    mp.start_processes(main, args=(free_port(), Path(sys.argv[1])), nprocs=2, start_method="fork")
