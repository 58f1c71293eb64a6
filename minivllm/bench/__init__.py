"""Benchmarks: `minivllm bench throughput | latency | serve`, and the chapters' own measurements."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any


def git_commit() -> str:
    """The commit a result was measured on: MINIVLLM_COMMIT (set by scripts run from a copy
    without .git), else the checkout this package lives in, else "unknown"."""
    if os.environ.get("MINIVLLM_COMMIT"):
        return os.environ["MINIVLLM_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=False)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def report(result: dict[str, Any], json_path: str | None) -> None:
    """Print a benchmark's result as JSON, and write it to `json_path` when one was given."""
    print(json.dumps(result, indent=2, default=str))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, default=str)
