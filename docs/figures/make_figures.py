"""Make the figures of chapters 03 and 04 from real runs of the demo model.

    python docs/figures/make_figures.py          # writes docs/figures/*.png

Nothing here is drawn by hand. Each figure comes from driving `LLM().llm_engine.step()`
ourselves and recording, after every step, what the scheduler decided: how many tokens each
request computed and of which kind (prefill, decode, recompute after a preemption), how many
KV blocks each request held while the step ran, and who was preempted. `collect_steps` does
the recording and is what `tests/test_figures.py` runs on a tiny random model, so the script
keeps working as the engine changes. The runs are greedy with `ignore_eos`, so every request
generates exactly `max_tokens` tokens and the figures do not depend on what the model says.

- `scheduler_timeline.png` (chapter 03): continuous batching and chunked prefill under a
  32-token budget, with requests joining mid-run.
- `kv_blocks.png` (chapter 04): KV blocks in use per step in a 24-block cache, with
  preemptions and recomputes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FIGURES_DIR = Path(__file__).resolve().parent


# -- recording ---------------------------------------------------------------------------------


@dataclass
class Arrival:
    """A request to add just before engine step `step` (1 = before the first step).

    When the engine runs out of work before `step`, the request is added at once instead.
    """

    step: int
    request_id: str
    prompt: str | dict[str, Any]  # text, or {"prompt_token_ids": [...]}
    max_tokens: int


@dataclass
class RequestStep:
    """What one request did in one step."""

    request_id: str
    kind: str  # "prefill" | "decode" | "recompute"
    start: int  # tokens with K/V in the cache before the step
    num_tokens: int  # tokens computed in the step
    num_blocks: int  # KV blocks the request held while the step ran
    finished: bool  # the request finished in this step


@dataclass
class StepRecord:
    step: int
    scheduled: list[RequestStep]
    preempted: list[str]  # preempted in this step, to make room for the others
    waiting: list[str]  # arrived, but neither scheduled nor finished: in the waiting queue
    idle: list[str]  # running, holding blocks, but given no tokens (the budget ran out)
    blocks_by_request: dict[str, int]  # every request holding blocks during the step
    token_budget: int
    num_blocks_total: int
    block_size: int

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_tokens for r in self.scheduled)

    @property
    def blocks_in_use(self) -> int:
        return sum(self.blocks_by_request.values())


def collect_steps(llm: Any, arrivals: list[Arrival], temperature: float = 0.0) -> list[StepRecord]:
    """Run `arrivals` through `llm` one engine step at a time; return one record per step."""
    from minivllm import SamplingParams

    engine = llm.llm_engine
    core = engine.engine_core
    scheduler = core.scheduler
    manager = scheduler.kv_cache_manager
    block_size = manager.block_size
    pending = sorted(arrivals, key=lambda a: a.step)
    prompt_len: dict[str, int] = {}
    recompute_until: dict[str, int] = {}  # a preempted request's tokens, to compute again
    arrived: list[str] = []
    done: set[str] = set()
    records: list[StepRecord] = []
    while pending or engine.has_unfinished_requests():
        step = len(records) + 1
        # An engine with nothing to do does not step: the next arrival comes at once.
        while pending and (pending[0].step <= step or not engine.has_unfinished_requests()):
            a = pending.pop(0)
            params = SamplingParams(temperature=temperature, max_tokens=a.max_tokens, ignore_eos=True)
            engine.add_request(a.request_id, a.prompt, params)
            prompt_len[a.request_id] = scheduler.requests[a.request_id].num_prompt_tokens
            arrived.append(a.request_id)
        finished = {out.request_id for out in engine.step() if out.finished}
        so = core.last_scheduler_output
        start_of = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        start_of.update({r.req_id: r.num_computed_tokens for r in so.scheduled_cached_reqs})
        scheduled = []
        for req_id, n in so.num_scheduled_tokens.items():
            start = start_of[req_id]
            if start < recompute_until.get(req_id, 0):
                kind = "recompute"
            elif start >= prompt_len[req_id]:
                kind = "decode"
            else:
                kind = "prefill"
            # Blocks are freed when a request finishes, so count a finished request's from its
            # tokens: the manager gave it exactly cdiv(start + n, block_size) for this step.
            held = len(manager.get_block_ids(req_id)) if req_id not in finished else -(-(start + n) // block_size)
            scheduled.append(RequestStep(req_id, kind, start, n, held, req_id in finished))
        for req_id in so.preempted_req_ids:
            recompute_until[req_id] = scheduler.requests[req_id].num_tokens
        done |= finished
        blocks = {r.request_id: r.num_blocks for r in scheduled}
        idle = [r.request_id for r in scheduler.running if r.request_id not in so.num_scheduled_tokens]
        blocks.update({req_id: len(manager.get_block_ids(req_id)) for req_id in idle})
        records.append(
            StepRecord(
                step=step,
                scheduled=scheduled,
                preempted=sorted(so.preempted_req_ids),
                waiting=[r for r in arrived if r not in done and r not in blocks],
                idle=idle,
                blocks_by_request=blocks,
                token_budget=llm.llm_engine.config.scheduler_config.max_num_batched_tokens,
                num_blocks_total=manager.block_pool.num_blocks,
                block_size=block_size,
            )
        )
    return records


# -- the workloads -----------------------------------------------------------------------------

LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, "
    "a goldsmith from Mainz, combined movable metal type, oil-based ink and a wooden press adapted "
    "from wine making into one system that"
)

# Chapter 03: five requests of different sizes; D (long) and E arrive while others decode.
TIMELINE_ARRIVALS = [
    Arrival(1, "A", LONG_PROMPT, max_tokens=8),
    Arrival(1, "B", "Dear diary, today I learned how a paged KV cache works. The most surprising part was that", max_tokens=12),
    Arrival(1, "C", "The three primary colours are red, yellow and", max_tokens=6),
    Arrival(5, "D", "Continuous batching, the idea behind the Orca paper, rebuilds the batch at every step of the "
                    "engine: a request that finishes leaves at once, and a waiting request takes its seat, so", max_tokens=8),
    Arrival(8, "E", "Two plus two is", max_tokens=7),
]
TIMELINE_ENGINE_ARGS = dict(max_model_len=256, max_num_batched_tokens=32)

# Chapter 04: four requests that together outgrow a cache of 24 blocks of 4 tokens.
KV_ARRIVALS = [
    Arrival(1, "A", "Write a short story about a lighthouse keeper who finds a message in a bottle.", max_tokens=40),
    Arrival(1, "B", "Explain in simple words why the sky is blue during the day and red at sunset.", max_tokens=40),
    Arrival(1, "C", "List five things to pack for a weekend hiking trip in the mountains.", max_tokens=30),
    Arrival(1, "D", "Describe the rules of chess to someone who has never played.", max_tokens=30),
]
KV_ENGINE_ARGS = dict(max_model_len=96, block_size=4, num_gpu_blocks_override=24)


# -- plotting ----------------------------------------------------------------------------------

KIND_COLORS = {"prefill": "#4C72B0", "decode": "#DD8452", "recompute": "#C44E52"}
KIND_LABELS = {"prefill": "prefill (a prompt or a chunk of it)", "decode": "decode (1 token)", "recompute": "recompute after preemption"}
REQUEST_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#8172B3", "#937860", "#DA8BC3"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt

    return plt


def _caption(fig, text: str) -> None:
    import textwrap

    fig.text(0.01, 0.01, textwrap.fill(text, 170), fontsize=7, color="#555555", ha="left", va="bottom")


def _draw_request_rows(ax, records: list[StepRecord]) -> None:
    """One row per request, one cell per step, colored by what the request did in it."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    request_ids = sorted({r.request_id for rec in records for r in rec.scheduled} | {w for rec in records for w in rec.waiting})
    row = {req_id: i for i, req_id in enumerate(request_ids)}
    label_prompt_tokens = len(records) <= 40  # numbers only fit in wide cells
    for rec in records:
        for req_id in rec.waiting:
            ax.barh(row[req_id], 1, left=rec.step - 0.5, color="#E5E5E5", height=0.7)
        for req_id in rec.idle:
            ax.barh(row[req_id], 1, left=rec.step - 0.5, color="white", edgecolor="#999999", hatch="///", height=0.7)
        for r in rec.scheduled:
            ax.barh(row[r.request_id], 1, left=rec.step - 0.5, color=KIND_COLORS[r.kind], edgecolor="white", linewidth=0.5, height=0.7)
            if r.kind != "decode" and label_prompt_tokens:
                ax.text(rec.step, row[r.request_id], str(r.num_tokens), ha="center", va="center", fontsize=7, color="white")
            if r.finished:
                ax.plot(rec.step + 0.5, row[r.request_id], marker="|", color="black", markersize=13, markeredgewidth=1.5)
        for req_id in rec.preempted:
            ax.plot(rec.step, row[req_id], marker="x", color=KIND_COLORS["recompute"], markersize=8, markeredgewidth=2)
    ax.set_yticks(range(len(request_ids)), [f"request {r}" for r in request_ids])
    ax.set_ylim(len(request_ids) - 0.5, -0.5)
    kinds = {r.kind for rec in records for r in rec.scheduled}
    handles = [Patch(color=KIND_COLORS[k], label=KIND_LABELS[k]) for k in KIND_COLORS if k in kinds]
    handles.append(Patch(color="#E5E5E5", label="waiting"))
    if any(rec.idle for rec in records):
        handles.append(Patch(facecolor="white", edgecolor="#999999", hatch="///", label="running, but no budget left"))
    if any(rec.preempted for rec in records):
        handles.append(Line2D([], [], marker="x", color=KIND_COLORS["recompute"], linestyle="", markeredgewidth=2, label="preempted"))
    handles.append(Line2D([], [], marker="|", color="black", linestyle="", markersize=11, markeredgewidth=1.5, label="finished"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def plot_scheduler_timeline(records: list[StepRecord], path: Path, caption: str, show_tokens: bool = True) -> None:
    """Which request did what in each step; below it, the step's tokens against the budget."""
    plt = _pyplot()
    steps = [rec.step for rec in records]
    if show_tokens:
        fig, (top, bottom) = plt.subplots(
            2, 1, figsize=(10, 5.8), sharex=True, gridspec_kw={"height_ratios": [1.15, 1]}, layout="constrained"
        )
    else:
        fig, top = plt.subplots(figsize=(10, 2.9), layout="constrained")
    _draw_request_rows(top, records)
    top.set_title("What each request did in each step" + (" (numbers: tokens computed)" if len(records) <= 40 else ""), fontsize=10)
    top.set_xlim(steps[0] - 0.5, steps[-1] + 0.8)  # room for the last "finished" mark
    if show_tokens:
        order = list(KIND_COLORS)
        for kind in order:
            below = [sum(r.num_tokens for r in rec.scheduled if order.index(r.kind) < order.index(kind)) for rec in records]
            heights = [sum(r.num_tokens for r in rec.scheduled if r.kind == kind) for rec in records]
            if any(heights):
                bottom.bar(steps, heights, bottom=below, color=KIND_COLORS[kind], width=0.8, label=f"{kind} tokens")
        budget = records[0].token_budget
        bottom.axhline(budget, color="black", linestyle="--", linewidth=1, label=f"token budget ({budget})")
        bottom.set_ylim(0, budget * 1.12)
        bottom.set_ylabel("tokens in the step")
        bottom.set_title("Tokens computed per step, against max_num_batched_tokens", fontsize=10)
        bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        bottom.set_xticks(steps)
        bottom.set_xlabel("engine step")
    else:
        top.set_xlabel("engine step")
    _caption(fig, caption)
    fig.get_layout_engine().set(rect=(0, 0.06 if show_tokens else 0.1, 1, 0.94 if show_tokens else 0.9))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_kv_blocks(records: list[StepRecord], path: Path, caption: str) -> None:
    """Blocks each request held in each step, stacked, under the size of the cache."""
    plt = _pyplot()
    request_ids = sorted({r for rec in records for r in rec.blocks_by_request} | {w for rec in records for w in rec.waiting})
    steps = [rec.step for rec in records]
    fig, ax = plt.subplots(figsize=(10, 4.6), layout="constrained")
    layers = [[rec.blocks_by_request.get(req_id, 0) for rec in records] for req_id in request_ids]
    colors = [REQUEST_COLORS[i % len(REQUEST_COLORS)] for i in range(len(request_ids))]
    ax.stackplot(steps, layers, labels=[f"request {r}" for r in request_ids], colors=colors, step="mid", alpha=0.85)
    total = records[0].num_blocks_total
    ax.axhline(total, color="black", linestyle="--", linewidth=1, label=f"cache size ({total} blocks)")
    labels = 0  # labels take turns on three heights above the cache line, so they do not overlap
    for rec in records:
        resumed = [r for r in rec.scheduled if r.kind == "recompute" and r.start == 0]
        if rec.preempted:
            ax.axvline(rec.step - 0.5, color=KIND_COLORS["recompute"], linewidth=1, linestyle=":")
            text = f"{', '.join(rec.preempted)} preempted"
        elif resumed:
            text = " and ".join(r.request_id for r in resumed) + " recomputed (" + " + ".join(str(r.num_tokens) for r in resumed) + " tokens)"
        else:
            continue
        height = total + 0.6 + 2.2 * (labels % 3)
        ax.annotate(text, (rec.step - 0.5 if rec.preempted else rec.step, rec.blocks_in_use if resumed else total),
                    xytext=(rec.step - 0.5, height), fontsize=8, color=KIND_COLORS["recompute"], ha="left", va="bottom",
                    arrowprops=dict(arrowstyle="-", color=KIND_COLORS["recompute"], linewidth=0.8))
        labels += 1
    ax.set_ylim(0, total + 8)
    ax.set_xlim(steps[0] - 0.5, steps[-1] + 0.5)
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV blocks held during the step")
    ax.set_title(f"KV blocks held per request, in a cache of {total} blocks of {records[0].block_size} tokens", fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    _caption(fig, caption)
    fig.get_layout_engine().set(rect=(0, 0.06, 1, 0.94))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_summary(name: str, records: list[StepRecord]) -> None:
    """One line per step, like `minivllm run --trace`, so the figure can be checked by eye."""
    print(f"\n{name}: {len(records)} steps")
    for rec in records:
        work = ", ".join(f"{r.request_id}:{r.kind}{r.num_tokens}{'✓' if r.finished else ''}" for r in rec.scheduled)
        extra = f"  preempted {rec.preempted}" if rec.preempted else ""
        print(f"  {rec.step:>3} tokens {rec.num_scheduled_tokens:>3} blocks {rec.blocks_in_use:>3}  {work}{extra}  waiting {rec.waiting}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=FIGURES_DIR, help="folder for the PNGs")
    parser.add_argument("--model", default=None, help="a model folder; default: the demo model")
    args = parser.parse_args(argv)
    from minivllm import LLM

    written = []
    llm = LLM(args.model, **TIMELINE_ENGINE_ARGS)
    records = collect_steps(llm, TIMELINE_ARRIVALS)
    print_summary("scheduler timeline", records)
    written.append(args.out / "scheduler_timeline.png")
    plot_scheduler_timeline(
        records, written[-1],
        "docs/figures/make_figures.py: SmolLM2-135M-Instruct (the demo model) on the CPU, "
        "LLM(max_model_len=256, max_num_batched_tokens=32); greedy, ignore_eos. "
        "A, B and C arrive before step 1, D before step 5, E before step 8.",
    )
    llm = LLM(args.model, **KV_ENGINE_ARGS)
    records = collect_steps(llm, KV_ARRIVALS)
    print_summary("KV blocks", records)
    caption = (
        "docs/figures/make_figures.py: SmolLM2-135M-Instruct (the demo model) on the CPU, "
        "LLM(max_model_len=96, block_size=4, num_gpu_blocks_override=24); greedy, ignore_eos. "
        "Four requests arrive before step 1."
    )
    written.append(args.out / "kv_blocks.png")
    plot_kv_blocks(records, written[-1], caption)
    written.append(args.out / "preemption_timeline.png")
    plot_scheduler_timeline(records, written[-1], caption, show_tokens=False)
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
