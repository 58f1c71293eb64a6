"""Qwen3-0.6B's batch-1 decode step against its floor, run by run: docs/figures/batch1-progress.png.

    python docs/figures/plot_batch1_progress.py

Chapter 05's batch-1 work, from the JSON each run wrote (nothing typed in by hand): the whole
engine step over the weights-read floor measured in the same run, on the H200 (left) and on
the H100s that later runs found (right), beside the target of 2.5×. The last two bars on the
H200 are not runs there: the step with every layer's weights already in L2 of "What 2.5× on the
H200 would take", first as the estimate `budget()` puts together from four measured runs, then
with the layers as measured that way on an H100 (`engine_variants.py shared-weights`, in
`removal-bounds-h100-2026-12-07.json`) and the H200's own LM head and work outside the replay.
`tests/test_batch1_budget.py` checks the chapter's numbers against `budget()`.
"""

from __future__ import annotations

import json
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1]
DATA = DOCS / "data"
OUT = DOCS / "figures" / "batch1-progress.png"
TARGET = 2.5  # step / floor, the target for the batch-1 decode step

# (label, data file, path to a `bench latency` result inside it); batch 1 is its first point.
H200_RUNS = [
    ("first run\n(e0f3a52)", "executor-h200-2026-12-03.json", "latency-qwen3-0.6b-graphs"),
    ("warm-up,\nhost fixes", "executor-h200-2026-12-03-warm-up.json", "latency-qwen3-0.6b-graphs"),
    ("async\nscheduling", "executor-h200-2026-12-03-async.json", "run1/latency-qwen3-0.6b-async"),
    ("fused\nkernels", "executor-h200-2026-12-03-fused.json", "latency-qwen3-0.6b-async"),
    ("piecewise\ngraphs", "piecewise-h200-2026-12-03.json", "offline_async_7c5b525/latency-qwen3-0.6b-async"),
    ("skinny GEMM,\nfrozen heap", "gc-freeze-h200-2026-12-03.json", "results/latency-qwen3-0.6b-default"),
    ("PDL, merge\nin kernel,\nK/V by RoPE", "pdl-h200-2026-12-04.json", "results_3640e39/latency-qwen3-0.6b-default"),
    ("SiLU in down,\n1-2 token tile", "chain-fusion-h200-2026-12-04.json", "run4_8436476/latency/latency-qwen3-0.6b-default"),
    ("splits by\ncontext\n(e573387)", "decode-split-h200-2026-12-04.json", "run_e573387/latency_default/qwen3-0.6b"),
]
H100_RUNS = [
    ("74898a1", "executor-h100-2026-12-06.json", "runs/lat-qwen"),
    ("577dd0b\n(same engine\ncode)", "executor-h100-2026-12-07.json", "runs/latency_qwen3"),
    ("35f9062\n(same engine\ncode)", "executor-h100-2026-12-07-b.json", "latency_qwen3_0.6b"),
    ("skinny GEMM\nfor every\none-token\nproduct", "skinny-one-token-h100-2026-12-07.json",
     "latency/latency-qwen3-0.6b-skinny-few=1-1"),
    ("2fdb400\n(adopted)", "skinny-one-token-h100-2026-12-07.json", "later_call_2fdb400/latency/latency-qwen3-0.6b-after-1"),
    ("1cd2131", "removal-bounds-h100-2026-12-07.json", "removal_bounds/default"),
    # The median of the three runs with the norm inside qkv and gate_up (0.994, 0.995, 1.011 ms).
    ("norm inside\nqkv, gate_up\n(3b11319,\nadopted)", "norm-in-product-h100-2026-12-08.json",
     "second_call_qwen3/latency-qwen3-0.6b-norm-in-product=1-2"),
]
# The removal bounds of `executor.sh PARTS=removal-bounds` (an H100, `1cd2131`): the engine as it is
# and with every layer's weights in L2 (`engine_variants.py shared-weights`).
REMOVAL_BOUNDS = "removal-bounds-h100-2026-12-07.json"
QWEN3_LAYERS = 28
QWEN3_LM_HEAD_BYTES = 151_936 * 1024 * 2  # vocabulary × hidden size × bf16 (shapes.py's qwen3-0.6b)


