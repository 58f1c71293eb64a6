"""Plot what each engine change bought on the H200: docs/figures/throughput-progress-h200.png.

    python docs/figures/plot_throughput_progress.py

Chapter 05's offline throughput on the nano-vllm workload, for both shapes, from the JSON that
`scripts/gpu/executor.sh` wrote in each run (nothing typed in by hand): the first run, the run
after the kernel warm-up and host-side fixes, the run that compared synchronous steps with
async scheduling side by side, the run after fusing kernels (fewer launches per layer), and
the run with piecewise CUDA graphs for the prefill steps, and the run with the skinny GEMM and
the start-up heap frozen out of the garbage collector's sight (its second repetition), and
the run with the one-pass sampling kernel (its second run), and the runs at the commit of
the batch-1 work (programmatic dependent launch, fewer kernels a layer: the median of its
runs, three for Llama and one for Qwen3); HF
transformers' `generate` beside them, and the physical bound of the same work as a red line.
"""

from __future__ import annotations

import fnmatch
import json
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
DATA = DOCS / "data"
OUT = DOCS / "figures" / "throughput-progress-h200.png"

BARS = [  # (label, data file, run inside it or None, result name with {shape})
    ("first run", "executor-h200-2026-12-03.json", None, "throughput-{shape}-graphs"),
    ("kernel\nwarm-up,\nhost fixes", "executor-h200-2026-12-03-warm-up.json", None, "throughput-{shape}-graphs"),
    ("synchronous\nsteps", "executor-h200-2026-12-03-async.json", "run1|run2", "throughput-{shape}-graphs"),
    ("async\nscheduling", "executor-h200-2026-12-03-async.json", "run1", "throughput-{shape}-async"),
    ("fewer kernels\n(fused),\nasync", "executor-h200-2026-12-03-fused.json", None, "throughput-{shape}-async"),
    ("piecewise\ngraphs,\nasync", "piecewise-h200-2026-12-03.json", "offline_async_7c5b525", "throughput-{shape}-async"),
    ("frozen\nstart-up heap,\nasync", "gc-freeze-h200-2026-12-03.json", "results", "throughput-{full}-async-default"),
    ("one-pass\nsampler,\nasync", "sampler-h200-2026-12-04.json", "results_17f517a", "throughput-{full}-async-default"),
    ("PDL, fewer\nkernels,\nasync", "chain-fusion-h200-2026-12-04.json", "run2_51c24eb.throughput|run3_llama_ab.results",
     "throughput-{full}-async|throughput-{full}-async-new-*"),
    ("HF generate", "executor-h200-2026-12-03.json", None, "throughput-{shape}-hf"),
]
COLORS = ["#9fa8da", "#7986cb", "#5c6bc0", "#3f51b5", "#283593", "#1a237e", "#0d1257", "#060930", "#000000", "#616161"]
FULL_NAMES = {"qwen3": "qwen3-0.6b", "llama": "llama-3.2-1b"}  # how the later data files name the shapes
FLOOR = "#c62828"


def result(label_file: str, runs: str | None, name: str) -> dict | None:
    """The result `name` in the data file: at its top level, or in the first of `runs` that
    holds it. A name with `*` or `|` is a set of patterns (fnmatch) matched in every run of
    `runs` (a run may be a dotted path into the file), and the result is the median of the
    matches by output tokens/s (the lower middle one of an even count)."""
    data = json.loads((DATA / label_file).read_text())
    if runs is None:
        return data.get(name)
    groups = []
    for run in runs.split("|"):
        group = data
        for key in run.split("."):
            group = group.get(key, {})
        groups.append(group)
    if "*" not in name and "|" not in name:
        return next((group[name] for group in groups if name in group), None)  # the first run that holds it
    patterns = name.split("|")
    matches = [value for group in groups for key, value in group.items()
               if any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)]
    matches.sort(key=lambda r: r["output_tokens_per_s"])
    return matches[(len(matches) - 1) // 2] if matches else None


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(17, 4.8))
    for ax, (shape, title) in zip(axes, [("qwen3", "Qwen3-0.6B"), ("llama", "Llama-3.2-1B")]):
        values, bound = [], None
        for label, file, runs, name in BARS:
            run = result(file, runs, name.format(shape=shape, full=FULL_NAMES[shape]))
            values.append(run["output_tokens_per_s"] if run else 0.0)
            if run and run.get("bound_output_tokens_per_s") and "async" in label:  # the latest engine run's bound
                bound = run["bound_output_tokens_per_s"]
        bars = ax.bar(range(len(BARS)), values, color=COLORS)
        for bar, value in zip(bars, values):
            ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:,.0f}", ha="center", va="bottom", fontsize=7)
        if bound:
            ax.axhline(bound, color=FLOOR, linewidth=1.2)
            ax.axhline(bound / 2, color=FLOOR, linewidth=0.8, linestyle="--")
            ax.text(len(BARS) - 0.5, bound, f"bound {bound:,.0f}", color=FLOOR, ha="right", va="bottom", fontsize=7)
            ax.text(len(BARS) - 0.5, bound / 2, "half the bound", color=FLOOR, ha="right", va="bottom", fontsize=7)
        ax.set_xticks(range(len(BARS)), [label for label, *_ in BARS], fontsize=7)
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{title}: nano-vllm workload on the H200")
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=130)


if __name__ == "__main__":
    plot(OUT)
    print(f"wrote {OUT}")
