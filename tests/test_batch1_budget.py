"""Chapter 05's H200 budget for the batch-1 step says what its data files say.

"What 2.5× on the H200 would take" is arithmetic over four measured runs in `docs/data/`.
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
    return text[start:text.index("\n## ", start)]


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