def latency_result(file: str, path: str) -> dict:
    result = json.loads((DATA / file).read_text())
    for key in path.split("/"):
        result = result[key]
    return result


def batch1(file: str, path: str) -> dict:
    return latency_result(file, path)["points"][0]


def budget() -> dict[str, float]:
    """The H200 budget of chapter 05's "What 2.5× on the H200 would take", in µs.

    The target and the LM head from the H200 run at `e573387`; the GPU's work outside the
    replay from an H100 timeline of the step (every activity once a step but the LM head, the
    largest of them); a layer with every weight in L2 from chapter 06's chain of layers without
    attention, plus what the engine's layer costs beyond that chain in the same run; less what
    the skinny GEMM on gate_up later took off each layer (H100 replays).

    Then the ceiling as measured (`*_measured`): an H100's replay with every layer on layer 0's
    weights, over 28 layers, with the H200's LM head and work outside the replay as above; and
    the same read from the H200's own layer, less the DRAM share the H100 run measured scaled
    to the H200's bandwidth (`*_from_h200`).
    """
    h200 = latency_result("decode-split-h200-2026-12-04.json", "run_e573387/latency_default/qwen3-0.6b")
    floor_us = h200["points"][0]["floor_ms"] * 1e3
    target_us = TARGET * floor_us
    lm_head_us = QWEN3_LM_HEAD_BYTES / (h200["copy_GBps"] * 1e3)
    once_a_step = [row["us_per_step"] for row in
                   json.loads((DATA / "step-inputs-h100-2026-12-07.json").read_text())["timeline"]["after"]["rows"]
                   if row["per_step"] == 1]
    outside_us = sum(once_a_step) - max(once_a_step)
    replay_budget_us = target_us - lm_head_us - outside_us

    l2 = json.loads((DATA / "l2-prefetch-h100-2026-12-05.json").read_text())
    chain = l2["layers_us_per_layer"]["qwen3-0.6b"]
    engine_layer_us = l2["engine"]["qwen3-0.6b_batch1_replay_ms"]["off"] * 1e3 / QWEN3_LAYERS
    beyond_chain_us = engine_layer_us - chain["no prefetch"]
    chain_saving_us = chain["no prefetch"] - chain["shared weights (in L2)"]
    skinny = "latency/latency-qwen3-0.6b-"
    gate_up_saving_us = (batch1("skinny-one-token-h100-2026-12-07.json", skinny + "default-1")["graph_replay_ms"]
                         - batch1("skinny-one-token-h100-2026-12-07.json", skinny + "skinny-few=1-1")["graph_replay_ms"]
                         ) * 1e3 / QWEN3_LAYERS
    l2_layer_us = chain["shared weights (in L2)"] + beyond_chain_us - gate_up_saving_us
    l2_step_us = QWEN3_LAYERS * l2_layer_us + lm_head_us + outside_us

    # The ceiling measured: on an H100, every decoder layer on layer 0's weights (resident in
    # L2), against the engine as it is in the same run. The replay is the forward pass alone
    # (embedding, 28 layers, final norm); the LM head runs after it, outside the graph.
    bounds = json.loads((DATA / REMOVAL_BOUNDS).read_text())["removal_bounds"]
    shared, default = bounds["shared-weights"], bounds["default"]
    shared_replay_us = shared["points"][0]["graph_replay_ms"] * 1e3
    default_replay_us = default["points"][0]["graph_replay_ms"] * 1e3
    l2_layer_measured_us = shared_replay_us / QWEN3_LAYERS
    l2_saving_us = (default_replay_us - shared_replay_us) / QWEN3_LAYERS  # DRAM's share of an H100 layer
    l2_step_measured_us = QWEN3_LAYERS * l2_layer_measured_us + lm_head_us + outside_us
    # Read the other way: the H200's own layer (`e573387`) less the H100's DRAM share at the H200's bandwidth.
    h200_dram_us = l2_saving_us * default["copy_GBps"] / h200["copy_GBps"]
    h200_layer_us = h200["points"][0]["graph_replay_ms"] * 1e3 / QWEN3_LAYERS
    l2_layer_from_h200_us = h200_layer_us - h200_dram_us
    l2_step_from_h200_us = QWEN3_LAYERS * l2_layer_from_h200_us + lm_head_us + outside_us
    return {
        "floor": floor_us, "target": target_us, "lm_head": lm_head_us, "outside_replay": outside_us,
        "replay_budget": replay_budget_us, "layer_budget": replay_budget_us / QWEN3_LAYERS,
        "replay_measured": h200["points"][0]["graph_replay_ms"] * 1e3,
        "beyond_chain": beyond_chain_us, "gate_up_saving": gate_up_saving_us, "l2_saving_chain": chain_saving_us,
        "l2_estimate_layer_as_is": engine_layer_us - gate_up_saving_us,
        "l2_layer": l2_layer_us, "l2_step": l2_step_us, "l2_step_over_floor": l2_step_us / floor_us,
        "h100_replay_default": default_replay_us, "h100_replay_shared": shared_replay_us,
        "h100_layer_default": default_replay_us / QWEN3_LAYERS, "l2_saving_measured": l2_saving_us,
        "l2_layer_measured": l2_layer_measured_us, "l2_step_measured": l2_step_measured_us,
        "l2_step_measured_over_floor": l2_step_measured_us / floor_us,
        "h200_dram_measured": h200_dram_us, "h200_layer_predicted": l2_layer_measured_us + h200_dram_us,
        "l2_layer_from_h200": l2_layer_from_h200_us, "l2_step_from_h200": l2_step_from_h200_us,
        "l2_step_from_h200_over_floor": l2_step_from_h200_us / floor_us,
    }


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    estimate = budget()
    fig, axes = plt.subplots(1, 2, figsize=(16, 4.8), sharey=True,
                             gridspec_kw={"width_ratios": [len(H200_RUNS) + 2, len(H100_RUNS)]})
    panels = [(axes[0], "NVIDIA H200", H200_RUNS, "#3f51b5"), (axes[1], "NVIDIA H100", H100_RUNS, "#00897b")]
    for ax, gpu, runs, color in panels:
        points = [batch1(file, path) for _, file, path in runs]
        ratios = [p["decode_step_ms"] / p["floor_ms"] for p in points]
        labels = [label for label, *_ in runs]
        colors = [color] * len(runs)
        hatches = [""] * len(runs)
        texts = [f"{p['decode_step_ms']:.3f} ms\n{r:.2f}×" for p, r in zip(points, ratios)]
        if gpu == "NVIDIA H200":
            # Not runs on the H200: the step with every layer's weights in L2, estimated from
            # parts, then with the layers measured that way on an H100 (the same GH100 chip).
            for key, label, hatch in [("l2_step", "estimate:\nevery weight\nin L2", "//"),
                                      ("l2_step_measured", "every weight\nin L2, layers\nmeasured on\nan H100", "xx")]:
                ratios.append(estimate[f"{key}_over_floor"])
                labels.append(label)
                colors.append("white")
                hatches.append(hatch)
                texts.append(f"{estimate[key] / 1e3:.3f} ms\n{estimate[f'{key}_over_floor']:.2f}×")
        bars = ax.bar(range(len(ratios)), ratios, color=colors, edgecolor=color, hatch=None)
        for bar, hatch, text in zip(bars, hatches, texts):
            bar.set_hatch(hatch)
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), text, ha="center", va="bottom", fontsize=7)
        ax.axhline(TARGET, color="#c62828", linewidth=1.2, linestyle="--", label="target: 2.5× the floor")
        ax.legend(loc="upper right", fontsize=8)
        ax.set_xticks(range(len(ratios)), labels, fontsize=7)
        ax.set_ylim(0, 8)
        if gpu == "NVIDIA H200":
            ax.set_ylabel("whole step / weights-read floor")
        floors = sorted(p["floor_ms"] for p in points)
        ax.set_title(f"Qwen3-0.6B, batch 1, CUDA graphs, {gpu} (floor {floors[0]:.3f}-{floors[-1]:.3f} ms)", fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=130)


if __name__ == "__main__":
    for name, value in budget().items():
        print(f"{name:>28}: {value:8.2f}")
    plot(OUT)
    print(f"wrote {OUT}")
