"""The pytest side of `minivllm exercise check`: swap functions in, record each test's outcome.

The checker runs, in a subprocess,

    pytest tests/exercises/test_chNN_*.py -m exercise -p minivllm.exercises.pytest_plugin \\
        --exercise-chapter NN --exercise-report out.json [--exercise-impl learner.py]

With `--exercise-impl`, each test runs with the learner's versions of the exercises it is
marked with (`patching.swapped`). Every test's outcome, and anything that kept tests from
running (the file did not import, a test file did not collect), goes to the JSON report that
`runner.py` turns into the per-exercise verdict.
"""

from __future__ import annotations

import json
import signal
import traceback
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from minivllm.exercises.markers import exercises_by_chapter, normalize_chapter
from minivllm.exercises.patching import Swap, load_learner_module, prepare_swaps, swapped


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("minivllm exercises")
    group.addoption("--exercise-chapter", help="the chapter whose exercises are checked (e.g. 03)")
    group.addoption("--exercise-impl", help="a skeleton or learner file whose exercised functions are swapped in")
    group.addoption("--exercise-report", help="write every test's outcome to this JSON file")
    group.addoption("--exercise-timeout", type=float, default=120.0, help="seconds before a test counts as hung (default 120)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "exercise(*ids): the test checks these exercises (exercises/README.md)")
    if config.getoption("exercise_chapter"):
        config.pluginmanager.register(ExerciseSession(config), "minivllm-exercise-session")


def exercise_ids(item: pytest.Item) -> list[str]:
    return [exercise_id for mark in item.iter_markers("exercise") for exercise_id in mark.args]


class ExerciseSession:
    """One check run: the learner's module (if any), the swaps, and the outcomes so far."""

    def __init__(self, config: pytest.Config) -> None:
        self.chapter = normalize_chapter(config.getoption("exercise_chapter"))
        self.report_path = config.getoption("exercise_report")
        self.timeout = config.getoption("exercise_timeout")
        self.tests: dict[str, dict[str, Any]] = {}
        self.errors: list[str] = []
        self.load_error: str | None = None
        self.learner_module: ModuleType | None = None
        self.swaps: dict[str, Swap] = {}
        impl = config.getoption("exercise_impl")
        if impl:
            try:
                self.learner_module = load_learner_module(Path(impl), self.chapter)
                self.swaps = prepare_swaps(exercises_by_chapter().get(self.chapter, []), self.learner_module)
            except Exception as exc:
                self.load_error = f"could not load {impl}:\n{_learner_traceback(exc)}"
                self._write()
                raise pytest.UsageError(self.load_error) from None

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        ids = exercise_ids(item)
        self.tests[item.nodeid] = {"nodeid": item.nodeid, "exercises": ids, "outcome": "passed", "message": ""}
        if self.learner_module is None:
            yield
            return
        with swapped(self.swaps, ids, self.learner_module):
            yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        if self.learner_module is None:
            yield
            return
        with _time_limit(self.timeout, exercise_ids(item)):  # around the test body only
            yield

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        test = self.tests.get(report.nodeid)
        if test is None or test["outcome"] == "failed":
            return
        if report.failed:
            test["outcome"], test["message"] = "failed", _short_message(report)
        elif report.skipped and report.when in ("setup", "call"):
            test["outcome"], test["message"] = "skipped", _short_message(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.errors.append(f"could not collect {report.nodeid}:\n{report.longreprtext}")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._write()

    def _write(self) -> None:
        if self.report_path:
            report = {"chapter": self.chapter, "load_error": self.load_error, "errors": self.errors, "tests": list(self.tests.values())}
            Path(self.report_path).write_text(json.dumps(report, indent=1), encoding="utf-8")


def _short_message(report: pytest.TestReport) -> str:
    """What went wrong, in a few lines: the exception and its message (assertion messages teach)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:  # where it was raised: the test's assert, or a line of the learner's code
        text = f"{crash.message}\n(at {Path(crash.path).name}:{crash.lineno})"
    elif isinstance(report.longrepr, tuple):  # a skip: (file, line, reason)
        text = str(report.longrepr[2])
    else:
        text = str(report.longrepr).strip().splitlines()[-1] if report.longrepr else ""
    lines = text.splitlines()
    return "\n".join(lines[:6] + (["...", lines[-1]] if len(lines) > 6 else []))


def _learner_traceback(exc: BaseException) -> str:
    """The traceback of a failed import, from the learner's code on (no import machinery)."""
    tb = traceback.TracebackException.from_exception(exc)
    machinery = str(Path(__file__).parent)
    frames = [f for f in tb.stack if not f.filename.startswith(("<frozen", machinery))]
    tb.stack = traceback.StackSummary.from_list(frames)
    return "".join(tb.format()).rstrip()


@contextmanager
def _time_limit(seconds: float, exercise_ids: list[str]) -> Iterator[None]:
    """Fail a test that runs too long (a learner's endless loop) instead of hanging the check."""
    if not hasattr(signal, "setitimer"):  # no SIGALRM (Windows): no limit
        yield
        return

    def hung(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still running after {seconds:.0f} s: an endless loop in {', '.join(exercise_ids)}?")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
