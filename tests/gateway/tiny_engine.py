"""`weir engine serve` with the tiny random Llama in place of the model `--model` names: the real
engine server and CLI, whose model loads in a blink. Writes its pid to $TINY_ENGINE_PID_FILE if set.

python tests/gateway/tiny_engine.py engine serve --model tiny --port PORT
"""

from __future__ import annotations

import os
from pathlib import Path

from engine import llm_engine
from engine.config import KNOWN_MODELS
from weir.cli import main

real = llm_engine.LLMEngine


def tiny(model: str, **kwargs: object) -> llm_engine.LLMEngine:
    # `--max-model-len` as the real engine takes it (a window below the tiny model's 1,024)
    return real.from_config(KNOWN_MODELS["tiny"], num_kv_blocks=64, max_model_len=kwargs.get("max_model_len"))


llm_engine.LLMEngine = tiny  # type: ignore[misc,assignment]
if "TINY_ENGINE_PID_FILE" in os.environ:
    Path(os.environ["TINY_ENGINE_PID_FILE"]).write_text(str(os.getpid()))
main()
