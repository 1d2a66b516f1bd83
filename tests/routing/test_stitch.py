"""Joining a continuation asked for in a user turn onto the text the client has (`routing.stitch`):
what the client ends up with for each way a model may join it, streamed in any pieces."""

from __future__ import annotations

import pytest

from routing.stitch import WINDOW, Stitcher


def joined(sent: str, pieces: list[str]) -> str:
    """What the client has once the continuation, streamed in `pieces`, ended."""
    stitch = Stitcher(sent)
    return sent + "".join(stitch.push(piece) for piece in pieces) + stitch.end()


def by_character(text: str) -> list[str]:
    return list(text)


@pytest.mark.parametrize(
    ("sent", "continuation", "expected"),
    [
        # No overlap: passed on as it comes.
        ("The quick brown", " fox jumps", "The quick brown fox jumps"),
        ("The quick brown ", "fox jumps", "The quick brown fox jumps"),
        # The last word, the last words, the whole text written again.
        ("The quick brown", "brown fox", "The quick brown fox"),
        ("The quick brown", "quick brown fox", "The quick brown fox"),
        ("The quick brown", "The quick brown fox", "The quick brown fox"),
        ("The quick brown ", "brown fox", "The quick brown fox"),  # the client's space, not doubled
        ("It ends. The quick brown", "The quick brown fox.", "It ends. The quick brown fox."),
        # Across whitespace written differently: runs of it count as one space.
        ("The quick\n\nbrown  fox", "quick brown fox jumps", "The quick\n\nbrown  fox jumps"),
        ("The quick brown fox", "\nquick\tbrown fox jumps", "The quick brown fox jumps"),
        # The text sent ends inside a word the model writes again whole.
        ("The quick bro", "quick brown fox", "The quick brown fox"),
        ("An internat", "international treaty", "An international treaty"),
        # Tiny or coincidental overlaps are the continuation's own text.
        ("Add it to ", "to-do list", "Add it to to-do list"),
        ("I have a", " a plan", "I have a a plan"),
        ("It is in the", " theory", "It is in the theory"),
        ("Look for the", "theory", "Look for thetheory"),  # a word ends where "the" did: not a restatement
        ("Bread and", "another loaf", "Bread andanother loaf"),
        ("The quick brown", " brownie", "The quick brown brownie"),
        # Chinese: every character stands on its own.
        ("我喜欢吃苹果。今天天气", "今天天气很好", "我喜欢吃苹果。今天天气很好"),
        ("我喜欢吃苹果。", "今天", "我喜欢吃苹果。今天"),
    ],
)
def test_overlaps(sent: str, continuation: str, expected: str) -> None:
    assert joined(sent, [continuation]) == expected
    assert joined(sent, by_character(continuation)) == expected


@pytest.mark.parametrize(
    ("sent", "continuation", "expected"),
    [
        ("It ended.", "Then more.", "It ended. Then more."),
        ("Really?", "Yes.", "Really? Yes."),
        ('He said "no."', "Then he left.", 'He said "no." Then he left.'),
        ("Note:", "This matters.", "Note: This matters."),
        ("First,", "second.", "First, second."),
        # Where the space may not belong, or no rule can tell, nothing is added.
        ("The quick brown", "fox", "The quick brownfox"),  # "brown fox" or "brownfox"?
        ("Pi is 3.", "14.", "Pi is 3.14."),
        ("Use `pathlib.", "Path` here.", "Use `pathlib.Path` here."),
        ("```\nimport os.", "Path\n```", "```\nimport os.Path\n```"),
        ("Visit example.", "com today.", "Visit example.com today."),
        ("我们走吧。", "好的", "我们走吧。好的"),
        # Whitespace the client already has is not doubled; indentation after a line break is kept.
        ("one ", " two", "one two"),
        ("one  ", "   two", "one  two"),
        ("def f():\n", "    return 1", "def f():\n    return 1"),
        ("def f():\n    ", "    return 1", "def f():\n    return 1"),
        ("Intro.\n", "\n\nNext.", "Intro.\n\nNext."),
        ("Intro.\n", "\nNext.", "Intro.\nNext."),  # the model went on after "Intro." with one line break
    ],
)
def test_spacing(sent: str, continuation: str, expected: str) -> None:
    assert joined(sent, [continuation]) == expected
    assert joined(sent, by_character(continuation)) == expected


def test_text_is_held_only_while_it_may_still_be_a_restatement() -> None:
    stitch = Stitcher("The quick brown fox")
    assert stitch.push("bro") == ""  # perhaps "brown fox" again
    assert stitch.push("wn") == ""
    assert stitch.push(" fox") == ""  # "fox" may go on as "foxes"
    assert stitch.push(" jumps") == " jumps"
    assert stitch.push(" over") == " over"
    assert stitch.repeated == "brown fox"
    fresh = Stitcher("The quick brown fox")
    assert fresh.push("Jumping") == "Jumping"  # no end of the text starts so: given out at once


def test_a_continuation_ending_while_held_is_given_out() -> None:
    stitch = Stitcher("The quick brown")
    assert stitch.push("bro") == ""
    assert stitch.end() == "bro"  # not "brown": the continuation's own text
    assert stitch.repeated == ""


def test_a_continuation_that_is_only_the_restated_end_adds_nothing() -> None:
    stitch = Stitcher("He said yes")
    assert stitch.push("yes") == ""
    assert stitch.end() == ""
    assert stitch.repeated == "yes"


def test_an_empty_continuation_adds_nothing() -> None:
    assert joined("The quick brown", []) == "The quick brown"
    assert joined("Done.", [""]) == "Done."


def test_a_long_answer_started_over_is_skipped_without_holding_it() -> None:
    """A restart of a text longer than `WINDOW` is held only until its first `WINDOW` characters
    matched; what follows is dropped as it arrives while it matches, and the rest goes on."""
    sent = " ".join(f"word{i}" for i in range(300))
    assert len(sent) > 3 * WINDOW
    stitch = Stitcher(sent)
    pieces = [word if i == 0 else f" {word}" for i, word in enumerate(sent.split())]
    for piece in pieces:
        assert stitch.push(piece) == ""
    assert stitch.push(" more") == " more"
    assert stitch.push(" text") == " text"
    assert stitch.repeated == sent
    assert joined(sent, [*pieces, "\nmore"]) == sent + "\nmore"
    assert joined(sent, [sent.replace(" ", "\n") + " more"]) == sent + " more"


def test_a_reworded_restart_goes_on_from_where_it_departs() -> None:
    """Past `WINDOW` characters matched, a restart that departs from the text sent (the model words
    the rest differently) is passed on from there: the client has both wordings of that part, not
    the whole answer twice."""
    sent = " ".join(f"word{i}" for i in range(300))
    words = sent.split()
    restart = " ".join([*words[:150], "said", "otherwise"])
    assert joined(sent, by_character(restart)) == sent + " said otherwise"
    stitch = Stitcher(sent)
    assert stitch.push(restart) == " said otherwise"
    assert stitch.repeated == " ".join(words[:150])


def test_a_short_restart_that_departs_is_the_continuations_own_text() -> None:
    """Within `WINDOW`, text matching the beginning of what was sent is held and given back in full
    once it departs: "The quick" may begin a sentence of its own."""
    assert joined("The quick brown fox", ["The quick", " red fox"]) == "The quick brown foxThe quick red fox"
