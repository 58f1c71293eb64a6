"""A learner's progress: the result of their last check of each chapter, in `progress.json`.

The file sits in the learner's exercise folder (default `./minivllm-exercises/`), beside their
chapter folders, so their work and their record travel together. Only checks of the learner's
own code (`--impl learner`) are recorded.

    {"chapters": {"03": {"checked_at": "2025-01-01T12:00:00", "exercises": {"ch03-preempt": "PASS", ...}}}}
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from minivllm.exercises.runner import CheckResult

PROGRESS_FILE = "progress.json"


def load(folder: Path) -> dict[str, dict]:
    """chapter -> {"checked_at": ..., "exercises": {id: status}}; empty when nothing was checked."""
    path = folder / PROGRESS_FILE
    if not path.exists():
        return {}
    return json.loads(path.read_text(encoding="utf-8")).get("chapters", {})


def record(folder: Path, result: CheckResult) -> None:
    chapters = load(folder)
    chapters[result.chapter] = {
        "checked_at": datetime.now().isoformat(timespec="seconds"),
        "exercises": {r.exercise.id: r.status for r in result.results},
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PROGRESS_FILE).write_text(json.dumps({"chapters": chapters}, indent=2) + "\n", encoding="utf-8")
