"""Tokenizers: Hugging Face `tokenizer.json`, one rebuilt from GGUF metadata, or a byte-level fallback.

Chat templates are the model's own Jinja templates, rendered in a sandbox the way transformers does
(`trim_blocks`, `lstrip_blocks`, `raise_exception`, `tojson`), with `tools` passed through for templates
that write tool-call prompts.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# ChatML, the template of SmolLM2 and Qwen: used when a tokenizer ships none.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre` (as in llama.cpp's llama-vocab.cpp)
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model."""

    def __init__(
        self,
        backend: HFTokenizer | None,
        *,
        chat_template: str | None,
        eos_token_ids: set[int],
        bos_token_id: int | None = None,
        vocab_size: int | None = None,
        add_bos: bool = False,
    ) -> None:
        self._backend = backend
        self.chat_template = chat_template or DEFAULT_CHAT_TEMPLATE
        self.eos_token_ids = set(eos_token_ids)
        self.bos_token_id = bos_token_id
        # Whether the model expects BOS at the start of its input (Llama 3 does, SmolLM2 and Qwen do
        # not). Chat templates write it themselves; a raw completions prompt gets it from `encode_prompt`.
        self.add_bos = add_bos and bos_token_id is not None
        self.vocab_size = vocab_size or (backend.get_vocab_size() if backend else 256)

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def byte_level(cls, vocab_size: int = 256, eos_token_ids: set[int] | None = None) -> Tokenizer:
        """UTF-8 bytes as token ids: for tiny random-weight models that have no tokenizer file."""
        return cls(
            None,
            chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}",
            eos_token_ids=eos_token_ids if eos_token_ids is not None else {0},
            vocab_size=vocab_size,
        )

    @classmethod
    def from_hf_dir(cls, path: Path, eos_token_ids: set[int] | None = None) -> Tokenizer:
        path = Path(path)
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()

        def token_id(value: Any) -> int | None:
            text = value.get("content") if isinstance(value, dict) else value
            return backend.token_to_id(text) if text else None

        eos = set(eos_token_ids or ())
        if (tid := token_id(cfg.get("eos_token"))) is not None:
            eos.add(tid)
        bos = token_id(cfg.get("bos_token"))
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:  # fast tokenizers say it through their post-processor instead
            add_bos = bos is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos]
        return cls(
            backend, chat_template=template, eos_token_ids=eos, bos_token_id=bos, add_bos=bool(add_bos)
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Rebuild a byte-level BPE tokenizer from `tokenizer.ggml.*` (GGUF's `gpt2` tokenizer model)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        pre = meta.get("tokenizer.ggml.pre", "default")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        if pre in ("llama-bpe", "llama3"):
            split = pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated")
            backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
        elif pre == "qwen2":
            split = pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated")
            backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
        elif pre == "smollm":  # digits one by one, then GPT-2's split
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        else:
            split = pre_tokenizers.Split(Regex(_GPT2_PATTERN), behavior="isolated")
            backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
        backend.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        # control (3) and user-defined (4) tokens are matched whole, before the BPE model sees the text
        special = [
            AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in (3, 4)
        ]
        backend.add_special_tokens(special)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = {eos} if eos is not None else set()
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None:
            eos_ids.add(eot)
        # llama.cpp's rule: the file's flag, else BOS for Llama 3's pre-tokenizer only.
        add_bos = meta.get("tokenizer.ggml.add_bos_token", pre in ("llama-bpe", "llama3"))
        return cls(
            backend,
            chat_template=meta.get("tokenizer.chat_template"),
            eos_token_ids=eos_ids,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            vocab_size=len(tokens),
            add_bos=bool(add_bos),
        )

    # --- text <-> ids ---------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in the text (e.g. `<|im_start|>`) map to their ids."""
        if self._backend is None:
            return list(text.encode("utf-8"))
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt's ids as the model expects its input to start: with BOS where it wants one
        (once: a prompt that already starts with it keeps just that one), as llama.cpp and vLLM do."""
        ids = self.encode(text)
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]  # add_bos implies an id
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend is None:
            return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        if self._backend is None:
            return chr(token_id) if token_id < 256 else None
        return self._backend.id_to_token(token_id)

    def vocabulary(self, size: int) -> list[str] | list[bytes]:
        """Every token id's string in the vocabulary's own spelling (see `vocab_kind`), "" for special
        tokens and for ids past the vocabulary up to `size`, the model's row count."""
        if self._backend is None:
            return [bytes([i]) if i < 256 else b"" for i in range(size)]
        # special tokens (<|im_start|>, ...) are not their spelling in text: "" keeps them out of grammars
        special = {i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        return ["" if i in special else self._backend.id_to_token(i) or "" for i in range(size)]

    @cached_property
    def vocab_kind(self) -> str:
        """How token strings spell bytes: "byte_level" (GPT-2's printable bytes, "Ġ" for a space),
        "byte_fallback" (SentencePiece's "<0x0A>" tokens), or "raw" (the text itself)."""
        if self._backend is None:
            return "raw"
        vocab = self._backend.get_vocab()
        if "<0x0A>" in vocab:
            return "byte_fallback"
        return "byte_level" if "Ġ" in vocab or "Ċ" in vocab else "raw"

    def token_to_id(self, token: str) -> int | None:
        if self._backend is None:
            return ord(token) if len(token) == 1 and ord(token) < 256 else None
        return self._backend.token_to_id(token)

    # --- chat ----------------------------------------------------------------------------------
    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)

    @property
    def supports_tools(self) -> bool:
        return "tools" in self.chat_template

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render the conversation with the model's own template (the prompt text, not token ids)."""
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(min(self.eos_token_ids)) if self.eos_token_ids else ""
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos or "",
            eos_token=eos or "",
            **kwargs,
        )
