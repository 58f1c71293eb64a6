"""Benchmarks: `minivllm bench throughput | latency | serve`, and the chapters' own measurements."""

from __future__ import annotations

import json
from typing import Any


def report(result: dict[str, Any], json_path: str | None) -> None:
    """Print a benchmark's result as JSON, and write it to `json_path` when one was given."""
    print(json.dumps(result, indent=2, default=str))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, default=str)
