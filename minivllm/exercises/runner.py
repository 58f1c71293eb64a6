"""Check a chapter's exercises: run its tests in a subprocess and give a verdict per exercise.

The tests are `tests/exercises/test_chNN_*.py`, those marked `@pytest.mark.exercise(...)`.
They run in a fresh Python process, so the learner's code never touches this one, and so
`TRITON_INTERPRET=1` (set when there is no GPU) is in place before any Triton kernel is
defined. An exercise passes when at least one of its tests ran and none failed; the check
passes when every exercise of the chapter passed, and fails when no test ran at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from minivllm.exercises import exercises_root
from minivllm.exercises.markers import Exercise, exercises_by_chapter

@dataclass
class ExerciseResult:
    exercise: Exercise
    passed: list[str] = field(default_factory=list)  # test node ids
    failed: list[tuple[str, str]] = field(default_factory=list)  # (test node id, short message)
    skipped: list[str] = field(default_factory=list)
    not_checked: str | None = None  # why its tests could not run (the learner's file did not load)

    @property
    def status(self) -> str:
        if self.failed or self.not_checked:
            return "FAIL"
        return "PASS" if self.passed else "NO TEST"


@dataclass
class CheckResult:
    chapter: str
    impl: str
    results: list[ExerciseResult]
    problems: list[str]  # anything that makes the check fail beyond a failed exercise
    output: str  # pytest's own output (empty when it went to the terminal)

    @property
    def num_tests_run(self) -> int:
        return len({t for r in self.results for t in r.passed} | {t for r in self.results for t, _ in r.failed})

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.status == "PASS" for r in self.results)


def chapter_exercises(chapter: str) -> list[Exercise]:
    exercises = exercises_by_chapter(exercises_root()).get(chapter)
    if not exercises:
        known = ", ".join(exercises_by_chapter(exercises_root())) or "none"
        raise ValueError(f"chapter {chapter} has no exercises (chapters with exercises: {known})")
    return exercises


def chapter_test_files(chapter: str) -> list[Path]:
    return sorted((exercises_root() / "tests" / "exercises").glob(f"test_ch{chapter}_*.py"))


def run_check(
    chapter: str, impl: str, impl_file: Path | None = None, verbose: bool = False, files: list[Path] | None = None
) -> CheckResult:
    """Run chapter `chapter`'s exercise tests with `impl_file`'s functions swapped in (none: the reference).

    `files` replaces the chapter's test files (the machinery's own tests use it).
    """
    exercises = chapter_exercises(chapter)
    files = chapter_test_files(chapter) if files is None else files
    if not files:
        return CheckResult(chapter, impl, [ExerciseResult(e) for e in exercises], [f"no tests/exercises/test_ch{chapter}_*.py"], "")
    root = exercises_root()
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        command = [
            sys.executable, "-m", "pytest", *map(str, files), "-m", "exercise",
            "-p", "minivllm.exercises.pytest_plugin", "-p", "no:cacheprovider",
            "--exercise-chapter", chapter, "--exercise-report", str(report_path),
        ]  # fmt: skip
        if impl_file is not None:
            command += ["--exercise-impl", str(impl_file.resolve())]
        command += ["-v", "--tb=short"] if verbose else ["-q", "--tb=no", "--no-header"]
        completed = subprocess.run(command, cwd=root, env=_subprocess_env(), capture_output=not verbose, text=True)
        output = (completed.stdout or "") + (completed.stderr or "")
        if not report_path.exists():
            problem = f"pytest did not run the tests:\n{output.strip()[-3000:]}"
            return CheckResult(chapter, impl, [ExerciseResult(e) for e in exercises], [problem], output)
        report = json.loads(report_path.read_text(encoding="utf-8"))
    return _verdict(chapter, impl, exercises, report, output)


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    import torch  # late: listing and init need no torch

    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"  # Triton's CPU interpreter; must be set before kernels are defined
    return env


def _verdict(chapter: str, impl: str, exercises: list[Exercise], report: dict, output: str) -> CheckResult:
    results = {e.id: ExerciseResult(e) for e in exercises}
    problems = list(report["errors"])
    if report["load_error"]:
        problems.append(report["load_error"])
        for r in results.values():
            r.not_checked = "the file did not load (see below)"
    for test in report["tests"]:
        unknown = [i for i in test["exercises"] if i not in results]
        if unknown:
            problems.append(f"{test['nodeid']} is marked with {', '.join(unknown)}: not an exercise of chapter {chapter}")
        if not test["exercises"]:
            problems.append(f"{test['nodeid']} has an exercise mark without an exercise id")
        for exercise_id in test["exercises"]:
            if exercise_id not in results:
                continue
            if test["outcome"] == "failed":
                results[exercise_id].failed.append((test["nodeid"], test["message"]))
            else:
                getattr(results[exercise_id], test["outcome"]).append(test["nodeid"])
    if not any(test["outcome"] in ("passed", "failed") for test in report["tests"]):
        problems.append("no exercise test ran")
    return CheckResult(chapter, impl, list(results.values()), problems, output)


def format_report(result: CheckResult) -> str:
    """The verdict as a learner reads it: one line per exercise, its hint, what failed."""
    lines = [f"chapter {result.chapter} exercises, checked against the {result.impl} implementation:"]
    width = max(len(r.exercise.id) for r in result.results)
    for r in result.results:
        counts = f"{len(r.passed)}/{len(r.passed) + len(r.failed)} tests passed" + (f", {len(r.skipped)} skipped" if r.skipped else "")
        lines.append(f"  {r.status:<7} {r.exercise.id:<{width}}  {counts}")
        lines.append(f"          hint: {r.exercise.hint}")
        if r.not_checked:
            lines.append(f"          not checked: {r.not_checked}")
        by_message: dict[str, list[str]] = {}  # an unwritten exercise fails every test the same way
        for nodeid, message in r.failed:
            by_message.setdefault(message, []).append(nodeid.split("::")[-1])
        for message, names in by_message.items():
            more = f" (and {len(names) - 1} more the same way)" if len(names) > 1 else ""
            lines.append(f"          failed {names[0]}{more}:")
            lines += [f"            {line}" for line in message.splitlines()]
    for problem in result.problems:
        first, *rest = problem.splitlines()
        lines += [f"  PROBLEM {first}", *(f"    {line}" for line in rest)]
    num_passed = sum(r.status == "PASS" for r in result.results)
    lines.append(f"{num_passed} of {len(result.results)} exercises passed; {result.num_tests_run} tests ran.")
    return "\n".join(lines)
