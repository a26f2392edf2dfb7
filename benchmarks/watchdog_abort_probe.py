"""What unblocks a rank waiting in a gloo all-reduce, from another thread of that rank: why the watchdog ends the
process (``os._exit``) instead of aborting the process group or interrupting the main thread.

Two gloo ranks; rank 1 sleeps 8 s before it would join; rank 0 waits in ``all_reduce`` while its second thread, at
2 s, calls either ``ProcessGroup.abort()`` on the default group or ``_thread.interrupt_main()``. Printed: what the
all-reduce did and when. (torch 2.14.1: both return only at 8 s, when rank 1's process ends.)

    python benchmarks/watchdog_abort_probe.py abort
    python benchmarks/watchdog_abort_probe.py interrupt
"""

import _thread
import sys
import threading
import time

import torch
import torch.distributed as dist

from lightning_solo.testing import run_ranks


def work(rank: int, world_size: int, how: str) -> str:
    if rank == 1:
        time.sleep(8)
        return "slept"
    t0 = time.time()

    def later() -> None:
        time.sleep(2)
        if how == "abort":
            dist.distributed_c10d._get_default_group().abort()
        else:
            _thread.interrupt_main()

    threading.Thread(target=later, daemon=True).start()
    try:
        dist.all_reduce(torch.ones(4))
        return f"returned after {time.time() - t0:.1f} s"
    except BaseException as err:  # noqa: BLE001 - what it raised is the finding
        return f"{type(err).__name__} after {time.time() - t0:.1f} s: {str(err)[:100]}"


if __name__ == "__main__":
    print(sys.argv[1], run_ranks(work, 2, sys.argv[1], timeout=30))
