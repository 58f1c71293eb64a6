"""The exercise system: rebuild a piece of minivllm and check it with minivllm's own tests.

The reference implementation is the answer key. A `# exercise[chNN-name]: hint` comment above
a function in `minivllm/` (the kernels included) marks it as an exercise (`markers`); the learner's
skeletons under `exercises/chNN/` are generated from those markers (`generate`); `minivllm
exercise check NN` runs the chapter's exercise tests in a subprocess with the learner's
functions swapped in (`runner`, `patching`, `pytest_plugin`). `exercises/README.md` is the
guide for learners and authors; DESIGN.md §5 is the design.
"""

from __future__ import annotations

from pathlib import Path

# The repository checkout that holds exercises/ and tests/exercises/. It is found relative to
# this package, which works both in a checkout and in an editable install (`pip install -e .`),
# whose `minivllm` package *is* the checkout's folder. A regular (non-editable) install has no
# exercises: `exercises_root()` says so.
REPO_ROOT = Path(__file__).resolve().parents[2]


def exercises_root() -> Path:
    """The repository root, checked to hold the exercise skeletons and tests."""
    if not (REPO_ROOT / "exercises").is_dir() or not (REPO_ROOT / "tests" / "exercises").is_dir():
        raise FileNotFoundError(
            f"no exercises/ and tests/exercises/ next to the minivllm package (looked in {REPO_ROOT}); "
            "the exercises need a source checkout: git clone the repository and `pip install -e .`"
        )
    return REPO_ROOT
