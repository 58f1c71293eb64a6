"""Block hashes: the key under which a full KV block is found again (prefix caching).

The K/V of a token depend on the token and on *every token before it*. So a block of the
cache can be reused by another request only if that request has the same tokens in this block
and in all blocks before it. vLLM v1 captures that with a hash chain: block i's hash covers
block i-1's hash (the parent), block i's token ids, and extra keys — anything else that
changes the K/V or must keep requests apart: the LoRA adapter, the multimodal inputs inside
the block, and a `cache_salt` chosen by the user. Two requests share block i exactly when
their chains agree up to i. Chapter 04 ("Prefix caching") draws the chain.

Only full blocks get a hash: a partly filled block still changes, and its hash would too.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

BlockHash = bytes  # a SHA-256 digest: 32 bytes

# The parent of the first block. A fixed value keeps hashes reproducible across runs (tests
# and the worked example rely on it); `cache_salt` is how a user keeps his blocks apart.
NONE_HASH: BlockHash = hashlib.sha256(b"minivllm prefix cache").digest()


@dataclass(frozen=True, slots=True)
class MultiModalPlaceholder:
    """One multimodal input in a prompt: its content hash and the token range it fills.

    Prompts have none until chapter 09; the field exists so the hash already covers them.
    """

    identifier: str  # a hash of the image / audio itself
    offset: int  # first prompt position of its placeholder tokens
    length: int  # number of placeholder tokens


@dataclass(frozen=True, slots=True)
class BlockHashInputs:
    """What besides token ids the hash of a request's blocks depends on."""

    lora_id: int | None = None
    mm_placeholders: tuple[MultiModalPlaceholder, ...] = field(default_factory=tuple)
    cache_salt: str | None = None


# --8<-- [start:hash-block-tokens]
# exercise[ch04-block-hash]: sha256 over parent hash + the block's token ids + repr(extra_keys); digest() is the hash
def hash_block_tokens(
    parent_block_hash: BlockHash, block_token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    """The hash of one full block, chained to the hash of the block before it.

    Feed SHA-256 the parent's hash (`NONE_HASH` for a request's first block), then the
    block's token ids as 64-bit integers (`array("q", ...).tobytes()`), then `repr(extra_keys)`
    encoded as UTF-8 (the repr of None when there are none); return the digest (32 bytes).
    Equal inputs give equal hashes; change any token, any extra key or any earlier block and
    the hash changes.
    """
    hasher = hashlib.sha256(parent_block_hash)
    hasher.update(array("q", block_token_ids).tobytes())
    hasher.update(repr(extra_keys).encode())
    return hasher.digest()
# --8<-- [end:hash-block-tokens]


def block_extra_keys(inputs: BlockHashInputs, block_index: int, block_size: int) -> tuple | None:
    """The extra keys of block `block_index`: LoRA id, the multimodal inputs it overlaps, salt.

    The salt goes into the first block only: every later hash chains from it, so that is
    enough to make all of a salted request's hashes differ (vLLM does the same).
    """
    start, end = block_index * block_size, (block_index + 1) * block_size
    mm = tuple(p.identifier for p in inputs.mm_placeholders if p.offset < end and p.offset + p.length > start)
    salt = inputs.cache_salt if block_index == 0 else None
    if inputs.lora_id is None and not mm and salt is None:
        return None
    return (inputs.lora_id, mm, salt)


# --8<-- [start:extend-block-hashes]
def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, inputs: BlockHashInputs
) -> None:
    """Append the hashes of the full blocks of `token_ids` that `block_hashes` lacks.

    A request's hashes are extended as it grows (a prompt, then every `block_size` generated
    tokens), so each block is hashed once in the request's life.
    """
    num_full_blocks = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[i - 1] if i > 0 else NONE_HASH
        tokens = token_ids[i * block_size : (i + 1) * block_size]
        block_hashes.append(hash_block_tokens(parent, tokens, block_extra_keys(inputs, i, block_size)))
# --8<-- [end:extend-block-hashes]
