"""Joining a continuation asked for in a user turn (`continuation: instruction`) onto the text the
client already has, as one text.

A model asked to go on "from exactly where it stops" often joins its reply differently: it writes the
last words or the last sentence again before going on, starts the whole answer over, or leaves out
the space between the two parts (a reply is a new message, and models seldom start one with a
space). `Stitcher` takes the continuation's text as it streams and gives back what the client gets.
Text is compared with each run of whitespace as one space, so a restatement that wraps or spaces the
words differently still matches.

- Overlap: the longest end of the sent text that the continuation begins with is dropped, when it
  starts at a word boundary of the sent text, is at least `MIN_OVERLAP` characters (a one- or
  two-character match, "a" or "of", is kept: it may be the continuation's own text) and at most
  `WINDOW`, and ends at a word boundary of the continuation ("the" is not dropped from "theory"),
  unless it is two words or more, or one word of at least `MIN_SPLIT_WORD` characters: the sent text
  ends inside that word, and the model wrote it again whole ("quick bro" in "quick brown").
- Restart: a continuation that begins with the whole sent text goes on after it. Once it has matched
  the first `WINDOW` characters of a longer text, it is skipped as it arrives for as long as it keeps
  matching, and passed on from where it departs (a reworded restart: the client has both wordings
  from there) or goes past the sent text.
- Spacing, at the join (`_joined`): whitespace the client already has (the sent text's trailing
  whitespace, which the prefill leaves out) is not sent twice, nor are spaces or tabs after a space or
  tab; with none on either side, one space is added only where the sent text ends in a sentence mark
  (`.`, `!`, `?`, `:`) and the continuation starts with a capital letter, or it ends in `,` or `;`
  and the continuation starts with a letter, the mark following a letter or a closing bracket, quote
  or emphasis (and perhaps followed by some: `"no."`), outside markdown code. Between two words nothing is added ("brown" + "fox" and "intern"
  + "ational" look alike), nor in scripts written without spaces (Chinese, Japanese, Thai).

The continuation's beginning is held back only while it can still be one of these: at most `WINDOW`
characters (whitespace runs counted once) and a chunk, or until its first visible character after the
overlap. The held text is given out when the continuation ends (`end`).
"""

from __future__ import annotations

import enum
import re

MIN_OVERLAP = 3
MIN_SPLIT_WORD = 6
WINDOW = 400

# Scripts written without spaces between words: each character stands on its own.
_UNSPACED = re.compile(
    "[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
    "\uf900-\ufaff\uff66-\uff9f\U00020000-\U0003ffff]"
)
_CLOSERS = ")]\"'\u201d\u2019*_"  # what may close a word before its sentence mark


class _State(enum.Enum):
    HOLD = "hold"  # the overlap (or a restart) is still being decided
    SKIP = "skip"  # a restart: text matching the sent text is dropped as it arrives
    JOIN = "join"  # decided: waiting for the first visible character to join the two texts
    PASS = "pass"  # joined: the rest is passed on as it comes


class Stitcher:
    """One continuation's text, joined onto `sent` (all the text the client has)."""

    def __init__(self, sent: str) -> None:
        self.prefix = sent.rstrip()  # what the continuation was asked to go on from
        self.owed = sent[len(self.prefix) :]  # whitespace the client has past it
        self.said, _ = _normalised(self.prefix)
        self.repeated = ""  # the continuation's text dropped as already sent
        self._lengths = _overlap_lengths(self.said)  # longest first
        self._state = _State.HOLD if self._lengths else _State.JOIN
        self._held = ""
        self._matched = 0  # SKIP: characters of `said` matched so far
        self._spaced = False  # SKIP: the last one matched was a space (a whitespace run may go on)
        self._run = ""  # SKIP: the whitespace the continuation wrote last, as written

    def push(self, text: str) -> str:
        """The continuation's next text; what the client gets of it now."""
        if self._state is _State.PASS:
            return text
        if self._state is _State.SKIP:
            return self._skip(text)
        self._held += text
        return self._settle(final=False)

    def end(self) -> str:
        """The continuation ended (or its answer did): what was still held back."""
        given = self._settle(final=True) if self._state is _State.HOLD else ""
        if self._state is _State.JOIN:
            given += self._settle(final=True)
        self._state = _State.PASS
        return given

    def _settle(self, final: bool) -> str:
        if self._state is _State.HOLD:
            seen, ends = _normalised(self._held)
            if len(self.said) > WINDOW and len(seen) > WINDOW and self.said.startswith(seen[: WINDOW + 1]):
                # A restart of a longer text: what matches is dropped from here on, not held.
                cut = ends[WINDOW]
                matched, rest = self._held[:cut], self._held[cut:]
                self._state, self._matched, self._spaced = _State.SKIP, WINDOW + 1, seen[WINDOW] == " "
                self._run = matched[len(matched.rstrip()) :]
                self.repeated, self._held = self.repeated + matched, ""
                return self._skip(rest)
            overlap = self._overlap(seen, final)
            if overlap is None:
                return ""
            cut = ends[overlap - 1] if overlap else 0
            self.repeated += self._held[:cut]
            self._held, self._state = self._held[cut:], _State.JOIN
        if not final and not self._held.strip():
            return ""
        text, self._held, self._state = _joined(self.prefix, self.owed, self._held), "", _State.PASS
        return text

    def _overlap(self, seen: str, final: bool) -> int | None:
        """The length of the overlap `seen` (the continuation so far) begins with (0: none), or None
        while a longer one may still follow."""
        said = self.said
        for length in self._lengths:
            if len(seen) < length or (len(seen) == length and not final):
                if not final and said.startswith(seen, len(said) - length):
                    return None  # it may be this one: the rest of it (or what follows) decides
                continue
            tail = said[-length:]
            if seen.startswith(tail) and (len(seen) == length or self._ends_well(tail, seen[length])):
                return length
        return 0

    @staticmethod
    def _ends_well(tail: str, after: str) -> bool:
        """Whether an overlap `tail`, followed in the continuation by `after`, is one to drop: it ends at
        a word boundary, or is long enough that the sent text ending inside a word is what it says."""
        if not _splits_word(tail[-1], after):
            return True
        return " " in tail or len(tail) >= MIN_SPLIT_WORD

    def _skip(self, text: str) -> str:
        for i, ch in enumerate(text):
            if ch.isspace():
                if self._spaced:
                    self._run += ch
                    continue  # the same run of whitespace
                ch = " "
            if self._matched < len(self.said) and self.said[self._matched] == ch:
                self._matched, self._spaced = self._matched + 1, ch == " "
                self._run = text[i] if self._spaced else ""
                continue
            # It departs here: the whitespace before the word it departs at is the new text's.
            run = self._run if self._spaced else ""
            repeated = self.repeated + text[:i]
            self.repeated = repeated[: len(repeated) - len(run)]
            self._state = _State.JOIN
            return self.push(run + text[i:])
        self.repeated += text
        return ""


