"""pytest plugin for ``scripts/lightning_suite.py``: select Lightning's DDP tests, optionally swap in SoloDDP.

Loaded with ``-p lightning_suite_plugin`` (the script puts ``scripts/`` on ``PYTHONPATH``) into a pytest run
over Lightning's own ``tests/tests_pytorch``. It does three things:

* ``--solo-swap``: before any test module is imported, every name in Lightning's ``StrategyRegistry`` that
  builds ``DDPStrategy`` (``ddp``, ``ddp_spawn``, ``ddp_fork``, ``ddp_notebook`` and their
  ``*_find_unused_parameters_*`` variants) is re-registered to ``SoloDDP`` with the same ``start_method`` and
  ``find_unused_parameters``, and the public names ``lightning.pytorch.strategies.DDPStrategy`` and
  ``lightning.pytorch.strategies.ddp.DDPStrategy`` are rebound to ``SoloDDP``, so a test's own
  ``DDPStrategy(...)`` builds a ``SoloDDP``. Lightning's internal ``isinstance(..., DDPStrategy)`` checks
  (accelerator connector, ``compile``, DeepSpeed/XLA base class) keep the real class: ``SoloDDP`` is a subclass,
  so they hold for it, and narrowing them to ``SoloDDP`` would break DeepSpeed/XLA, which are not swapped.
  ``SoloDDP`` keeps its own ``strategy_name``.
  Processes the tests spawn (``ddp_spawn`` re-imports the test modules in fresh interpreters) make the same swap
  before importing ``tests_pytorch``: see ``lightning_suite_site/sitecustomize.py``.
* ``--solo-select``: keeps only the DDP-related tests (see :func:`is_ddp_test`) and deselects the rest, except
  in the files given by ``--solo-all``, where every test is kept; ``--solo-trim TEST=REGEX`` keeps only the
  cases of ``TEST`` whose parameter id matches.
* ``--solo-report=FILE``: writes every selected test's outcome, one-line message, duration and failure text as
  JSON, keyed by the stock pass's node id (:func:`stock_nodeid`), for the script to compare the two passes.

Lightning's tests mark flaky tests ``@pytest.mark.flaky(reruns=3)``, from ``pytest-rerunfailures``; the marker is
registered here so that ``--strict-markers`` collects them without that plugin. Each test runs once a pass; the
script retries the failures that decide the comparison.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

_DDP_SOURCE = re.compile(r"ddp|devices\s*=\s*(?:[2-9]|\[\s*\d\s*,)", re.IGNORECASE)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("lightning_suite", "lightning_solo: Lightning's DDP tests stock vs SoloDDP")
    group.addoption("--solo-swap", action="store_true", help="register SoloDDP in place of DDPStrategy")
    group.addoption("--solo-select", action="store_true", help="keep only DDP-related tests")
    group.addoption("--solo-all", default="", help="comma-separated files whose tests are all kept")
    group.addoption("--solo-report", default=None, help="write the outcomes as JSON to this file")
    group.addoption(
        "--solo-trim",
        action="append",
        default=[],
        metavar="TEST=REGEX",
        help="keep only the parametrizations of TEST whose id matches REGEX (long, repetitive tests)",
    )


def swap_in_solo_ddp() -> type:
    """Make Lightning build ``SoloDDP`` wherever it or a test asks for ``DDPStrategy``; returns SoloDDP."""
    import lightning.pytorch.strategies as strategies
    import lightning.pytorch.strategies.ddp as ddp

    from lightning_solo import SoloDDP

    original = ddp.DDPStrategy
    if original is SoloDDP:
        return SoloDDP
    registry = strategies.StrategyRegistry
    for name, entry in list(registry.items()):
        if entry["strategy"] is original:
            registry.register(
                name,
                SoloDDP,
                description=f"SoloDDP in place of DDPStrategy ({entry['description']})",
                override=True,
                **entry["init_params"],
            )
    strategies.DDPStrategy = SoloDDP
    ddp.DDPStrategy = SoloDDP
    # Test helpers imported already (conftest and what it imports) get the same rebinding.
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("tests_pytorch") and getattr(module, "DDPStrategy", None) is original:
            module.DDPStrategy = SoloDDP
    return SoloDDP


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "flaky(reruns=0): pytest-rerunfailures' marker, run once here")
    if config.getoption("--solo-swap"):
        swap_in_solo_ddp()
        # The processes the tests spawn swap too (lightning_suite_site/sitecustomize.py).
        os.environ["LIGHTNING_SUITE_SWAP"] = "1"
        site = str(Path(__file__).resolve().parent / "lightning_suite_site")
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (site, str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")) if p
        )


def _is_ddp_value(value: Any) -> bool:
    """A ``"ddp*"`` name, ``DDPStrategy`` (not a subclass such as DeepSpeed's) or an instance, also nested."""
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.strategies.ddp import DDPStrategy as current

    classes = (DDPStrategy, current)
    if isinstance(value, str):
        entry = dict.get(StrategyRegistry, value)  # the registry's own get() builds the strategy
        return value.lower().startswith("ddp") or (entry is not None and entry["strategy"] in classes)
    if isinstance(value, type):
        return value in classes
    if type(value) in classes:
        return True
    if isinstance(value, dict):
        return any(_is_ddp_value(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_is_ddp_value(v) for v in value)
    return False


def _is_strategy_value(value: Any) -> bool:
    from lightning.pytorch.strategies import Strategy, StrategyRegistry

    if isinstance(value, str):
        return value in StrategyRegistry or value == "auto"
    if isinstance(value, type):
        return issubclass(value, Strategy)
    return isinstance(value, Strategy)


def is_ddp_test(item: pytest.Item) -> bool:
    """Whether a collected Lightning test exercises DDP on this machine's CPUs (or is skipped for lack of GPUs).

    * A parametrized case whose parameters name DDP (a ``"ddp*"`` string, a ``DDPStrategy`` instance or
      subclass, also inside a dict or list, e.g. ``trainer_kwargs``) or whose id says ``ddp``: kept.
    * A parametrized case whose parameters name another strategy (``"auto"``, ``"fsdp"``, a
      ``SingleDeviceStrategy``...) and no DDP one: dropped, even if the function's source mentions DDP for a
      sibling case.
    * Otherwise the test function's source decides: it mentions ``ddp``/``DDPStrategy`` or asks for two or
      more devices (``devices=2``, ``devices=[0, 1]``), which on CPU means a DDP strategy.
    """
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        params = list(callspec.params.values())
        if "ddp" in callspec.id.lower() or any(_is_ddp_value(v) for v in params):
            return True
        if any(_is_strategy_value(v) for v in params):
            return False
    function = getattr(item, "function", None)
    if function is None:
        return False
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return bool(_DDP_SOURCE.search(source))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--solo-select"):
        return
    keep_all = {str(Path(p).resolve()) for p in config.getoption("--solo-all").split(",") if p}
    trims = dict(spec.split("=", 1) for spec in config.getoption("--solo-trim"))
    selected, deselected = [], []
    for item in items:
        whole_file = str(Path(item.path).resolve()) in keep_all
        keep = whole_file or is_ddp_test(item)
        trim = trims.get(getattr(item, "originalname", item.name))
        callspec = getattr(item, "callspec", None)
        if keep and trim is not None and callspec is not None and not re.search(trim, callspec.id):
            keep = False
        (selected if keep else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


_ERROR_LINE = re.compile(r"^\s*[\w.]*(Error|Exception|Exit|Interrupt|Failed|Timeout)\b")
_FILE_LINE = re.compile(r'^\s*File "([^"]+)", line (\d+)')


def _message(report: pytest.TestReport) -> str:
    """One line: the exception, and for a failure in a spawned rank, the rank, its innermost error and where."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is None:
        return str(report.longrepr).strip().splitlines()[-1] if report.longrepr else ""
    lines = crash.message.splitlines()
    if len(lines) <= 1:
        return crash.message
    rank = re.search(r"-- Process (\d+) terminated", crash.message)
    errors = [line.strip() for line in lines[1:] if _ERROR_LINE.match(line)]
    files = [m for m in map(_FILE_LINE.match, lines) if m]
    where = f" at {Path(files[-1][1]).name}:{files[-1][2]}" if files else ""
    if rank and errors:
        return f"{lines[0].strip()} rank {rank[1]}: {errors[-1]}{where}"
    return " ".join(line.strip() for line in lines)


_OUTCOMES: dict[str, dict[str, Any]] = {}  # nodeid -> outcome record, for --solo-report
_STARTED: list[float] = []


def stock_nodeid(nodeid: str) -> str:
    """The node id the stock pass gives the same case: a parameter id made from the class reads ``SoloDDP``."""
    return re.sub(r"(?<=[\[-])SoloDDP(?=[\]-])", "DDPStrategy", nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    record = _OUTCOMES.setdefault(
        stock_nodeid(report.nodeid),
        {"nodeid": report.nodeid, "outcome": "passed", "message": "", "duration": 0.0},
    )
    record["duration"] = round(record["duration"] + report.duration, 2)
    if record["outcome"] in ("failed", "error", "skipped"):
        return  # the first failure or skip decides
    if report.when == "call" and hasattr(report, "wasxfail"):
        record["outcome"], record["message"] = ("xfailed" if report.skipped else "xpassed"), report.wasxfail
    elif report.failed:
        record["outcome"] = "failed" if report.when == "call" else "error"
        record["message"] = ("" if report.when == "call" else f"[{report.when}] ") + _message(report)
        record["longrepr"] = report.longreprtext[-20000:]
    elif report.skipped:
        record["outcome"], record["message"] = "skipped", _message(report)


def pytest_sessionstart(session: pytest.Session) -> None:
    _STARTED.append(time.monotonic())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--solo-report")
    # A standalone test's "ddp" (popen) launcher re-runs this pytest command for the other ranks: rank 0 reports.
    if not path or os.environ.get("LOCAL_RANK", "0") != "0":
        return
    report = {
        "swapped": bool(session.config.getoption("--solo-swap")),
        "exitstatus": int(exitstatus),
        "wall_s": round(time.monotonic() - _STARTED[0], 1),
        "tests": _OUTCOMES,
    }
    Path(path).write_text(json.dumps(report, indent=1))
