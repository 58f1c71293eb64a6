"""Swap a learner's functions into minivllm: per test, only the exercises that test is about.

`minivllm exercise check NN --impl skeleton|learner` loads the chosen file as a module and,
around each test, puts the learner's version of every exercise the test is marked with
(`@pytest.mark.exercise("chNN-...")`) where the reference lives: a method onto the real class,
a module function into its module. Every other exercise stays the reference, also when the
learner's own code calls it by name, so one unfinished exercise never fails another's tests.
After the test, everything is put back.

The rule for authors, which makes this work: call an exercised function through its module or
class (`self._preempt(...)`, `check_stop(...)` inside its own module, `scheduler.check_stop(...)`
from elsewhere), never through a reference captured at import time. As a safety net, names that
modules of the repository (minivllm and the tests) imported with `from module import function`
are re-bound too; copies hidden in containers (dicts, default arguments, partials) are not.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from minivllm.exercises import REPO_ROOT
from minivllm.exercises.markers import Exercise


@dataclass(slots=True)
class Swap:
    """One exercise: where its reference lives, the reference itself, and the learner's version."""

    exercise: Exercise
    owner: type | ModuleType  # the real class, or the module of a module function
    reference: Any  # the raw class attribute (keeps a staticmethod a staticmethod) or function
    learner: Any


def load_learner_module(path: Path, chapter: str) -> ModuleType:
    """Import the learner's (or the skeleton's) file under a name of its own."""
    name = f"minivllm_exercises_ch{chapter}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a module up by name
    spec.loader.exec_module(module)
    return module


def prepare_swaps(exercises: list[Exercise], learner_module: ModuleType) -> dict[str, Swap]:
    """Pair every exercise's reference with the learner's version (or a stand-in that says it is missing)."""
    swaps = {}
    for exercise in exercises:
        module = importlib.import_module(exercise.module)
        name = exercise.function_name
        if exercise.class_name is not None:
            owner = getattr(module, exercise.class_name)
            stub = getattr(learner_module, exercise.class_name, None)
            learner = vars(stub).get(name) if isinstance(stub, type) else None
            reference = vars(owner)[name]
        else:
            owner = module
            learner = getattr(learner_module, name, None)
            reference = getattr(module, name)
        swaps[exercise.id] = Swap(exercise, owner, reference, learner if learner is not None else _missing(exercise))
    return swaps


@contextmanager
def swapped(swaps: dict[str, Swap], exercise_ids: Iterable[str], learner_module: ModuleType) -> Iterator[None]:
    """The learner's versions of `exercise_ids` in minivllm; the reference for every other exercise."""
    active = set(exercise_ids)
    undo: list[tuple[Any, str, Any]] = []

    def put(namespace: Any, name: str, value: Any) -> None:
        undo.append((namespace, name, vars(namespace)[name]))
        setattr(namespace, name, value)

    try:
        for exercise_id, swap in swaps.items():
            name = swap.exercise.function_name
            if exercise_id in active:
                if swap.exercise.class_name is None:
                    for module in _repository_modules(learner_module):
                        for alias, value in list(vars(module).items()):
                            if value is swap.reference:  # the module itself, or `from m import f`
                                put(module, alias, swap.learner)
                else:
                    put(swap.owner, name, swap.learner)
            elif swap.exercise.class_name is None and hasattr(learner_module, name):
                put(learner_module, name, swap.reference)  # the learner's code calls the reference
        yield
    finally:
        for namespace, name, value in reversed(undo):
            setattr(namespace, name, value)


def _repository_modules(learner_module: ModuleType) -> list[ModuleType]:
    """Loaded modules from this repository (minivllm, kernels, tests), not the learner's file."""
    root = str(REPO_ROOT) + "/"
    return [
        module
        for module in list(sys.modules.values())
        if module is not learner_module and (getattr(module, "__file__", None) or "").startswith(root)
    ]


def _missing(exercise: Exercise) -> Any:
    """Stands in for a function the learner's file lacks, and says so when called."""

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{exercise.id}: your file has no {exercise.qualname}; "
            f"copy it from exercises/ch{exercise.chapter}/skeleton.py"
        )

    return missing
