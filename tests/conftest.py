import compileall
import getpass
import os
import signal
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# One intra-op thread per process: tests start several ranks on a 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HYDRA_FULL_ERROR", "1")

# A test that starts real processes (marked ``multiproc``) gets this limit unless it sets its own with
# ``@pytest.mark.timeout(...)``: a rank stuck in a collective then fails the test instead of the suite.
MULTIPROC_TIMEOUT_S = 60


# A test's expected cost in seconds, from its marks: the files go to the xdist workers heaviest first
# (pyproject's `--dist loadfile --no-loadscope-reorder`), so that light files, not a long one, end the run.
COST_S = {"slow": 30.0, "cli": 15.0, "multiproc": 6.0}


def _cost(item) -> float:
    return max((c for mark, c in COST_S.items() if item.get_closest_marker(mark) is not None), default=0.3)


def pytest_configure(config):
    """The checkout's own modules compiled once, in the controller: with ``PYTHONDONTWRITEBYTECODE`` set (as
    in some CI images) no process writes a ``__pycache__``, and each of the ~100 interpreters the suite starts
    (ranks, commands, scripts) would compile the package and the test helpers from source again, ~0.3 s of CPU
    each. Python reads the cached bytecode either way; this writes it, as a plain ``import`` would."""
    if not hasattr(config, "workerinput"):  # not again in each xdist worker
        for package in ("lightning_solo", "tests", "benchmarks"):
            compileall.compile_dir(REPO / package, quiet=1)


def pytest_collection_finish(session):
    """The test worker's imports (torch, Lightning, the test modules) go to the collector's permanent generation,
    as the runner's do: the ranks the tests fork from here then run their full collections without walking, and
    copying the pages of, ~0.4 M objects that are not garbage.

    After collection, not at this file's import: Lightning imported before pytest's log handlers are on the root
    logger keeps its messages to its own handler (``propagate = False``), out of ``caplog``'s reach."""
    from lightning_solo.app.run import freeze_imported_objects

    freeze_imported_objects()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("multiproc") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(MULTIPROC_TIMEOUT_S))
    files: dict = {}
    for item in items:
        files[item.path] = files.get(item.path, 0.0) + _cost(item)
    items.sort(key=lambda item: -files[item.path])  # stable: each file's tests keep their order


# What makes Lightning believe torchrun or SLURM started this process: a test must leave them as it found them.
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)  # a fit's handlers must not outlive it
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")


@pytest.fixture(autouse=True)
def _no_leaked_processes():
    before = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}
    handlers = {signum: signal.getsignal(signum) for signum in SIGNALS}
    yield
    changed = {
        signum.name: signal.getsignal(signum) for signum in SIGNALS if signal.getsignal(signum) != handlers[signum]
    }
    for signum, handler in handlers.items():  # put back first, so that one leak fails one test only
        if signal.getsignal(signum) != handler:
            signal.signal(signum, handler)
    leaked = {name: os.environ.get(name) for name in LAUNCH_VARIABLES if os.environ.get(name) != before[name]}
    for name, value in before.items():  # put back first, so that one leak fails one test only
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    assert not leaked, f"the test left launcher variables set: {leaked}"
    assert not changed, f"the test left signal handlers installed: {changed}"
    import multiprocessing

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # A test that failed or timed out may leave forked ranks waiting in a collective: end them here
    # rather than let them hold the cores for the rest of the suite.
    for child in multiprocessing.active_children():
        child.kill()
        child.join(timeout=5)


@pytest.fixture(scope="session", autouse=True)
def _session_tmpdir(tmp_path_factory):
    """The temporary files of every process the suite starts (multiprocessing's pymp-* directories, torchrun's
    error files, the directories stock Lightning's spawn launcher leaves) go to a directory of this session,
    which pytest prunes with its other base temporary directories, not into /tmp for good."""
    saved = os.environ.get("TMPDIR")
    # Inductor's compile cache stays where torch keeps it by default (/tmp/torchinductor_<user>): it is a cache.
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    )
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # read TMPDIR again
    yield
    if saved is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved
    tempfile.tempdir = None
