"""Tokenizers and chat templates: byte-level fallback, templates with tools, GGUF-built tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors

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


def _gguf_meta(pre: str, **extra: object) -> dict[str, object]:
    tokens = ["<s>", "</s>", "a", "b", "ab"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.token_type": [3, 3, 1, 1, 1],
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        **extra,
    }


@pytest.mark.parametrize(
    ("pre", "flag", "add_bos"),
    [
        ("llama-bpe", None, True),  # llama.cpp's default for Llama 3's pre-tokenizer
        ("llama-bpe", False, False),  # the file's flag wins
        ("smollm", None, False),
        ("smollm", True, True),
    ],
)
def test_gguf_tokenizer_knows_whether_prompts_start_with_bos(
    pre: str, flag: bool | None, add_bos: bool
) -> None:
    extra = {} if flag is None else {"tokenizer.ggml.add_bos_token": flag}
    tok = Tokenizer.from_gguf_metadata(_gguf_meta(pre, **extra))
    assert tok.add_bos is add_bos
    assert tok.encode("ab") == [4]
    assert tok.encode_prompt("ab") == ([0, 4] if add_bos else [4])
    assert tok.encode_prompt("<s>ab") == [0, 4]  # never twice


@pytest.mark.parametrize(("config", "add_bos"), [({}, True), ({"add_bos_token": False}, False)])
def test_hf_tokenizer_reads_bos_from_its_post_processor_or_config(
    tmp_path: Path, config: dict[str, object], add_bos: bool
) -> None:
    backend = HFTokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "hi": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", **config}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.add_bos is add_bos and tok.bos_token_id == 1
    assert tok.encode_prompt("hi") == ([1, 2] if add_bos else [2])
