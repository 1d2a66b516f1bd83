"""Two OpenAI models on a backend nothing listens on (`CONFIG`) and a difficulty route between them
(`DIFFICULTY`), for the tests of how a router loads and serves difficulty heads."""

from __future__ import annotations

from routing.routes import Candidate, Route

CONFIG = """\
backends:
  - {name: openai, type: openai, base_url: "http://127.0.0.1:9/v1", api_key: k}
models:
  - {name: gpt-4o-mini, backend: openai}
  - {name: gpt-4o, backend: openai}
"""
DIFFICULTY = Route(
    name="auto", policy="difficulty", candidates=[Candidate(model="gpt-4o-mini"), Candidate(model="gpt-4o")]
)
