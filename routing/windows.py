"""The context window each backend's model has, as far as the gateway knows it: what the output limit
of an attempt must leave room for after the prompt (`routing.execute.Executor._fit_context`), and what
a candidate must hold to fit a request (`routing.policies.fits`, the `cheapest` policy): both read it
through `ContextWindows.of`, so a plan never weighs one window and its attempt another.

Three sources, one answer (`ContextWindows.window`):
- served: what an OpenAI-compatible server says of itself, `max_model_len` on each model of its
  `/v1/models` (the bundled engine, vLLM and SGLang list it; OpenAI does not). Read by the health
  probes every round (`routing.health`) and by the engine supervisor each time an engine it started
  is up (`gateway.engine_supervisor`), so a server restarted with another window is followed. A list
  without the field says nothing and changes nothing.
- reported: the window a backend names in a 400 `context_length_exceeded` (`context_report`), which
  stands until the next probe that says otherwise (the newer fact wins either way).
- declared: the candidate's `context_window` in the route, an operator's declaration. It can lower the
  backend's window (a deliberate limit is kept), never raise it: the backend refuses more than it
  holds whatever the config says.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from routing.plan import Choice

# The window of a server that serves one model whatever it is called (the bundled engine answers to
# its `--served-model-name` and its `--model` string alike, and lists only the first).
ANY_MODEL = ""


class _ModelCard(msgspec.Struct):
    id: str
    max_model_len: Any = None  # left loose: another server's value of another type is ignored, not an error


class _ModelList(msgspec.Struct):
    data: list[_ModelCard]


_decoder = msgspec.json.Decoder(_ModelList)


def served_windows(body: bytes, sole: bool = False) -> dict[str, int] | None:
    """{model id: max_model_len} of an OpenAI-compatible `/v1/models` answer, for the models that say
    it; None where the body is no model list (nothing is known then, not "no window"). With `sole` (a
    server of one model, the bundled engine), a list of one model's window is also `ANY_MODEL`'s."""
    try:
        listing = _decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    windows = {
        card.id: card.max_model_len
        for card in listing.data
        if type(card.max_model_len) is int and card.max_model_len > 0
    }
    if sole and len(listing.data) == 1 and windows:
        windows[ANY_MODEL] = next(iter(windows.values()))
    return windows


class ContextWindows:
    """Per process, like the breakers' local state: each replica probes its backends itself."""

    def __init__(self) -> None:
        self._served: dict[str, dict[str, int]] = {}  # backend -> {model id or ANY_MODEL: window}
        self._reported: dict[tuple[str, str], int] = {}  # (backend, upstream model) -> window

    def served(self, backend: str, windows: Mapping[str, int]) -> dict[str, int]:
        """What `backend`'s model list says now, in place of what it said before (a model gone or no
        longer saying its window is no longer known from it); a 400's report it covers is older and
        dropped. Returns the windows that changed, {model: window, or 0 where no longer said}."""
        before = self._served.get(backend, {})
        self._served[backend] = dict(windows)
        for key in [k for k in self._reported if k[0] == backend]:
            if key[1] in windows or ANY_MODEL in windows:
                del self._reported[key]
        changed = {m: w for m, w in windows.items() if before.get(m) != w}
        return changed | {m: 0 for m in before if m not in windows}

    def reported(self, backend: str, model: str, window: int) -> None:
        """The window a 400 for `model` at `backend` named: newer than the last probe's word on it."""
        self._reported[(backend, model)] = window

    def window(self, backend: str, model: str, declared: int | None = None) -> int | None:
        """The context window to fit a request for `model` at `backend` in (None: not known): the
        backend's newest word on it, at most `declared` (the candidate's `context_window`)."""
        served = self._served.get(backend, {})
        fact = self._reported.get((backend, model)) or served.get(model) or served.get(ANY_MODEL)
        if fact is None or declared is None:
            return fact if fact is not None else declared
        return min(fact, declared)

    def of(self, choice: Choice) -> int | None:
        """The window to fit a request on `choice` in: its backend's newest word on its upstream model,
        at most the candidate's `context_window` (`window`)."""
        target = choice.target
        return self.window(target.backend.name, target.upstream_model, choice.candidate.context_window)
