"""The figure script of chapters 03 and 04 still runs against the engine (not its pixels).

`docs/figures/make_figures.py` drives the engine one step at a time and records what the
scheduler did. Here its recorder runs on a tiny random-weight Llama under the same kind of
pressure as the real figures — a small token budget, a cache too small for every request,
and requests that arrive mid-run — and the records must agree with the engine's own counts.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from conftest import TEST_DEVICE
from hf_reference import TINY_CONFIGS, make_tiny_model
from minivllm import LLM

SCRIPT = Path(__file__).resolve().parent.parent / "docs" / "figures" / "make_figures.py"


@pytest.fixture(scope="module")
def make_figures():
    spec = importlib.util.spec_from_file_location("make_figures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_figures"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("make_figures", None)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def arrivals(make_figures, specs):
    """(arrival step, prompt length, max_tokens) → Arrivals with random token-id prompts."""
    rng = random.Random(7)
    vocab = TINY_CONFIGS["llama"]["vocab_size"]
    return [
        make_figures.Arrival(step, chr(ord("A") + i), {"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(n)]}, max_tokens)
        for i, (step, n, max_tokens) in enumerate(specs)
    ]


def test_the_recorder_agrees_with_the_engine_under_chunking_and_preemption(make_figures, tiny_llama):
    llm = LLM(str(tiny_llama), skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32",
              block_size=4, num_gpu_blocks_override=12, max_num_batched_tokens=16, max_model_len=40)
    workload = arrivals(make_figures, [(1, 21, 10), (1, 9, 12), (1, 5, 8), (4, 13, 6), (30, 3, 2)])
    records = make_figures.collect_steps(llm, workload)
    core = llm.llm_engine.engine_core

    assert [r.step for r in records] == list(range(1, len(records) + 1)), "one record per engine step, in order"
    assert len(records) == core.num_steps, "the recorder must see every step the engine ran"
    assert all(r.num_scheduled_tokens <= 16 for r in records), "no step may exceed the token budget"
    assert all(r.blocks_in_use <= 12 for r in records), "no step may hold more blocks than the cache has"
    assert max(r.blocks_in_use for r in records) == core.peak_num_blocks_used, "blocks in use must match the engine's peak"
    preempted = [req_id for r in records for req_id in r.preempted]
    assert len(preempted) == core.scheduler.num_preemptions > 0, "12 blocks of 4 cannot hold all requests: preemptions"

    for a in workload:
        steps = [(r.step, s) for r in records for s in r.scheduled if s.request_id == a.request_id]
        if a.request_id != "E":
            assert steps[0][0] >= a.step, f"{a.request_id} ran before it arrived"
        next_start = 0
        for step, s in steps:
            assert s.start == next_start or (s.start == 0 and s.kind == "recompute"), (
                f"{a.request_id}, step {step}: starts at token {s.start}, but it had computed {next_start}"
            )
            next_start = s.start + s.num_tokens
        num_prompt = len(a.prompt["prompt_token_ids"])
        assert next_start == num_prompt + a.max_tokens - 1, f"{a.request_id}: every token but the last sampled one is computed"
        assert steps[-1][1].finished and [s.kind for _, s in steps][0] == "prefill"
        if a.request_id in preempted:
            assert "recompute" in [s.kind for _, s in steps], f"{a.request_id} was preempted, so it must be recomputed later"
    last_finish = max(r.step for r in records for s in r.scheduled if s.finished and s.request_id != "E")
    first_e = min(r.step for r in records for s in r.scheduled if s.request_id == "E")
    assert first_e == last_finish + 1 < 30, "E arrives at step 30, but the engine ran dry before: E must come at once"
    assert any(s.num_tokens < len(a.prompt["prompt_token_ids"]) for a in workload[:1] for r in records
               for s in r.scheduled if s.request_id == "A" and s.kind == "prefill"), "a 16-token budget must chunk A's 21-token prompt"


def test_the_plots_are_written(make_figures, tiny_llama, tmp_path):
    pytest.importorskip("matplotlib", reason="the figures need matplotlib (pip install -e '.[dev]')")
    llm = LLM(str(tiny_llama), skip_tokenizer_init=True, device=TEST_DEVICE, dtype="float32",
              block_size=4, num_gpu_blocks_override=8, max_num_batched_tokens=16, max_model_len=24)
    records = make_figures.collect_steps(llm, arrivals(make_figures, [(1, 10, 8), (1, 7, 8), (3, 5, 4)]))
    make_figures.plot_scheduler_timeline(records, tmp_path / "timeline.png", "test")
    make_figures.plot_scheduler_timeline(records, tmp_path / "rows.png", "test", show_tokens=False)
    make_figures.plot_kv_blocks(records, tmp_path / "kv.png", "test")
    for name in ("timeline.png", "rows.png", "kv.png"):
        assert (tmp_path / name).stat().st_size > 10_000, f"{name} was not written"
