"""Prompt-lookup drafting and per-token stop checks, with exact expected values."""

import pytest

from mtpctl.drafters.ngram import NgramDrafter
from mtpctl.decode.stopping import StopChecker


def test_ngram_proposes_continuation_of_latest_match():
    d = NgramDrafter(ngram_max=3, ngram_min=1)
    #           0  1  2  3  4  5  6  7  8  9
    context = [1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2, 3]
    # last 3-gram (1,2,3) occurs at 0 and 5; the latest (5) is followed by 5, 1, 2, 3
    assert d.propose(context, 3).tokens[1:] == [5, 1, 2]
    assert d.propose(context, 10).tokens[1:] == [5, 1, 2, 3]


def test_ngram_falls_back_to_shorter_ngrams_then_nothing():
    d = NgramDrafter(ngram_max=3, ngram_min=2)
    assert d.propose([7, 8, 1, 7, 8], 4).tokens[1:] == [1, 7, 8]  # 2-gram (7, 8) matched
    assert d.propose([1, 2, 3, 4, 5], 4).tokens[1:] == []  # nothing repeats: propose nothing
    assert NgramDrafter(1, 1).propose([4, 6, 4], 2).tokens[1:] == [6, 4]
    assert d.propose([1, 2, 1, 2], 0).tokens[1:] == []


def test_ngram_bounds_are_checked():
    with pytest.raises(ValueError):
        NgramDrafter(ngram_max=1, ngram_min=2)
    with pytest.raises(ValueError):
        NgramDrafter(ngram_max=2, ngram_min=0)


def letters(ids):
    return "".join(chr(ord("a") + i) for i in ids)


def test_stop_string_spanning_tokens_cuts_text_before_it():
    stop = StopChecker(eos_ids=[25], stop_strings=["cd"], max_new_tokens=10, decode=letters)
    assert [stop.push(t) for t in [0, 1, 2]] == [False, False, False]
    assert stop.push(3) is True
    assert (stop.text, stop.tokens, stop.finish_reason) == ("ab", [0, 1, 2, 3], "stop")


def test_eos_and_length():
    stop = StopChecker([25], [], 3, letters)
    assert stop.push(0) is False and stop.push(25) is True
    assert stop.finish_reason == "eos" and stop.tokens == [0, 25]
    stop = StopChecker([25], [], 2, letters)
    assert stop.push(0) is False and stop.push(1) is True
    assert stop.finish_reason == "length"
    with pytest.raises(RuntimeError):
        stop.push(2)


def test_streaming_holds_back_a_possible_stop_prefix():
    stop = StopChecker([], ["xyz"], 10, letters)
    stop.push(0)
    assert stop.stream() == "a"
    stop.push(1)
    stop.push(23)  # "abx": "x" may begin the stop string
    assert stop.stream() == "b"
    stop.push(24)  # "abxy": still a possible beginning
    assert stop.stream() == ""
    stop.push(2)  # "abxyc": no longer
    assert stop.stream() == "xyc"
    stop.push(23)
    stop.end("length")  # at the end everything is final
    assert stop.stream() == "x"


def test_streaming_waits_for_complete_characters():
    pieces = {0: "a", 1: "\ufffd", 2: "é"}
    stop = StopChecker([], [], 10, lambda ids: "".join(pieces[i] for i in ids).replace("\ufffdé", "é"))
    stop.push(0)
    stop.push(1)
    assert stop.stream() == "a"
    stop.push(2)
    assert stop.stream() == "é"


def test_invalid_utf8_is_held_at_most_four_tokens():
    stop = StopChecker([], [], 10, lambda ids: "\ufffd" * len(ids))  # bytes that never form a character
    for _ in range(3):
        stop.push(0)
    assert stop.text == ""
    stop.push(0)
    assert stop.text == "\ufffd" * 4
