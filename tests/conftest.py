import os

import pytest

# One intra-op thread per process: tests start several ranks on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HYDRA_FULL_ERROR", "1")

# A test that starts real processes (marked ``multiproc``) gets this limit unless it sets its own with
# ``@pytest.mark.timeout(...)``: a rank stuck in a collective then fails the test instead of the suite.
MULTIPROC_TIMEOUT_S = 60


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("multiproc") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(MULTIPROC_TIMEOUT_S))


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
