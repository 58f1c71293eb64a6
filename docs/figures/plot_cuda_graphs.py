"""Plot chapter 05's measurements: docs/figures/cuda-graphs-h200.png.

    python docs/figures/plot_cuda_graphs.py   # reads docs/data/executor-h200-*.json

Nothing is typed in by hand: every point comes from the JSON that `scripts/gpu/executor.sh`
gathered from `minivllm bench latency` and `minivllm bench throughput` on the GPU. Two panels:

- one decode step of the engine against the batch size, eager and with CUDA graphs, beside
  the weights-read floor (weights plus the batch's K/V over the copy bandwidth);
- offline throughput on the nano-vllm workload: minivllm with CUDA graphs, eagerly, and HF
  transformers, against the physical bound of the same work.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
DATA = DOCS / "data" / "executor-h200-2026-12-03.json"
OUT = DOCS / "figures" / "cuda-graphs-h200.png"

MINIVLLM = "#3f51b5"  # the site's indigo
EAGER = "#9e9e9e"
HF = "#616161"
FLOOR = "#c62828"


def plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for shape, style in [("qwen3-0.6b", "-"), ("llama-3.2-1b", "--")]:
        graphs = data.get(f"latency-{shape}-graphs")
        eager = data.get(f"latency-{shape}-eager")  # a series the run did not reach is left out
        if graphs:
            xs = [p["batch_size"] for p in graphs["points"]]
            left.plot(xs, [p["decode_step_ms"] for p in graphs["points"]], style, marker="o", color=MINIVLLM,
                      label=f"{shape}, CUDA graphs")
            left.plot(xs, [p["floor_ms"] for p in graphs["points"]], style, color=FLOOR, linewidth=1, label=f"{shape}, floor")
        if eager:
            left.plot([p["batch_size"] for p in eager["points"]], [p["decode_step_ms"] for p in eager["points"]], style,
                      marker="s", color=EAGER, label=f"{shape}, eager")
    left.set_xscale("log", base=2)
    left.set_yscale("log")
    left.set_xlabel("decode batch size (requests)")
    left.set_ylabel("one engine step (ms)")
    left.set_title("Decode step: eager vs CUDA graphs")
    left.legend(fontsize=7)
    left.grid(True, which="both", alpha=0.3)

    labels, values, colors, bounds = [], [], [], []
    for shape, short in [("qwen3", "Qwen3-0.6B"), ("llama", "Llama-3.2-1B")]:
        graphs = data.get(f"throughput-{shape}-graphs")
        for name, color, label in [("graphs", MINIVLLM, "minivllm"), ("eager", EAGER, "minivllm eager"), ("hf", HF, "HF generate")]:
            run = data.get(f"throughput-{shape}-{name}")
            if run:
                labels.append(f"{short}\n{label}")
                values.append(run["output_tokens_per_s"])
                colors.append(color)
                bounds.append(graphs.get("bound_output_tokens_per_s") if graphs else None)
    bars = right.bar(range(len(values)), values, color=colors)
    for bar, value in zip(bars, values):
        right.text(bar.get_x() + bar.get_width() / 2, value, f"{value:,.0f}", ha="center", va="bottom", fontsize=7)
    for i, bound in enumerate(bounds):
        if bound:
            right.hlines(bound, i - 0.4, i + 0.4, color=FLOOR, linewidth=1.5)
    right.set_xticks(range(len(labels)), labels, fontsize=7)
    right.set_ylabel("output tokens/s")
    right.set_title("Offline throughput, nano-vllm workload (red: bound)")
    right.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=130)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    plot(json.loads(args.data.read_text()), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
