"""Incremental detokenization and stop strings: streaming text out of a stream of token ids.

Chapter 02 (engine core, output processing) explains this module. The engine core produces
token ids one step at a time; the output processor must turn them into text *as they come*,
so a streaming client sees words appear, and so stop strings can end a request early.

Why not just decode each new token on its own? Two reasons, both visible with real tokenizers:

- A token is not a whole character. Byte-level BPE (GPT-2, SmolLM2) and SentencePiece with
  byte fallback (Llama 2) split a character they have no piece for into its UTF-8 bytes, one
  token per byte: "龍" may be the three tokens <0xE9> <0xBE> <0x8D>. Decoding <0xE9> alone
  gives "\ufffd" (the replacement character), and so does any window that *ends* inside a
  character. That text must be held back until the character is complete.
- A token's text depends on its neighbours. SentencePiece decoders drop the space that the
  *first* token of a sequence carries ("▁Paris" decodes to "Paris" at the start of a text but
  to " Paris" after "is"), and special tokens may be skipped.

The prefix-offset / read-offset method (vLLM's `detokenize_incrementally`, TGI's decoder)
handles both with nothing but `tokenizer.decode`. Keep a list of ids and two offsets into it:

    ids:     ... p0  p1  p2 | r0  r1 | n0  n1
                 ^prefix_offset ^read_offset  ^new ids

- `prefix_text = decode(ids[prefix_offset:read_offset])` is text already emitted, decoded in
  a small window that starts a few tokens back, so the window's first token (whose leading
  space may be dropped) is never a token whose text we still have to emit.
- `new_text = decode(ids[prefix_offset:])` is the same window plus everything not yet emitted.
- If `new_text` is longer and does not end in "\ufffd", the newly stable text is
  `new_text[len(prefix_text):]`; then the window slides: prefix_offset = read_offset,
  read_offset = len(ids). Otherwise nothing is emitted and the offsets stay, so the next
  step decodes a wider window that includes the rest of the character.

The window starts inside the prompt (its last few tokens), so the very first generated token
is decoded after real context and keeps its leading space with SentencePiece, exactly as
`decode(prompt + output)` would show it. With an empty prompt the output is what
`decode(output)` gives.

Correctness argument, for generated ids whose text is valid UTF-8: read_offset only ever moves
to a point where the decoded window ended cleanly, i.e. a character boundary; so every window
starts on a boundary, the decode of `ids[prefix_offset:read_offset]` is a prefix of the decode
of `ids[prefix_offset:]`, and the pieces, joined, are the decode of the whole output.
"""

from __future__ import annotations

from typing import Any

# How many prompt tokens seed the first window (vLLM uses the same number): enough context
# for the first generated token's leading space and for any special token handling.
INITIAL_PREFIX_TOKENS = 5
# One character is at most 4 UTF-8 bytes, so at most 4 byte tokens; stepping this far back
# finds the start of a character the prompt window would otherwise begin inside.
_MAX_BYTES_PER_CHAR = 4
_REPLACEMENT_CHAR = "\ufffd"


# --8<-- [start:incremental-detokenizer]
class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, a few tokens at a time."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Passed on to `decode`: only Python ("slow") tokenizers read it; fast ones ignore it.
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._output_text = ""

        self.token_ids = list(prompt_token_ids[-(INITIAL_PREFIX_TOKENS + _MAX_BYTES_PER_CHAR) :])
        self.read_offset = len(self.token_ids)
        self.prefix_offset = self._first_window_start()

    @property
    def output_text(self) -> str:
        """All text emitted so far (the joined results of `update`)."""
        return self._output_text

    def update(self, new_token_ids: list[int]) -> str:
        """Add newly generated ids; return the text that became stable (may be "")."""
        if not new_token_ids:
            return ""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])

        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            # Nothing new yet (e.g. a skipped special token), or the text ends inside a
            # multi-byte character: wait for the tokens that complete it.
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._output_text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )

    def _first_window_start(self) -> int:
        """Where the first window starts: INITIAL_PREFIX_TOKENS back, on a character start.

        A window that starts in the middle of a character begins with "\ufffd" -- and with
        SentencePiece's byte fallback the *whole* run of byte tokens becomes "\ufffd"s, which
        would corrupt the first generated character too. So step back until it decodes cleanly.
        """
        start = max(self.read_offset - INITIAL_PREFIX_TOKENS, 0)
        for candidate in range(start, max(start - _MAX_BYTES_PER_CHAR, 0) - 1, -1):
            window = self._decode(self.token_ids[candidate : self.read_offset])
            if not window.startswith(_REPLACEMENT_CHAR):
                return candidate
        return start
# --8<-- [end:incremental-detokenizer]


# --8<-- [start:check-stop-strings]
# exercise[ch02-stop-strings]: search from len(stop_str) - 1 chars before the new text; the match that ends first wins; cut before it, or after it if included
def check_stop_strings(
    output_text: str,
    new_char_count: int,
    stop: list[str],
    include_stop_str_in_output: bool,
) -> tuple[str, int] | None:
    """Find a stop string that ends within the last `new_char_count` characters.

    Earlier text was already checked on earlier steps, so only the tail that could hold a
    stop string ending in the new characters is searched: it starts len(stop_str) - 1
    characters before them. This keeps the check O(new text) per step, not O(all text).

    Returns (stop_str, truncate_to) or None: the caller cuts the text to `truncate_to`
    characters, which ends just before the stop string, or just after it when
    include_stop_str_in_output. Anything generated after the stop string is dropped.

    With several matches the one that is *completed first* wins (the smallest end position;
    on a tie, the one that starts first). That is the one a token-by-token stream would have
    stopped on, so the result does not depend on how the text was chunked into steps.
    """
    if new_char_count <= 0 or not stop:
        return None
    best: tuple[int, int, str] | None = None  # (end, start, stop_str)
    for stop_str in stop:
        search_from = max(len(output_text) - new_char_count - len(stop_str) + 1, 0)
        start = output_text.find(stop_str, search_from)
        if start == -1:
            continue
        candidate = (start + len(stop_str), start, stop_str)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    if best is None:
        return None
    end, start, stop_str = best
    return stop_str, end if include_stop_str_in_output else start
# --8<-- [end:check-stop-strings]
