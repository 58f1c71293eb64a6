"""Chapter 02 exercise: stop strings, `check_stop_strings` in minivllm/engine/detokenizer.py.

The output processor calls it after every step with the whole text so far and the number of
characters that step added. Called through its module, so a learner's version is the one tested.
"""

from __future__ import annotations

import pytest

from minivllm.engine import detokenizer


def check(text: str, new: int, stop: list[str], include: bool = False):
    return detokenizer.check_stop_strings(text, new, stop, include)


@pytest.mark.exercise("ch02-stop-strings")
def test_a_stop_string_in_the_new_text_cuts_the_text_before_it():
    assert check("Hello world", 11, ["wor"]) == ("wor", 6)
    assert check("Hello world", 11, ["wor"], include=True) == ("wor", 9), "include_stop_str_in_output keeps it"


@pytest.mark.exercise("ch02-stop-strings")
def test_a_stop_string_split_across_two_steps_is_found():
    # "Hello wo" came in an earlier step; this step added "rld".
    assert check("Hello world", 3, ["world"]) == ("world", 6), "a stop string may start in text already seen"
    assert check("Hello world", 1, ["world"]) == ("world", 6)


@pytest.mark.exercise("ch02-stop-strings")
def test_text_checked_on_earlier_steps_is_not_matched_again():
    # "stop" ended inside text of an earlier step: that step would have stopped; this one must not re-report it.
    assert check("stop here, then more", 4, ["stop"]) is None
    assert check("Hello", 0, ["Hello"]) is None, "no new text, nothing new to find"
    assert check("Hello", 5, []) is None


@pytest.mark.exercise("ch02-stop-strings")
def test_the_match_that_ends_first_wins_then_the_one_that_starts_first():
    assert check("abcdef", 6, ["cdef", "bcd"]) == ("bcd", 1), "bcd is complete after 4 characters, cdef after 6"
    assert check("abcdef", 6, ["cd", "bcd"]) == ("bcd", 1), "both end at 4: the one that starts first"
    assert check("xAx Ax", 6, ["Ax"]) == ("Ax", 1), "the first occurrence, not the last"
    assert check("abcdef", 6, ["cdef", "bcd"], include=True) == ("bcd", 4)


@pytest.mark.exercise("ch02-stop-strings")
def test_works_on_characters_not_bytes():
    assert check("你好世界", 2, ["世"]) == ("世", 2)
    assert check("naïve café", 4, ["é"], include=True) == ("é", 10)
