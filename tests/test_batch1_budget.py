"""Chapter 05's H200 budget for the batch-1 step says what its data files say.

"What 2.5× on the H200 would take" is arithmetic over four measured runs in `docs/data/` (the
estimate), and a fifth that measured the step with every layer's weights in L2 (the ceiling).
`docs/figures/plot_batch1_progress.py` does that arithmetic (`budget()`) and draws its result;
this test recomputes it and looks for each figure, rounded as the chapter rounds it, in the
chapter's text, so that the prose cannot drift from the data or from the figure.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CHAPTER = REPO_ROOT / "docs" / "chapters" / "05-executor-worker.md"
SCRIPT = REPO_ROOT / "docs" / "figures" / "plot_batch1_progress.py"


@pytest.fixture(scope="module")
def budget() -> dict[str, float]:
    spec = importlib.util.spec_from_file_location("plot_batch1_progress", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.budget()


@pytest.fixture(scope="module")
def section() -> str:
    text = CHAPTER.read_text()
    start = text.index("#### What 2.5× on the H200 would take")
    # Line breaks as spaces: the figures are matched in the prose however it is wrapped.
    return " ".join(text[start:text.index("\n## ", start)].split())


def test_the_budget_table_matches_the_data(budget, section):
    assert f"the floor of {budget['floor']:.1f} µs" in section
    assert f"| {budget['target']:.1f} |" in section
    assert f"| − {budget['lm_head']:.1f} |" in section
    assert f"| − {budget['outside_replay']:.1f} |" in section
    assert f"**{budget['replay_budget']:.1f}** ({budget['layer_budget']:.1f} a layer)" in section
    assert f"{budget['replay_measured']:.1f} ({budget['replay_measured'] / 28:.1f} a layer)" in section


def test_the_l2_estimate_matches_the_data(budget, section):
    assert f"about {budget['beyond_chain']:.1f} µs" in section
    assert f"about {budget['gate_up_saving']:.1f} µs off each layer" in section
    assert f"leaves about {budget['l2_layer']:.1f} µs" in section
    over = budget["l2_layer"] - budget["layer_budget"]
    assert f"That is {over:.1f} µs a layer over the budget" in section
    assert f"the step about {round(budget['l2_step'], -1):.0f} µs: {budget['l2_step_over_floor']:.1f}× the H200's floor" in section
    # The estimate is above the target: the chapter's conclusion rests on that.
    assert budget["l2_step"] > budget["target"]


def test_the_measured_l2_ceiling_matches_the_data(budget, section):
    # The H100 run with every layer's weights in L2 (`engine_variants.py shared-weights`).
    assert f"| {budget['h100_replay_shared']:.1f} ({budget['l2_layer_measured']:.1f} a layer) |" in section
    assert (f"{budget['h100_replay_shared']:.1f} µs at batch 1, against {budget['h100_replay_default']:.1f} µs "
            f"as it is in the same run: {budget['l2_layer_measured']:.1f} µs a layer, "
            f"{budget['l2_saving_measured']:.1f} µs a layer less") in section
    assert (f"the H200 step would be {budget['h100_replay_shared']:.1f} + {budget['lm_head']:.1f} + "
            f"{budget['outside_replay']:.1f} = {budget['l2_step_measured']:.1f} µs, "
            f"{budget['l2_step_measured_over_floor']:.1f}× its floor") in section
    over = budget["l2_layer_measured"] - budget["layer_budget"]
    assert f"{over:.1f} µs a layer over the budget of {budget['layer_budget']:.1f}" in section
    # Where the estimate and the measurement part.
    assert f"The measured layer is {budget['l2_layer_measured'] - budget['l2_layer']:.1f} µs longer" in section
    as_is_gap = budget["h100_layer_default"] - budget["l2_estimate_layer_as_is"]
    assert (f"{as_is_gap:.1f} µs are the engine's layer as it is: {budget['h100_layer_default']:.1f} µs in the "
            f"measured run, against the {budget['l2_estimate_layer_as_is']:.1f}") in section
    assert (f"{budget['l2_saving_measured']:.1f} µs off the engine's layer, against "
            f"{budget['l2_saving_chain']:.1f} µs off chapter 06's chain") in section
    # The same chain on the H200: predicted from the H100's split, and read from the H200's layer.
    assert f"would be {budget['h200_dram_measured']:.1f} µs at the" in section
    assert (f"{budget['l2_layer_measured']:.1f} + {budget['h200_dram_measured']:.1f} = "
            f"{budget['h200_layer_predicted']:.1f} µs, "
            f"{budget['h200_layer_predicted'] - budget['replay_measured'] / 28:.1f} µs more") in section
    assert (f"{budget['replay_measured'] / 28:.1f} − {budget['h200_dram_measured']:.1f} = "
            f"{budget['l2_layer_from_h200']:.1f} µs a layer, the step would be "
            f"{budget['l2_step_from_h200']:.0f} µs, {budget['l2_step_from_h200_over_floor']:.1f}× the floor") in section
    # Measured, the ceiling is above the target, read either way: the chapter's conclusion rests on that.
    assert budget["l2_step_measured"] > budget["target"]
    assert budget["l2_step_from_h200"] > budget["target"]
    assert budget["l2_layer_measured"] > budget["layer_budget"]
