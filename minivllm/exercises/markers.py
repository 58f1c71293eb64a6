"""Find the exercises: `# exercise[chNN-name]: hint` comments above functions in the reference.

A marker sits on the line directly above a `def` (above its decorators, if any) of a module
function or of a method of a top-level class, in `minivllm/`. Every marked
function must have a docstring: it is the learner's specification, copied into the skeleton.
A marker anywhere else (above a nested function, a class, a statement) is an error, so a
misplaced marker never silently drops an exercise. See exercises/README.md.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
import threading
from pathlib import Path

from minivllm.exercises import REPO_ROOT

# CPython 3.11's parser is not thread-safe (gh-106905); the checks parse from two threads.
AST_PARSE_LOCK = threading.Lock()

MARKER = re.compile(r"^\s*#\s*exercise\[(?P<id>[^\]]*)\]\s*:?\s*(?P<hint>.*?)\s*$")
EXERCISE_ID = re.compile(r"^ch(?P<chapter>\d\d)-[a-z0-9]+(?:-[a-z0-9]+)*$")
# Source folders that hold exercises, and the package each is imported as.
SOURCE_PACKAGES = {"minivllm": "minivllm"}
# The exercise machinery itself mentions markers in its docs; it never holds exercises.
SKIPPED = {Path("minivllm/exercises")}


@dataclass(frozen=True, slots=True)
class Exercise:
    id: str  # "ch03-preempt"
    chapter: str  # "03"
    hint: str
    module: str  # "minivllm.scheduler.scheduler"
    qualname: str  # "Scheduler._preempt" (a method) or "check_stop" (a module function)
    file: Path  # relative to the repository root
    line: int  # the line of the `def`

    @property
    def class_name(self) -> str | None:
        return self.qualname.split(".")[0] if "." in self.qualname else None

    @property
    def function_name(self) -> str:
        return self.qualname.rsplit(".", 1)[-1]


class MarkerError(ValueError):
    """One or more markers are malformed or misplaced; the message lists each one."""


def normalize_chapter(chapter: str | int) -> str:
    """'3', '03', 'ch03' and 3 all mean chapter "03"."""
    text = str(chapter).lower().removeprefix("ch")
    if not text.isdigit() or not 0 < int(text) < 100:
        raise ValueError(f"a chapter is a number like 03, got {chapter!r}")
    return f"{int(text):02d}"


def find_exercises(root: Path = REPO_ROOT) -> list[Exercise]:
    """Every exercise in the source tree, in file and line order. Raises MarkerError."""
    exercises: list[Exercise] = []
    errors: list[str] = []
    for folder, package in SOURCE_PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root)
            if any(skip in relative.parents for skip in SKIPPED):
                continue
            source = path.read_text(encoding="utf-8")
            if "exercise[" in source:
                exercises += _exercises_in_file(source, relative, _module_name(relative, folder, package), errors)
    seen: dict[str, Exercise] = {}
    for exercise in exercises:
        if exercise.id in seen:
            first = seen[exercise.id]
            errors.append(f"{exercise.file}:{exercise.line}: exercise id {exercise.id!r} is already used at {first.file}:{first.line}")
        seen.setdefault(exercise.id, exercise)
    if errors:
        raise MarkerError("bad exercise markers:\n" + "\n".join(errors))
    return exercises


def exercises_by_chapter(root: Path = REPO_ROOT) -> dict[str, list[Exercise]]:
    chapters: dict[str, list[Exercise]] = {}
    for exercise in find_exercises(root):
        chapters.setdefault(exercise.chapter, []).append(exercise)
    return dict(sorted(chapters.items()))


def _module_name(relative: Path, folder: str, package: str) -> str:
    parts = list(relative.with_suffix("").parts[1:])  # drop the source folder itself
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def _exercises_in_file(source: str, relative: Path, module: str, errors: list[str]) -> list[Exercise]:
    lines = source.splitlines()
    # The first line of every def we can exercise (its first decorator, else the `def`).
    defs: dict[int, tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = {}
    with AST_PARSE_LOCK:  # CPython 3.11's parser is not thread-safe (gh-106905)
        tree = ast.parse(source, filename=str(relative))
    for node, qualname in _functions(tree):
        first_line = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        defs[first_line] = (qualname, node)

    found = []
    for index, text in enumerate(lines):
        match = MARKER.match(text)
        if match is None:
            continue
        where = f"{relative}:{index + 1}"
        exercise_id, hint = match.group("id").strip(), match.group("hint")
        id_match = EXERCISE_ID.match(exercise_id)
        target = defs.get(index + 2)  # the line right below the marker (1-based)
        if id_match is None:
            errors.append(f"{where}: exercise id {exercise_id!r} is not of the form chNN-short-name")
        elif not hint:
            errors.append(f"{where}: exercise {exercise_id} has no hint after the colon")
        elif target is None:
            errors.append(
                f"{where}: marker {exercise_id} is not directly above the def (or first decorator) "
                "of a module function or of a method of a top-level class"
            )
        elif ast.get_docstring(target[1]) is None:
            errors.append(f"{where}: {target[0]} needs a docstring: it is the learner's specification")
        else:
            qualname, node = target
            found.append(Exercise(exercise_id, id_match.group("chapter"), hint, module, qualname, relative, node.lineno))
    return found


def _functions(tree: ast.Module):
    """(node, qualname) of module functions and methods of top-level classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, node.name
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield item, f"{node.name}.{item.name}"
