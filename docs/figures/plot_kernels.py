"""Plot chapter 06's kernel measurements: docs/figures/kernels-h200.png.

    python docs/figures/plot_kernels.py      # reads docs/data/, writes docs/figures/kernels-h200.png

Nothing is typed in by hand: every bar comes from the JSON that `minivllm bench kernels --json`
and `minivllm bench throughput` wrote on the GPU (docs/data/). Three panels:

- memory-bound kernels in GB/s, against the copy bandwidth measured in the same run;
- prefill attention in TFLOP/s, against the bf16 GEMM rate measured in the same run;
- end-to-end output tokens/s with the torch and the Triton attention backend.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
KERNELS_JSON = DOCS / "data" / "kernels-h200-2026-12-03.json"
THROUGHPUT_JSONS = {
    "torch backend": DOCS / "data" / "throughput-torch-h200-2026-12-02.json",
    "Triton backend": DOCS / "data" / "throughput-triton-h200-2026-12-02.json",
}
OUT = DOCS / "figures" / "kernels-h200.png"

# Known errors in recorded files, corrected here rather than by editing measured data.
# minivllm.bench.kernels at a277a57 counted 5 tensors of traffic for fused add + RMSNorm; it
# moves 4 (reads x and residual, writes out and the new residual), so GB/s was 5/4 too high.
CORRECTIONS = {"kernels-h200-2026-12-02.json": {"fused_add_rms_norm": 4 / 5}}

MINIVLLM = "#3f51b5"  # the site's indigo
CEILING = "#c62828"
COLORS = {  # minivllm in colour, everything it is measured against in greys
    "minivllm": MINIVLLM,
    "SDPA, contiguous K/V": "#bdbdbd",
    "gather + SDPA (torch backend)": "#616161",
    "torch.compile": "#9e9e9e",
    "SDPA flash": "#9e9e9e",
    "cuDNN": "#616161",
}


def load_kernels(path: Path = KERNELS_JSON) -> dict:
    data = json.loads(path.read_text(encoding="utf-8"))
    for entry in data["elementwise"]:
        entry["GBps"] *= CORRECTIONS.get(path.name, {}).get(entry["kernel"], 1.0)
    return data


def memory_bound_bars(data: dict) -> list[tuple[str, list[tuple[str, float]]]]:
    """[(group label, [(implementation, GB/s), ...]), ...], minivllm first in each group."""
    d = data["decode"]
    groups = [("paged decode\nattention", [("minivllm", d["GBps"]), ("SDPA, contiguous K/V", d["sdpa_contiguous_GBps"]),
                                            ("gather + SDPA (torch backend)", d["torch_gather_sdpa_GBps"])])]
    names = {"fused_add_rms_norm": "add + RMSNorm", "silu_and_mul": "SiLU-and-mul", "rotary_embedding": "RoPE"}
    for kernel, label in names.items():
        rows = {e["impl"]: e["GBps"] for e in data["elementwise"] if e["kernel"] == kernel}
        groups.append((label, [("minivllm", rows["triton"]), ("torch.compile", rows["torch.compile"])]))
    return groups


def _bars(ax, groups, width=0.26):
    """Grouped bars; returns the handles for a legend keyed by implementation name."""
    handles = {}
    for g, (_, bars) in enumerate(groups):
        offset = (len(bars) - 1) * width / 2
        for i, (impl, value) in enumerate(bars):
            bar = ax.bar(g - offset + i * width, value, width, color=COLORS[impl], edgecolor="white", linewidth=0.5)
            handles.setdefault(impl, bar)
            ax.annotate(f"{value:,.0f}", (g - offset + i * width, value), ha="center", va="bottom",
                        fontsize=6.5, xytext=(0, 1.5), textcoords="offset points")
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], fontsize=7.5)
    ax.tick_params(axis="y", labelsize=7.5)
    ax.spines[["top", "right"]].set_visible(False)
    return handles


def plot(data: dict, throughput: dict[str, dict], out: Path = OUT, when: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_pre, ax_e2e) = plt.subplots(
        1, 3, figsize=(11.5, 3.6), gridspec_kw={"width_ratios": [4.2, 2.6, 1.2]}, layout="constrained"
    )
    copy, gemm = data["copy_GBps"], data["bf16_gemm_TFLOPs"]

    handles = _bars(ax_mem, memory_bound_bars(data))
    ax_mem.axhline(copy, color=CEILING, linestyle="--", linewidth=1)
    ax_mem.text(len(memory_bound_bars(data)) - 0.5, copy, f"copy ceiling {copy:,.0f} GB/s", color=CEILING,
                ha="right", va="bottom", fontsize=7)
    ax_mem.set_ylim(0, copy * 1.32)
    ax_mem.set_ylabel("GB/s (bytes that must move / time)", fontsize=8)
    ax_mem.set_title("memory-bound kernels", fontsize=9)
    ax_mem.legend(handles.values(), handles.keys(), fontsize=6.5, frameon=False, loc="upper left", ncol=3)

    prefill = [(f"{int(p['shape'].split()[0][1:]) // 1024}k tokens",
                [("minivllm", p["TFLOPs"]), ("SDPA flash", p["sdpa_flash_TFLOPs"]), ("cuDNN", p["sdpa_cudnn_TFLOPs"])])
               for p in data["prefill"]]
    handles = _bars(ax_pre, prefill)
    ax_pre.axhline(gemm, color=CEILING, linestyle="--", linewidth=1)
    ax_pre.text(len(prefill) - 0.5, gemm, f"bf16 GEMM {gemm:,.0f} TFLOP/s", color=CEILING, ha="right", va="bottom", fontsize=7)
    ax_pre.set_ylim(0, gemm * 1.3)
    ax_pre.set_ylabel("TFLOP/s (causal)", fontsize=8)
    ax_pre.set_title("prefill attention, 32/8 heads, d 128", fontsize=9)
    ax_pre.legend(handles.values(), handles.keys(), fontsize=6.5, frameon=False, loc="upper left", ncol=3)

    names = list(throughput)
    values = [throughput[n]["output_tokens_per_s"] for n in names]
    bars = ax_e2e.bar(range(len(names)), values, 0.6, color=[COLORS["gather + SDPA (torch backend)"] if "torch" in n else MINIVLLM for n in names])
    for bar, value in zip(bars, values):
        ax_e2e.annotate(f"{value:,.0f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom",
                        fontsize=6.5, xytext=(0, 1.5), textcoords="offset points")
    ax_e2e.set_xticks(range(len(names)), [n.replace(" ", "\n") for n in names], fontsize=7.5)
    ax_e2e.tick_params(axis="y", labelsize=7.5)
    ax_e2e.spines[["top", "right"]].set_visible(False)
    ax_e2e.set_ylim(0, max(values) * 1.15)
    ax_e2e.set_ylabel("output tokens/s", fontsize=8)
    measured = THROUGHPUT_JSONS[names[0]].stem.split("-", 3)[-1]  # the date in the file name
    ax_e2e.set_title(f"end to end, {throughput[names[0]]['model']}\nmeasured {measured}", fontsize=9)

    fig.suptitle(f"{data['device']}, bf16, torch {data['torch']}, triton {data['triton']}{when}", fontsize=8, color="#424242")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    throughput = {name: json.loads(path.read_text(encoding="utf-8")) for name, path in THROUGHPUT_JSONS.items()}
    when = ", measured " + KERNELS_JSON.stem.split("-", 2)[-1]  # the date in the file name
    print(f"wrote {plot(load_kernels(), throughput, args.out, when)}")


if __name__ == "__main__":
    main()
