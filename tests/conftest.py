import os

import pytest

# One intra-op thread per process: tests start several ranks on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HYDRA_FULL_ERROR", "1")


@pytest.fixture(autouse=True)
def _no_leaked_processes():
    yield
    import multiprocessing

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # A test that failed or timed out may leave forked ranks waiting in a collective: end them here
    # rather than let them hold the cores for the rest of the suite.
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)