def _overlap_lengths(said: str) -> list[int]:
    """The lengths of the ends of `said` an overlap may be, longest first: those starting at a word
    boundary, from `MIN_OVERLAP` to `WINDOW` characters, and all of it (a restart)."""
    n = len(said)
    lengths = [
        length
        for length in range(MIN_OVERLAP, min(n, WINDOW) + 1)
        if said[n - length] != " "
        and (length == n or not _splits_word(said[n - length - 1], said[n - length]))
    ]
    if n > WINDOW:
        lengths.append(n)
    return sorted(lengths, reverse=True)


def _normalised(text: str) -> tuple[str, list[int]]:
    """`text` without leading whitespace and with each run of whitespace as one space, and where each
    of its characters ends in `text` (the index after it)."""
    out: list[str] = []
    ends: list[int] = []
    for i, ch in enumerate(text):
        if ch.isspace():
            if not out:
                continue
            if out[-1] == " ":
                ends[-1] = i + 1
                continue
            ch = " "
        out.append(ch)
        ends.append(i + 1)
    return "".join(out), ends


def _wordlike(ch: str) -> bool:
    """A character of a word written between spaces (not of Chinese, Japanese, Thai...)."""
    return (ch.isalnum() or ch == "_") and not _UNSPACED.match(ch)


def _splits_word(before: str, after: str) -> bool:
    return _wordlike(before) and _wordlike(after)


def _joined(prefix: str, owed: str, text: str) -> str:
    """The continuation's first text, from its first visible character on (or all of it, at its end),
    spaced to follow `prefix` + `owed` (the module's spacing rule)."""
    body = text.lstrip()
    lead = text[: len(text) - len(body)]
    if owed:
        same = 0
        while same < min(len(owed), len(lead)) and owed[same] == lead[same]:
            same += 1
        lead = lead[same:]
        if owed[-1] in " \t":
            lead = lead.lstrip(" \t")
    elif not lead and body and _space_missing(prefix, body[0]):
        lead = " "
    return lead + body


def _space_missing(prefix: str, first: str) -> bool:
    """Whether `prefix` followed by a text starting with `first`, with no whitespace between, plainly
    lacks a space: a sentence mark and a capital letter, a comma or semicolon and a letter (the mark
    perhaps inside closing quotes, brackets or emphasis: `"no."`, `**Note:**`)."""
    if _in_code(prefix):
        return False
    marked = prefix.rstrip(_CLOSERS)
    if len(marked) < 2:
        return False
    mark, before = marked[-1], marked[-2]
    if not ((_wordlike(before) and before.isalpha()) or before in _CLOSERS):
        return False  # "3." before "14", a mark on its own
    if mark in ".!?:":
        return first.isupper()
    return mark in ",;" and _wordlike(first) and first.isalpha()


def _in_code(text: str) -> bool:
    """Whether `text` ends inside markdown code: an open fenced block, or an open span on its line."""
    if text.count("```") % 2:
        return True
    return text.rsplit("\n", 1)[-1].replace("```", "").count("`") % 2 == 1
