"""Chapter 05 exercise: how many KV blocks fit, from a memory profile.

The engine may use `gpu_memory_utilization` of the card. Out of that come what other
processes hold and this process's peak while it ran the largest possible step (weights plus
activations); what remains is cut into whole blocks. The function is called through its
module, as the worker calls it.
"""

from __future__ import annotations

import pytest

from minivllm.executor import worker

GIB = 2**30


@pytest.mark.exercise("ch05-kv-cache-sizing")
def test_the_budget_is_the_share_minus_others_minus_the_peak():
    # 80 GiB card at 0.9 = 72 GiB; 2 GiB other processes; 6 GiB peak → 64 GiB of 1 MiB blocks.
    assert worker.num_kv_blocks(80 * GIB, 0.9, 2 * GIB, 6 * GIB, 1 << 20) == 64 * 1024


@pytest.mark.exercise("ch05-kv-cache-sizing")
def test_only_whole_blocks_count():
    # 10 GiB at 0.5 = 5 GiB; minus 1 GiB = 4 GiB = 4096 MiB over 3 MiB blocks = 1365.33 blocks.
    assert worker.num_kv_blocks(10 * GIB, 0.5, 0, GIB, 3 << 20) == 1365, "a partial block holds nothing: round down"


@pytest.mark.exercise("ch05-kv-cache-sizing")
def test_a_budget_spent_before_the_cache_gives_no_blocks():
    assert worker.num_kv_blocks(16 * GIB, 0.5, 3 * GIB, 6 * GIB, 1 << 20) == 0, "never a negative number of blocks"


@pytest.mark.exercise("ch05-kv-cache-sizing")
def test_the_real_numbers_of_a_qwen3_shape():
    # Qwen3-0.6B in bf16: 28 layers × 8 KV heads × 128 dims × 2 (K and V) × 2 bytes × 16 tokens
    # = 1,835,008 bytes a block. With 139.8 GiB × 0.9, 0.5 GiB used elsewhere and a 3.1 GiB peak:
    bytes_per_block = 28 * 8 * 128 * 2 * 2 * 16
    total = int(139.8 * GIB)
    expected = int(total * 0.9 - 0.5 * GIB - 3.1 * GIB) // bytes_per_block
    got = worker.num_kv_blocks(total, 0.9, int(0.5 * GIB), int(3.1 * GIB), bytes_per_block)
    assert got == expected, f"expected {expected} blocks, got {got}"
