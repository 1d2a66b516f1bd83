"""Checkpoint loading: Hugging Face safetensors directories and GGUF files.

Both formats yield tensors under Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...);
`load_weights` copies them into the model, fusing q/k/v and gate/up on the way. Safetensors shards are
memory-mapped; GGUF tensors are memory-mapped by the `gguf` reader and dequantised one at a time, so
peak memory stays near the size of the final fp32/bf16 model.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from engine.config import ModelConfig
from engine.model import Transformer

if TYPE_CHECKING:
    from gguf import GGUFReader  # at runtime gguf is imported only when a GGUF file is read

ProgressFn = Callable[[int, int], None]  # (tensors done, tensors total)

_GGUF_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def open_gguf(path: Path) -> GGUFReader:
    """A memory-mapped GGUF reader. Parsing the header takes seconds: open once, pass it around."""
    return plain_view_reader()(path)


@functools.cache
def plain_view_reader() -> type[GGUFReader]:
    import gguf

    class PlainViewReader(gguf.GGUFReader):
        """gguf's reader slices its np.memmap once per header value and per row group of a quantised
        tensor (~250,000 slices for SmolLM2's 49,152-token vocabulary and merges), and every slice of a
        memmap runs its Python __getitem__ and __array_finalize__ hooks: over half of the time SmolLM2
        took to open and dequantise. A plain ndarray view of the same mapping reads the same bytes without
        them (it keeps the memmap, and so the mapping, alive as its base)."""

        @property  # type: ignore[override]
        def data(self) -> np.ndarray[Any, Any]:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray[Any, Any]) -> None:
            self._plain_data = value.view(np.ndarray)

    return PlainViewReader


def gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All GGUF key/values as Python values (token lists included)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def load_config(path: Path, reader: GGUFReader | None = None) -> ModelConfig:
    """The model config of a .gguf file (pass its open reader if you have one) or an HF directory."""
    path = Path(path)
    if is_gguf(path):
        reader = reader or open_gguf(path)
        meta = {k: f.contents() for k, f in reader.fields.items() if k != "tokenizer.ggml.merges"}
        config = ModelConfig.from_gguf_metadata(meta, name=path.stem)
        tied = not any(t.name == "output.weight" for t in reader.tensors)
        config = config.with_(tie_word_embeddings=tied)
        freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
        if freqs is not None:  # Llama 3.1+ GGUFs carry their RoPE scaling as per-frequency divisors
            factors = [float(f) for f in np.asarray(freqs.data, dtype=np.float32).reshape(-1)]
            config = config.with_(rope_scaling={"rope_type": "freq_factors", "factors": factors})
        return config
    hf = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf(hf, name=path.name)
    gen = path / "generation_config.json"
    if gen.exists():  # generation_config's eos list is the one chat models stop on
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            config = config.with_(eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,))
    return config


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time Q/K row permutation (interleaved -> HF half-split rotary layout)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_gguf_tensors(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(HF name, fp32 tensor, total tensor count) for every tensor of an open GGUF file, dequantised."""
    import gguf

    arch = reader.fields["general.architecture"].contents()
    for t in reader.tensors:
        m = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)", t.name)
        if not m or m.group(2) not in _GGUF_NAMES:
            continue  # e.g. rope_freqs: recomputed from the config
        layer, kind, suffix = m.groups()
        name = _GGUF_NAMES[kind] + "." + suffix
        if layer is not None:
            name = f"model.layers.{layer}.{name}"
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        tensor = torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy, off the memmap
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            tensor = _unpermute_rope(tensor, config.num_heads if kind == "attn_q" else config.num_kv_heads)
        yield name, tensor, len(reader.tensors)


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor, int]]:
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    handles = [safe_open(f, framework="pt") for f in files]
    total = sum(len(h.keys()) for h in handles)
    for h in handles:
        for name in h.keys():  # noqa: SIM118 (safe_open is not a mapping)
            yield name, h.get_tensor(name), total


def load_weights(
    model: Transformer, tensors: Iterator[tuple[str, torch.Tensor, int]], progress: ProgressFn | None = None
) -> None:
    """Copy HF-named tensors into `model`, fusing q/k/v and gate/up. Fails on missing or unknown names."""
    config = model.config
    params = dict(model.named_parameters())
    d = config.head_dim or 0
    q, kv, inter = config.num_heads * d, config.num_kv_heads * d, config.intermediate_size
    # HF name suffix -> (our name suffix, row offset in the fused tensor)
    fused = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", q),
        "self_attn.v_proj": ("self_attn.qkv_proj", q + kv),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", inter),
    }
    missing = {n for n in params if not (n == "lm_head.weight" and config.tie_word_embeddings)}
    done = 0
    with torch.no_grad():
        for hf_name, tensor, total in tensors:
            name = hf_name.removeprefix("model.")
            offset = 0
            for src, (dst, off) in fused.items():
                if f".{src}." in name:
                    name, offset = name.replace(src, dst), off
                    break
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # tied: the embedding is the head
            if name not in params:
                raise KeyError(f"unexpected tensor {hf_name!r} in checkpoint")
            target = params[name]
            target[offset : offset + tensor.shape[0]].copy_(tensor)
            missing.discard(name)
            done += 1
            if progress:
                progress(done, total)
    if missing:
        raise KeyError(f"checkpoint lacks {sorted(missing)[:5]}")


def tqdm_progress(desc: str) -> ProgressFn:
    """A progress callback that draws a tqdm bar on stderr."""
    from tqdm import tqdm

    bar: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if "bar" not in bar:
            bar["bar"] = tqdm(total=total, desc=desc, unit="tensor", leave=False)
        bar["bar"].update(1)
        if done >= total:
            bar["bar"].close()

    return update


def build_model(
    config: ModelConfig,
    source: Path | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    progress: ProgressFn | None = None,
    reader: GGUFReader | None = None,
) -> Transformer:
    """A model with weights from `source` (a .gguf file, whose open reader may be passed, or an HF
    directory) or random ones if None."""
    if source is None:
        torch.manual_seed(seed)
        model = Transformer(config)  # default PyTorch init: peaked enough logits for meaningful tests
        with torch.no_grad():
            model.embed_tokens.weight.normal_(0.0, 1.0)
            if not config.tie_word_embeddings:
                model.lm_head.weight.normal_(0.0, 2.0 / config.hidden_size**0.5)
    else:
        with torch.device("meta"):
            model = Transformer(config)
        model.to_empty(device="cpu")
        model.rotary = type(model.rotary)(config)  # buffers are computed, not loaded
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        source = Path(source)
        tensors = (
            iter_gguf_tensors(reader or open_gguf(source), config)
            if is_gguf(source)
            else iter_safetensors(source)
        )
        load_weights(model, tensors, progress)
    model = model.to(device=device, dtype=dtype).eval()
    model.rotary.float()  # rotary tables stay fp32 whatever the weights' dtype
    return model
