"""The exercise system keeps its promise for every chapter (DESIGN.md §5, exercises/README.md).

For every chapter with exercises: the committed skeleton is fresh; the reference passes every
exercise test; the untouched skeleton fails every one of them, each reported with its hint. And
the machinery itself: markers are found and checked, a learner's function is swapped in only
for its own exercise's tests, a check with no test fails, and the CLI records progress.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

import minivllm.scheduler.scheduler as sched
from minivllm.exercises import REPO_ROOT
from minivllm.exercises.generate import SkeletonError, main as generate_main, render_chapter, skeleton_path
from minivllm.exercises.markers import MarkerError, exercises_by_chapter, find_exercises
from minivllm.exercises.patching import load_learner_module, prepare_swaps, swapped
from minivllm.exercises.runner import CheckResult, format_report, run_check
from minivllm.scheduler.scheduler import check_stop as check_stop_imported_by_name

CHAPTERS = list(exercises_by_chapter())


@cache
def checks(chapter: str) -> dict[str, CheckResult]:
    """The chapter against the reference and against the skeleton: two pytest subprocesses, side by side."""

    def check(impl: str) -> CheckResult:
        return run_check(chapter, impl, skeleton_path(REPO_ROOT, chapter) if impl == "skeleton" else None)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(["reference", "skeleton"], pool.map(check, ["reference", "skeleton"])))


def test_there_are_exercises() -> None:
    assert "03" in CHAPTERS, "chapter 03 (scheduler) has exercises: no marker was found"


def test_skeletons_are_fresh() -> None:
    assert generate_main(["--check"]) == 0, "a skeleton is stale: run `python -m minivllm.exercises.generate`"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_reference_passes_every_exercise_test(chapter: str) -> None:
    result = checks(chapter)["reference"]
    assert result.ok, f"the reference must pass every exercise test:\n{format_report(result)}\n{result.output}"
    assert all(r.status == "PASS" for r in result.results), "every exercise needs at least one test that ran"


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_the_skeleton_fails_every_exercise_test(chapter: str) -> None:
    reference, skeleton = checks(chapter)["reference"], checks(chapter)["skeleton"]
    passed_anyway = sorted({t for r in skeleton.results for t in r.passed})
    assert not passed_anyway, f"these tests pass with the untouched skeleton, so they test nothing of the exercise: {passed_anyway}"
    ran = {t for r in reference.results for t in r.passed}
    failed = {t for r in skeleton.results for t, _ in r.failed}
    assert failed == ran, f"every test the reference passes must fail with the skeleton; not failing: {sorted(ran - failed)}"
    assert not skeleton.ok and not skeleton.problems, f"the skeleton should fail cleanly, test by test:\n{skeleton.problems}"
    report = format_report(skeleton)
    for r in skeleton.results:
        assert r.status == "FAIL", f"{r.exercise.id} should FAIL with the skeleton"
        assert re.search(rf"FAIL +{r.exercise.id} ", report) and r.exercise.hint in report, f"the report names {r.exercise.id} with its hint"


def test_a_check_where_no_test_is_selected_fails(tmp_path: Path) -> None:
    unmarked = tmp_path / "test_ch03_unmarked.py"
    unmarked.write_text("def test_without_exercise_mark():\n    pass\n")
    result = run_check("03", "reference", files=[unmarked])
    assert not result.ok and "no exercise test ran" in result.problems
    assert all(r.status == "NO TEST" for r in result.results)


# -- the CLI, as a learner uses it ----------------------------------------------------------

LEARNER_CHECK_STOP = '''\
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens and request.output_token_ids[-1] in params.all_stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = request.output_token_ids[-1] if request.output_token_ids[-1] in params.stop_token_ids else None
    elif request.num_output_tokens == params.max_tokens or request.num_tokens == max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return request.is_finished()
'''


def minivllm(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minivllm.cli.main", *args], cwd=cwd, capture_output=True, text=True)


def test_a_learner_passes_exactly_the_exercise_they_wrote(tmp_path: Path) -> None:
    assert minivllm("exercise", "init", "03", cwd=tmp_path).returncode == 0
    learner = tmp_path / "minivllm-exercises" / "ch03" / "skeleton.py"
    assert learner.read_text() == skeleton_path(REPO_ROOT, "03").read_text(), "init copies the skeleton"
    refused = minivllm("exercise", "init", "03", cwd=tmp_path)
    assert refused.returncode != 0 and "--force" in refused.stderr, "init must not overwrite the learner's work"

    text, n = re.subn(r' {4}raise NotImplementedError\("ch03-check-stop: .*"\)\n', LEARNER_CHECK_STOP, learner.read_text())
    assert n == 1
    learner.write_text(text)
    checked = minivllm("exercise", "check", "03", cwd=tmp_path)
    assert checked.returncode == 1, "the other exercises are not written yet, so the check fails"
    assert re.search(r"PASS +ch03-check-stop ", checked.stdout), (
        "the learner's check_stop passes its tests although the scheduler functions it meets there are "
        f"unwritten in their file (those stay the reference):\n{checked.stdout}"
    )
    assert re.search(r"FAIL +ch03-preempt ", checked.stdout)

    progress = json.loads((tmp_path / "minivllm-exercises" / "progress.json").read_text())
    assert progress["chapters"]["03"]["exercises"]["ch03-check-stop"] == "PASS"
    status = minivllm("exercise", "status", cwd=tmp_path).stdout
    assert re.search(rf"chapter 03: 1/{len(exercises_by_chapter()['03'])} passed", status), status


# -- the machinery, in process --------------------------------------------------------------


def test_swapping_is_per_exercise_and_undone(tmp_path: Path) -> None:
    learner_file = tmp_path / "learner.py"
    learner_file.write_text(
        "def check_stop(request, max_model_len):\n    return 'learner'\n\n"
        "class Scheduler:\n    def _preempt(self, request):\n        return 'learner'\n"
    )  # no num_tokens_to_schedule etc.: missing functions
    module = load_learner_module(learner_file, "03")
    swaps = prepare_swaps(exercises_by_chapter()["03"], module)
    reference_check_stop, reference_preempt = sched.check_stop, sched.Scheduler._preempt
    with swapped(swaps, ["ch03-check-stop"], module):
        assert sched.check_stop(None, 0) == "learner", "the module's function is the learner's"
        assert check_stop_imported_by_name(None, 0) == "learner", "names imported with `from ... import` are re-bound"
        assert sched.Scheduler._preempt is reference_preempt, "exercises the test is not about stay the reference"
    assert sched.check_stop is reference_check_stop and check_stop_imported_by_name is reference_check_stop
    with swapped(swaps, ["ch03-preempt", "ch03-num-new-tokens"], module):
        assert sched.Scheduler._preempt(None, None) == "learner"
        assert module.check_stop is reference_check_stop, "the learner's own calls reach the reference of other exercises"
        with pytest.raises(NotImplementedError, match="your file has no num_tokens_to_schedule"):
            sched.num_tokens_to_schedule(None, 1, True)
    assert sched.Scheduler._preempt is reference_preempt and module.check_stop(None, 0) == "learner"


def write_source(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_markers_are_found_above_functions_and_methods(tmp_path: Path) -> None:
    write_source(tmp_path, "minivllm/a.py", (
        "import torch\n\n\nclass Pool:\n    # exercise[ch09-take]: pop one\n    @property\n    def take(self) -> int:\n"
        '        """Doc."""\n        return torch.zeros(1)\n\n\n# exercise[ch09-add]: a + b\ndef add(a: int, b: int) -> int:\n'
        '    """Add."""\n    return a + b\n'
    ))  # fmt: skip
    write_source(tmp_path, "minivllm/kernels/k.py", '# exercise[ch09-kern]: k\ndef kern():\n    """K."""\n')
    found = {e.id: e for e in find_exercises(tmp_path)}
    assert (found["ch09-take"].qualname, found["ch09-take"].module) == ("Pool.take", "minivllm.a")
    assert (found["ch09-add"].qualname, found["ch09-add"].hint) == ("add", "a + b")
    assert found["ch09-kern"].module == "minivllm.kernels.k"
    text = render_chapter("09", list(found.values()), tmp_path)
    compile(text, "skeleton.py", "exec")
    assert "import torch" in text and "class Pool:" in text and "    @property\n    def take(self) -> int:" in text
    assert 'raise NotImplementedError("ch09-add: a + b")' in text and "return a + b" not in text


@pytest.mark.parametrize(
    "source, complaint",
    [
        ('x = 1\n# exercise[ch09-x]: hint\ny = 2\n', "not directly above"),
        ('# exercise[ch09-x]: hint\n\ndef f():\n    """Doc."""\n', "not directly above"),
        ('def outer():\n    """Doc."""\n    # exercise[ch09-x]: hint\n    def inner():\n        """Doc."""\n', "not directly above"),
        ('# exercise[09-x]: hint\ndef f():\n    """Doc."""\n', "chNN-short-name"),
        ('# exercise[ch09-x]:\ndef f():\n    """Doc."""\n', "no hint"),
        ("# exercise[ch09-x]: hint\ndef f():\n    pass\n", "needs a docstring"),
        ('# exercise[ch09-x]: a\ndef f():\n    """D."""\n\n\n# exercise[ch09-x]: b\ndef g():\n    """D."""\n', "already used"),
    ],
)
def test_bad_markers_are_errors(tmp_path: Path, source: str, complaint: str) -> None:
    write_source(tmp_path, "minivllm/a.py", source)
    with pytest.raises(MarkerError, match=complaint):
        find_exercises(tmp_path)


def test_colliding_names_in_one_chapter_are_errors(tmp_path: Path) -> None:
    for name in ("a", "b"):
        write_source(tmp_path, f"minivllm/{name}.py", f'# exercise[ch09-{name}]: hint\ndef step():\n    """Doc."""\n')
    with pytest.raises(SkeletonError, match="`step` is defined twice"):
        render_chapter("09", find_exercises(tmp_path), tmp_path)
