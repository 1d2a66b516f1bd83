"""Run fake vendors as standalone servers, for manual testing, demos and drills against `weir serve`.

    .venv/bin/python -m tests.fakes                                  # all four on free ports
    .venv/bin/python -m tests.fakes openai anthropic --port 9100     # consecutive ports from 9100

Prints each fake's base URL and API key, then serves until interrupted. Faults can be queued from
outside through each fake's control endpoint (no vendor auth, never recorded)::

    curl -X POST localhost:9100/__fake__/fail_next -d '{"kind": "status", "status_code": 529, "times": 3}'
    curl -X POST localhost:9100/__fake__/reset
"""

from __future__ import annotations

import argparse
import threading

from tests.fakes.anthropic import FakeAnthropic
from tests.fakes.gemini import FakeGemini
from tests.fakes.openai import FakeOpenAI
from tests.fakes.server import FakeServer

VENDORS = {
    "openai": lambda port: FakeOpenAI(port=port),
    "anthropic": lambda port: FakeAnthropic(port=port),
    "gemini": lambda port: FakeGemini(port=port),
    "deepseek": lambda port: FakeOpenAI(flavour="deepseek", port=port),
}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fakes", description="Run fake LLM vendors.")
    parser.add_argument("vendors", nargs="*", help=f"any of {', '.join(VENDORS)} (default: all)")
    parser.add_argument(
        "--port", type=int, default=0, help="first port (consecutive after it); 0: free ports"
    )
    args = parser.parse_args()
    unknown = set(args.vendors) - set(VENDORS)
    if unknown:
        parser.error(f"unknown vendor(s): {', '.join(sorted(unknown))}")
    fakes: list[FakeServer] = []
    try:
        for i, name in enumerate(args.vendors or VENDORS):
            fake = VENDORS[name](args.port + i if args.port else 0).start()
            fakes.append(fake)
            print(f"{name:<10} base_url={fake.base_url}  api_key={fake.api_key}", flush=True)
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        for fake in fakes:
            fake.stop()


if __name__ == "__main__":
    main()
