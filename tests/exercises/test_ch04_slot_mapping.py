"""Chapter 04 exercise: the slot mapping, where each new token's K/V go in the paged cache.

The cache is one long row of `num_blocks * block_size` slots. A request's block table says
which block holds each run of `block_size` of its tokens, so position p goes to slot
`block_table[p // block_size] * block_size + p % block_size`. The function is called through
its module (`model_runner.compute_slot_mapping`), as the model runner itself calls it.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minivllm.executor import model_runner


@pytest.mark.exercise("ch04-slot-mapping")
def test_slots_follow_the_block_table_not_the_position():
    # Blocks 7, 2, 5 of 4 slots each: positions 0-3 live in block 7, 4-7 in block 2, 8-9 in block 5.
    slots = model_runner.compute_slot_mapping([7, 2, 5], range(0, 10), 4)
    assert slots == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21], "slot = block_table[p // block_size] * block_size + p % block_size"


@pytest.mark.exercise("ch04-slot-mapping")
def test_a_prompt_chunk_that_starts_mid_block():
    # A second chunk, positions 6..8, with block size 4: the end of the table's block 1, then block 2.
    slots = model_runner.compute_slot_mapping([3, 9, 0], range(6, 9), 4)
    assert slots == [9 * 4 + 2, 9 * 4 + 3, 0 * 4 + 0], "a chunk keeps filling the block its first position is in"


@pytest.mark.exercise("ch04-slot-mapping")
def test_a_decode_step_maps_its_one_position():
    assert model_runner.compute_slot_mapping([3, 0, 9], [12], 5) == [47], "position 12 with blocks of 5 is offset 2 of block 9"
    assert model_runner.compute_slot_mapping([3, 0, 9], [5], 5) == [0], "block 0 is a real block like any other"


@pytest.mark.exercise("ch04-slot-mapping")
def test_a_context_shorter_than_one_block():
    assert model_runner.compute_slot_mapping([11], range(0, 5), 16) == [176, 177, 178, 179, 180]


@pytest.mark.exercise("ch04-slot-mapping")
def test_block_size_one_maps_each_position_to_its_block():
    assert model_runner.compute_slot_mapping([4, 1, 3], range(3), 1) == [4, 1, 3]


@pytest.mark.exercise("ch04-slot-mapping")
@given(
    block_size=st.integers(1, 9),
    num_blocks_in_pool=st.integers(1, 40),
    data=st.data(),
)
def test_every_position_gets_its_own_slot_in_its_own_block(block_size, num_blocks_in_pool, data):
    block_table = data.draw(st.permutations(range(num_blocks_in_pool)))
    block_table = block_table[: data.draw(st.integers(1, num_blocks_in_pool))]
    capacity = len(block_table) * block_size
    start = data.draw(st.integers(0, capacity - 1))
    end = data.draw(st.integers(start + 1, capacity))
    slots = model_runner.compute_slot_mapping(block_table, range(start, end), block_size)
    assert len(slots) == end - start, "one slot per position"
    assert len(set(slots)) == len(slots), "two positions must never share a slot"
    for pos, slot in zip(range(start, end), slots):
        assert slot // block_size == block_table[pos // block_size], f"position {pos} is in the wrong block"
        assert slot % block_size == pos % block_size, f"position {pos} is at the wrong offset in its block"
