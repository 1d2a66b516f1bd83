"""Tokenizers and chat templates: byte-level fallback, templates with tools, GGUF-built tokenizer."""

from __future__ import annotations

import jinja2
import pytest

from engine.tokenizer import Tokenizer


def test_byte_level_round_trip() -> None:
    tok = Tokenizer.byte_level()
    ids = tok.encode("héllo")
    assert ids == list("héllo".encode()) and tok.decode(ids) == "héllo"
    assert tok.vocab_size == 256 and tok.eos_token_ids == {0}
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "user: hi\nassistant: "


TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system', 'tool'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_template_renders_tools_and_special_tokens() -> None:
    tok = Tokenizer(None, chat_template=TOOL_TEMPLATE, eos_token_ids={ord("$")})
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template([{"role": "user", "content": "weather?"}], tools=tools)
    assert text == (
        '<tools>{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}'
        "</tools>\n<|user|>weather?$\n<|assistant|>"
    )
    assert tok.supports_tools
    no_prompt = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert no_prompt == "<|user|>x$\n"
    with pytest.raises(jinja2.TemplateError, match="bad role robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])


def test_templates_cannot_escape_the_sandbox() -> None:
    tok = Tokenizer(None, chat_template="{{ messages.__class__.__mro__ }}", eos_token_ids=set())
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_gguf_tokenizer_rejects_unknown_models() -> None:
    with pytest.raises(ValueError, match="not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": []})
