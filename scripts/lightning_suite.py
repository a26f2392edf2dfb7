"""Lightning's own DDP tests as a second oracle: run them stock, then with SoloDDP in place of DDPStrategy.

Usage::

    python scripts/lightning_suite.py LIGHTNING_SRC [--areas AREA ...] [-k EXPR] [--out docs/lightning-suite.md]

``LIGHTNING_SRC`` is a checkout of Lightning's source tree (the directory holding ``tests/tests_pytorch``, and
ideally its ``pyproject.toml``, whose pytest settings Lightning's tests are written for: ``--strict-markers``,
``error::FutureWarning``, ``xfail_strict``). Use the release matching the installed ``lightning``; the script
warns when ``src/version.info`` of the checkout says otherwise. One way to get it without git history::

    git --git-dir=<mirror> archive 2.6.5 tests src/version.info pyproject.toml | tar -x -C /tmp/lsrc

Nothing of Lightning's tests is copied into this repository: they are read from the checkout at run time.

The same selection runs twice, as two pytest processes in ``LIGHTNING_SRC/tests`` (so that
``tests_pytorch.helpers`` imports, as in Lightning's CI): stock, then with ``--solo-swap``, where the plugin
``scripts/lightning_suite_plugin.py`` (loaded with ``-p``) re-registers ``ddp``, ``ddp_spawn``, ``ddp_fork``,
``ddp_notebook`` and their ``*_find_unused_parameters_*`` names to ``SoloDDP`` with the same arguments and rebinds
``lightning.pytorch.strategies[.ddp].DDPStrategy`` to ``SoloDDP`` before any test module is imported; the
processes the tests spawn make the same swap (``scripts/lightning_suite_site/sitecustomize.py``), since a spawned
rank re-imports the test module, whose ``class X(DDPStrategy)`` must be built on the same class as in the parent.
Lightning's internal ``isinstance(..., DDPStrategy)`` checks keep the real class (``SoloDDP`` passes them).

Then:

* every failure that decides the comparison (a stock failure; a swapped failure of a stock pass) is tried
  ``--reruns`` (2) more times, each batch in one pytest process: Lightning's gloo/spawn tests abort now and then
  (it marks them ``@pytest.mark.flaky(reruns=3)``); a failure that does not come back is reported as flaky;
* Lightning's CPU tests kept for standalone execution (skipped above) run one per pytest process with
  ``PL_RUN_STANDALONE_TESTS=1``, as its ``run_standalone_tasks.sh`` does (``--no-standalone`` skips this);
* a markdown report is printed (and written to ``--out``): a per-area summary, the lost tests (pass stock, not
  swapped) with the causes in :data:`LOST_CAUSES`, the accepted differences (:data:`EXPLAINED`: each with the
  failure message it must show and why), and one row per test that ran.

Exit status: 1 when a lost test is not accepted, else 0. The JSON reports and logs stay in ``--results`` (a new
temporary folder by default); ``--report-only`` rewrites the report from them, and ``--reuse-stock`` takes the
stock pass from them and runs only the swapped one (after a fix).

Selection. The areas, and the files each reads (``strategies`` test files are taken whole; in the other files
only the DDP tests, as decided by ``lightning_suite_plugin.is_ddp_test``: a parametrized case that names DDP
(``"ddp*"``, ``DDPStrategy``), or, for a test not parametrized over strategies, a function whose source says
``ddp``/``DDPStrategy`` or asks for two or more devices, which on CPU means DDP):

* callbacks: ``callbacks/`` (early stopping, pruning, spike detection, SWA, EMA, progress bar on ddp_spawn...)
* checkpointing: ``checkpointing/`` (top-k and ``monitor=None`` under DDP, ``torch.save`` of a DDP model)
* loops: ``loops/`` (prediction loop's batch-sampler ``set_epoch`` under DDP)
* logging: ``trainer/logging_/``, ``core/test_results.py``, ``core/test_metric_result_integration.py``
  (``sync_dist``, all-rank logging, result reduction)
* manual_optimization: ``trainer/optimization/test_manual_optimization.py`` (its DDP tests need GPUs: skipped)
* dataloaders: ``trainer/connectors/test_data_connector.py``, ``trainer/test_dataloaders.py``,
  ``trainer/flags/test_overfit_batches.py`` (sampler replacement, ``test_eval_shuffle_with_distributed_sampler_
  replacement``, ``test_distributed_sampler_with_overfit_batches``)
* all_gather: ``utilities/test_all_gather_grad.py`` (``test_all_gather_ddp_spawn``)
* strategies: ``strategies/test_ddp.py``, ``test_ddp_integration.py``, ``test_ddp_integration_comm_hook.py``
  (whole), ``strategies/test_common.py``, ``strategies/test_registry.py``

:data:`TRIM` cuts one long parametrization (``--full`` runs it all). Tests that need GPUs are collected and
skipped by Lightning's own ``RunIf`` in both passes alike; the report counts them by reason.

Test dependencies beyond this project's: ``jsonargparse`` (imported by ``checkpointing/test_model_checkpoint.py``;
``pip install 'jsonargparse>=4.39,<4.46'``) and ``pytest-timeout`` (``--timeout``, 120 s a test). Lightning's
``@pytest.mark.flaky`` comes from ``pytest-rerunfailures``, which is not needed: the plugin registers the marker,
and the reruns above replace it.

Cost on 2 shared CPU cores: about 145 selected tests per pass (75 run, the rest skipped for GPUs), 3-8 minutes a
pass depending on the load; about 9 minutes in all with the reruns and the standalone tests. ``--areas`` and
``-k`` narrow a run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent

# area -> (files or directories under tests/tests_pytorch, whether every test of them counts)
AREAS: dict[str, list[tuple[str, bool]]] = {
    "callbacks": [("callbacks", False)],
    "checkpointing": [("checkpointing", False)],
    "loops": [("loops", False)],
    "logging": [
        ("trainer/logging_", False),
        ("core/test_results.py", False),
        ("core/test_metric_result_integration.py", False),
    ],
    "manual_optimization": [("trainer/optimization/test_manual_optimization.py", False)],
    "dataloaders": [
        ("trainer/connectors/test_data_connector.py", False),
        ("trainer/test_dataloaders.py", False),
        ("trainer/flags/test_overfit_batches.py", False),
    ],
    "all_gather": [("utilities/test_all_gather_grad.py", False)],
    "strategies": [
        ("strategies/test_ddp.py", True),
        ("strategies/test_ddp_integration.py", True),
        ("strategies/test_ddp_integration_comm_hook.py", True),
        ("strategies/test_common.py", False),
        ("strategies/test_registry.py", False),
    ],
}

# Lost tests whose difference is accepted: test name without parameters -> (a regex the swapped failure message
# must match, why); a failure of the same test for another reason still counts as lost. Issue 26, item 10 accepts
# asserts on stock DDPStrategy's exact kwargs; the other entries assert stock's *error* where a documented SoloDDP
# default, with its off switch, runs instead (SoloDDP never fails where stock succeeds; the converse is its point).
EXPLAINED: dict[str, tuple[str, str]] = {
    "test_ddp_kwargs_from_registry": (
        r"^AssertionError: assert \{'(gradient_as|find_unused)",  # pytest 9.0 sorts the keys, 9.2 does not
        "asserts `strategy._ddp_kwargs == {}` / `{'find_unused_parameters': ...}` exactly, stock's kwargs for each "
        "registry name. SoloDDP adds its documented defaults: `gradient_as_bucket_view=True`, and "
        "`find_unused_parameters=True` for the evidence window of `find_unused_parameters='auto'` where the name "
        "sets none; a name that sets it keeps its value.",
    ),
    # Not kwargs: these assert stock's *error* on a model with unused parameters (standalone tests).
    **dict.fromkeys(
        ("test_find_unused_parameters_ddp_spawn_raises", "test_find_unused_parameters_ddp_exception"),
        (
            r"^Failed: DID NOT RAISE",
            "asserts that stock DDP raises on a model with a parameter that gets no gradient. The registry name sets "
            "no `find_unused_parameters`, so SoloDDP's documented default `'auto'` applies: it detects the unused "
            "parameter and trains. The off switch, `find_unused_parameters=False`, raises (with SoloDDP's own "
            "message, not stock's text).",
        ),
    ),
}


# Root causes found for lost tests (test name -> cause and fix), shown beside them until they pass: they still
# count as lost.
LOST_CAUSES: dict[str, str] = {
    "test_model_checkpoint_no_extraneous_invocations": (
        "The test wraps `torch.save` in a Mock and asserts rank 0 calls it once per checkpoint and rank 1 never. "
        "SoloDDP's `save_checkpoint` builds the resume record on every rank: "
        "`lightning_solo/ddp/resume/record.py::capture` gathers each rank's RNG state (`torch.get_rng_state()`, a "
        "tensor) with `torch.distributed.all_gather_object`, and pickling a tensor goes through `torch.save` "
        "(`Storage.__reduce__`), so every rank calls `torch.save` at each checkpoint (no file is written). Fix: "
        "gather the states without pickling tensors, e.g. wrap each tensor as a numpy array before "
        "`all_gather_object` and turn it back after (checked: the test then passes swapped)."
    ),
}

# Tests that fail stock in this environment (test name -> why); they do not count either way.
STOCK_NOTES: dict[str, str] = {
    "test_distributed_sampler_without_global_seed": (
        "fails on torch 2.14 in both passes: `LightningModule.all_gather` calls "
        "`torch.distributed.nn.functional.all_gather`, deprecated with a FutureWarning, an error under Lightning's "
        "pytest settings; the failing rank makes Lightning's launcher kill the test process"
    ),
}


def explained(nodeid: str, message: str) -> str | None:
    """Why a lost test is accepted, or None."""
    entry = EXPLAINED.get(base_name(nodeid))
    return entry[1] if entry is not None and re.search(entry[0], message) else None


# Long, repetitive parametrizations cut to the cases that exercise DDP (test name -> regex on the case id);
# --full runs every case. test_trainer_spike_detection_integration: 24 ddp_spawn fits (a third of a pass) over
# rank x devices x spike value x finite_only; kept: a spike on rank 1 of 2 (the case where the ranks must agree),
# a finite spike and a NaN, with and without finite_only.
TRIM: dict[str, str] = {"test_trainer_spike_detection_integration": r"^1-2-(None|nan)-"}

PASSING = ("passed", "xfailed")

# (installed, checkout) -> why the checkout's tests stand for the installed release.
VERSION_NOTES: dict[tuple[str, str], str] = {
    ("2.6.6", "2.6.5"): "2.6.6 has no tag in Lightning's repository; its package differs from 2.6.5 only in "
    "`core/saving.py` (the `load_from_checkpoint` allowlist for `_instantiator`/`_class_path`), which no DDP "
    "test reaches",
}


def installed_lightning() -> str:
    import lightning

    return lightning.__version__


def checkout_version(src: Path) -> str | None:
    for candidate in (src / "src" / "version.info", src / "src" / "lightning" / "version.info"):
        if candidate.is_file():
            return candidate.read_text().strip()
    return None


def area_paths(tests: Path, areas: list[str]) -> tuple[list[str], list[str], list[str]]:
    """The pytest arguments for ``areas`` (relative to ``tests``), the whole-file ones, and those missing."""
    paths, whole, missing = [], [], []
    for area in areas:
        for rel, all_tests in AREAS[area]:
            path = Path("tests_pytorch") / rel
            if not (tests / path).exists():
                missing.append(str(path))
                continue
            paths.append(str(path))
            if all_tests:
                whole.append(str(tests / path))
    return paths, whole, missing


def area_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    path = path[path.index("tests_pytorch/") + len("tests_pytorch/") :] if "tests_pytorch/" in path else path
    for area, entries in AREAS.items():
        if any(path == rel or path.startswith(rel.rstrip("/") + "/") for rel, _ in entries):
            return area
    return "?"


def run_pass(
    src: Path,
    targets: list[str],
    options: list[str],
    args: argparse.Namespace,
    swapped: bool,
    label: str,
    allow_missing: bool = False,
) -> dict:
    """One pytest process over ``targets`` (paths or node ids, relative to ``src/tests``); returns its report
    (``lightning_suite_plugin``'s JSON, with the wall time) and leaves it and the log in ``args.results``."""
    report = args.results / f"{label}.json"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "--color=no",
        "-p",
        "no:cacheprovider",
        f"--timeout={args.timeout}",
        "-p",
        "lightning_suite_plugin",
        f"--solo-report={report}",
        *(["--solo-swap"] if swapped else []),
        *options,
        *args.pytest_args,
        *targets,
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SCRIPTS), str(src / "tests"), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_path = args.results / f"{label}.log"
    print(f"\n== {label}: {shlex.join(command[1:])}\n   (cwd {src / 'tests'}, log {log_path})", flush=True)
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(command, cwd=src / "tests", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        # Chunks, not lines: pytest's progress dots come without a newline.
        while chunk := os.read(proc.stdout.fileno(), 65536):
            log.write(chunk)
            log.flush()
            if not args.quiet:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
        proc.wait()
    if not report.is_file():
        # A failing rank of a standalone test makes Lightning's launcher SIGKILL the pytest process.
        message = f"{label} wrote no report (pytest exit {proc.returncode}); see {log_path}"
        if not allow_missing:
            raise SystemExit(message)
        print(message, flush=True)
        return {"tests": {}, "exitstatus": proc.returncode, "no_report": message}
    data = json.loads(report.read_text())
    data["wall_s"] = round(time.monotonic() - start, 1)
    report.write_text(json.dumps(data, indent=1))
    return data


def target_of(src: Path, nodeid: str) -> str:
    """A node id from a report (relative to pytest's rootdir: the checkout with its pyproject.toml, else
    ``tests/``) as a target for a pytest run in ``src/tests``."""
    path, _, rest = nodeid.partition("::")
    for root in (src, src / "tests"):
        if (root / path).is_file():
            return f"{os.path.relpath(root / path, src / 'tests')}::{rest}"
    return nodeid


STANDALONE_SKIP = "Requires: [Standalone execution]"


def run_standalone(src: Path, args: argparse.Namespace, stock: dict, swapped: dict) -> None:
    """Run the selected tests that Lightning keeps for standalone execution and that need no GPU, as Lightning's
    ``run_standalone_tasks.sh`` does: one pytest process per test with ``PL_RUN_STANDALONE_TESTS=1`` (their
    ``ddp`` launcher re-runs the command for the other ranks), stock and swapped; their results replace the
    skips."""
    tests = sorted(  # either pass's skips: a reused stock pass has its standalone results in already
        {
            n
            for report in (stock, swapped)
            for n, r in report["tests"].items()
            if r["outcome"] == "skipped" and r["message"].endswith(STANDALONE_SKIP)
        }
    )
    os.environ["PL_RUN_STANDALONE_TESTS"] = "1"
    try:
        for n in tests:
            for name, report in (("stock", stock), ("swapped", swapped)):
                if report["tests"].get(n, {}).get("outcome") != "skipped":
                    continue
                target = target_of(src, report["tests"][n].get("nodeid", n))
                label = f"{name}-standalone-{base_name(n)}"
                again = run_pass(src, [target], [], args, swapped=name == "swapped", label=label, allow_missing=True)
                record = again["tests"].get(n) or {
                    "nodeid": target,
                    "outcome": "error",
                    "message": f"killed before reporting (a rank failed?): {again.get('no_report', '')}",
                    "duration": 0.0,
                }
                report["tests"][n] = {**record, "standalone": True}
    finally:
        del os.environ["PL_RUN_STANDALONE_TESTS"]


def rerun_failures(src: Path, args: argparse.Namespace, stock: dict, swapped: dict) -> None:
    """Give each failure that decides the comparison ``args.reruns`` more tries, in its own pass: a test that
    fails stock, and a test that passes stock and fails swapped. Lightning marks its gloo/spawn tests that abort
    at random ``@pytest.mark.flaky(reruns=3)``; a failure that does not come back is reported as flaky, with the
    first failure's message, and the test counts as passed."""
    for attempt in range(1, args.reruns + 1):
        failing = ("failed", "error")
        todo = {
            "stock": [n for n, r in stock["tests"].items() if r["outcome"] in failing],
            "swapped": [
                n
                for n, r in swapped["tests"].items()
                if r["outcome"] in failing and stock["tests"].get(n, {}).get("outcome") in PASSING
            ],
        }
        # Standalone tests ran once each in their own process (run_standalone): not retried.
        todo = {k: [n for n in v if not stock["tests"].get(n, {}).get("standalone")] for k, v in todo.items()}
        if not any(todo.values()):
            return
        for name, report in (("stock", stock), ("swapped", swapped)):
            if not todo[name]:
                continue
            targets = [target_of(src, report["tests"][n].get("nodeid", n)) for n in todo[name]]
            label = f"{name}-rerun{attempt}"
            again = run_pass(src, targets, [], args, swapped=name == "swapped", label=label, allow_missing=True)
            for n in todo[name]:
                record, first = again["tests"].get(n), report["tests"][n]
                if record is not None and record["outcome"] in PASSING:
                    report["tests"][n] = {
                        **record,
                        "nodeid": first.get("nodeid", n),
                        "flaky": f"{first['outcome']} in the pass ({first['message']}), passed on rerun {attempt}",
                    }
                elif record is not None:
                    # Still failing: the latest failure is reported (the first may be a one-off).
                    messages = [*first.get("earlier", []), first["message"]]
                    report["tests"][n] = {**record, "nodeid": first.get("nodeid", n), "earlier": messages}


def short_name(nodeid: str) -> str:
    """``tests_pytorch/a/b.py::test_x[p]`` -> ``a/b.py::test_x[p]``."""
    return nodeid.split("tests_pytorch/", 1)[-1]


def base_name(nodeid: str) -> str:
    return re.sub(r"\[.*\]$", "", nodeid.split("::")[-1])


def cell(text: str, limit: int = 220) -> str:
    text = " ".join(text.split())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("|", "\\|")


def compare(stock: dict, swapped: dict) -> tuple[list[str], list[str]]:
    """(tests that pass stock and not swapped, tests that fail stock and pass swapped).

    A stock report reused from an earlier run (``--reuse-stock``) may hold more tests than this selection: then
    only the tests the swapped pass selected count.
    """
    s, w = stock["tests"], swapped["tests"]
    if swapped.get("reused_stock"):
        s = {n: v for n, v in s.items() if n in w}
    lost = [n for n in s if s[n]["outcome"] in PASSING and w.get(n, {}).get("outcome") not in PASSING]
    gained = [n for n in w if w[n]["outcome"] in PASSING and s.get(n, {}).get("outcome") not in PASSING]
    return lost, gained


def _cases(nodeids: list[str]) -> str:
    """``12: `ddp_spawn`, `ddp_fork`, ...``: how many cases, each by the first part of its id."""
    params = [m[1].split("-")[0] for m in (re.search(r"\[(.*)\]$", n) for n in nodeids) if m]
    return f"{len(nodeids)}: " + ", ".join(f"`{p}`" for p in params) if params else str(len(nodeids))


def markdown(stock: dict, swapped: dict, meta: dict) -> str:
    s, w = stock["tests"], swapped["tests"]
    if swapped.get("reused_stock"):
        s = {n: v for n, v in s.items() if n in w}
    lost, gained = compare(stock, swapped)
    why = {n: explained(n, w.get(n, {}).get("message", "")) for n in lost}
    unexplained = [n for n in lost if not why[n]]
    names = list(dict.fromkeys([*s, *w]))
    both_skipped = {n for n in names if s.get(n, {}).get("outcome") == w.get(n, {}).get("outcome") == "skipped"}
    out = [
        "# Lightning's own DDP tests, stock vs SoloDDP",
        "",
        "Generated by `scripts/lightning_suite.py` (issue 26, item 10): Lightning's DDP-related tests run twice,",
        "stock and with `SoloDDP` registered in place of `DDPStrategy` (`ddp`, `ddp_spawn`, `ddp_fork`,",
        "`ddp_notebook` and the `*_find_unused_parameters_*` names, and `DDPStrategy(...)` built by the tests).",
        "The selection and the swap are described in the script's docstring. A test that fails is tried twice",
        "more before it counts (Lightning's gloo/spawn tests abort at random now and then); Lightning's CPU",
        "standalone tests run one per process, as its CI runs them.",
        "",
        "How to run (the tests are read from a checkout of Lightning's source tree, never copied here):",
        "",
        "```",
        "# a checkout of the release's tag, e.g. from a clone: git archive 2.6.5 tests src/version.info \\",
        "#   pyproject.toml | tar -x -C /tmp/lsrc",
        "pip install 'jsonargparse>=4.39,<4.46'      # imported by checkpointing/test_model_checkpoint.py",
        "python scripts/lightning_suite.py /tmp/lsrc --out docs/lightning-suite.md",
        "```",
        "",
        f"- Lightning installed: {meta['installed']}; tests from the checkout's version {meta['checkout']}"
        + (f" ({meta['version_note']})" if meta.get("version_note") else ""),
        f"- torch {meta['torch']}, Python {meta['python']}, {meta['cpus']} CPU cores, {meta['date']}",
        f"- Command: `{meta['command']}`",
        f"- Wall time: stock pass {stock['wall_s']:.0f} s, swapped pass {swapped['wall_s']:.0f} s"
        + (
            f"; {swapped['total_s']:.0f} s in all, with the reruns and standalone tests" if "total_s" in swapped else ""
        ),
        "",
        f"**Lost (pass stock, fail swapped): {len(unexplained)}**, apart from {len(lost) - len(unexplained)} "
        "accepted below. Gained (fail stock, pass swapped): "
        f"{len(gained)}.",
        "",
        "| area | selected | skipped (both) | stock passed | swapped passed | lost | accepted |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for area in dict.fromkeys(area_of(n) for n in names):
        mine = [n for n in names if area_of(n) == area]
        out.append(
            f"| {area} | {len(mine)} | {sum(1 for n in mine if n in both_skipped)} "
            f"| {sum(1 for n in mine if s.get(n, {}).get('outcome') in PASSING)} "
            f"| {sum(1 for n in mine if w.get(n, {}).get('outcome') in PASSING)} "
            f"| {sum(1 for n in unexplained if area_of(n) == area)} "
            f"| {sum(1 for n in lost if why[n] and area_of(n) == area)} |"
        )
    if unexplained:
        out += ["", "## Lost tests", "", "| test | swapped | failure | cause |", "| --- | --- | --- | --- |"]
        for n in unexplained:
            record = w.get(n, {})
            cause = LOST_CAUSES.get(base_name(n), "")
            out.append(
                f"| `{short_name(n)}` | {record.get('outcome', 'not run')} "
                f"| {cell(record.get('message', ''))} | {cell(cause, 1000)} |"
            )
    accepted: dict[str, list[str]] = {}
    for n in lost:
        if why[n]:
            accepted.setdefault(short_name(n).split("[")[0], []).append(n)
    if accepted:
        out += ["", "## Accepted differences", "", "| test | cases | why |", "| --- | --- | --- |"]
        for test, nodeids in accepted.items():
            out.append(f"| `{test}` | {_cases(nodeids)} | {cell(why[nodeids[0]] or '', 1000)} |")
    out += [
        "",
        "## Every test that ran",
        "",
        "Tests skipped in both passes (GPU, standalone on GPU, torch version) are counted above and left out here.",
        "",
        "| test | stock | swapped | note |",
        "| --- | --- | --- | --- |",
    ]
    for n in names:
        if n in both_skipped:
            continue
        so, wo = s.get(n, {}).get("outcome", "not run"), w.get(n, {}).get("outcome", "not run")
        notes = []
        if so not in PASSING and so != "skipped":
            notes.append("stock: " + (STOCK_NOTES.get(base_name(n)) or s.get(n, {}).get("message", "")))
        if wo not in PASSING and wo != "skipped" and so in PASSING:
            notes.append("accepted (see above)" if why.get(n) else "LOST (see above)")
        notes += [
            f"{name} flaky: {r[n]['flaky']}" for name, r in (("stock", s), ("swapped", w)) if r.get(n, {}).get("flaky")
        ]
        if s.get(n, {}).get("standalone"):
            notes.append("standalone")
        out.append(f"| `{short_name(n)}` | {so} | {wo} | {cell('; '.join(notes), 400)} |")
    skip_reasons = Counter(cell(s[n]["message"], 90) for n in names if n in both_skipped)
    if skip_reasons:
        out += ["", "Skipped in both passes, by reason:", ""]
        out += [f"- {count} × {reason}" for reason, count in skip_reasons.most_common()]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="Lightning source checkout (holds tests/tests_pytorch)")
    parser.add_argument("--areas", nargs="+", choices=sorted(AREAS), default=list(AREAS), metavar="AREA")
    parser.add_argument("-k", default=None, help="pytest -k expression, applied to both passes")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    parser.add_argument("--timeout", type=int, default=120, help="per-test timeout in seconds (pytest-timeout)")
    parser.add_argument("--results", type=Path, default=None, help="folder for the JSON reports and logs")
    parser.add_argument("--full", action="store_true", help="run every case of the tests in TRIM")
    parser.add_argument("--reuse-stock", action="store_true", help="take the stock pass from --results")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: report on stock.json/swapped.json in --results",
    )
    parser.add_argument("--tracebacks", action="store_true", help="print the swapped failure of each lost test")
    parser.add_argument(
        "--reruns",
        type=int,
        default=2,
        help="more tries for a failure that decides the comparison (flaky gloo)",
    )
    parser.add_argument(
        "--no-standalone",
        dest="standalone",
        action="store_false",
        help="leave Lightning's CPU standalone tests skipped (by default each runs in its own process)",
    )
    parser.add_argument("--quiet", action="store_true", help="do not echo pytest's output")
    parser.add_argument("--pytest-args", nargs=argparse.REMAINDER, default=[], help="passed on to pytest")
    args = parser.parse_args(argv)

    src = args.src.resolve()
    tests = src / "tests"
    if not (tests / "tests_pytorch").is_dir():
        parser.error(f"{src} has no tests/tests_pytorch: pass the root of Lightning's source tree")
    installed, checkout = installed_lightning(), checkout_version(src)
    note = None
    if checkout is None:
        note = "no src/version.info in the checkout: make sure it is the installed release"
    elif checkout != installed:
        note = VERSION_NOTES.get((installed, checkout), f"the checkout is {checkout}, not the installed {installed}")
    if note:
        print(f"warning: {note}", file=sys.stderr)
    if not (src / "pyproject.toml").is_file():
        print(
            "warning: no pyproject.toml in the checkout: Lightning's pytest settings are not applied",
            file=sys.stderr,
        )

    paths, whole, missing = area_paths(tests, args.areas)
    for path in missing:
        print(f"warning: {path} is not in this checkout; skipped", file=sys.stderr)
    if not paths:
        parser.error("nothing to run")
    if (args.report_only or args.reuse_stock) and args.results is None:
        parser.error("--report-only and --reuse-stock read the reports of an earlier run: pass --results")
    results = args.results or Path(tempfile.mkdtemp(prefix="lightning_suite_"))
    results.mkdir(parents=True, exist_ok=True)

    args.results = results
    selection = [
        "--solo-select",
        f"--solo-all={','.join(whole)}",
        *([] if args.full else [f"--solo-trim={test}={regex}" for test, regex in TRIM.items()]),
        *(["-k", args.k] if args.k else []),
    ]
    started = time.monotonic()
    if args.report_only:
        stock, swapped = (json.loads((results / f"{name}.json").read_text()) for name in ("stock", "swapped"))
    else:
        if args.reuse_stock and (results / "stock.json").is_file():
            stock = json.loads((results / "stock.json").read_text())
            print(f"== stock pass: reused {results / 'stock.json'}")
        else:
            stock = run_pass(src, paths, selection, args, swapped=False, label="stock")
        swapped = run_pass(src, paths, selection, args, swapped=True, label="swapped")
        swapped["reused_stock"] = bool(args.reuse_stock)
        if args.standalone:
            run_standalone(src, args, stock, swapped)
        rerun_failures(src, args, stock, swapped)
        swapped["total_s"] = round(time.monotonic() - started, 1)
        for name, report in (("stock", stock), ("swapped", swapped)):
            (results / f"{name}.json").write_text(json.dumps(report, indent=1))

    import torch

    command = "python scripts/lightning_suite.py LIGHTNING_SRC"
    if set(args.areas) != set(AREAS):
        command += " --areas " + " ".join(args.areas)
    if args.k:
        command += f" -k {shlex.quote(args.k)}"
    if args.out:
        command += f" --out {args.out}"
    meta = {
        "installed": installed,
        "checkout": checkout or "unknown",
        "version_note": note,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
        "command": command,
    }
    text = markdown(stock, swapped, meta)
    print("\n" + text)
    if args.out:
        args.out.write_text(text)
        print(f"written to {args.out}")
    lost, _ = compare(stock, swapped)
    if args.tracebacks:
        for n in lost:
            print(f"\n---- {short_name(n)} (swapped) ----\n{swapped['tests'].get(n, {}).get('longrepr', '')}")
    print(f"results and logs: {results}")
    return 1 if any(not explained(n, swapped["tests"].get(n, {}).get("message", "")) for n in lost) else 0


if __name__ == "__main__":
    sys.exit(main())
