"""Fake OpenAI, Anthropic and Gemini servers that speak each vendor's real wire format.

Use the pytest fixtures (`fake_openai`, `fake_anthropic`, `fake_gemini`, `fake_deepseek`) or, outside
pytest, the classes as context managers. See `server` for the shared controls, `faults` for fault
injection, `behaviour` for how replies and token counts derive from the request, `caches` for the
prompt-cache rules, and each vendor module for its wire format.
"""

from tests.fakes.anthropic import FakeAnthropic
from tests.fakes.behaviour import ReportedUsage
from tests.fakes.faults import Fault, FaultKind
from tests.fakes.gemini import FakeGemini
from tests.fakes.openai import FakeOpenAI
from tests.fakes.server import FakeServer, RecordedRequest

__all__ = [
    "FakeAnthropic",
    "FakeGemini",
    "FakeOpenAI",
    "FakeServer",
    "Fault",
    "FaultKind",
    "RecordedRequest",
    "ReportedUsage",
]
