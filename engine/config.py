"""Model configuration: one dataclass for every Llama-family model, plus a name table of known models."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # None: hidden_size // num_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict ({"rope_type": "llama3", "factor": ..., ...} or "linear"); None: plain RoPE
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def num_params(self) -> int:
        h, d = self.hidden_size, self.head_dim or 0
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * h * self.intermediate_size
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * h) + emb + h

    def with_(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "custom") -> ModelConfig:
        """Build from a Hugging Face `config.json` (Llama, Mistral, Qwen2, SmolLM2)."""
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        heads = cfg["num_attention_heads"]
        # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` + `rope_scaling`
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = cfg.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0
        rope.pop("rope_theta", None)
        scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], name: str = "custom") -> ModelConfig:
        """Build from GGUF key/values (`llama.*`, `qwen2.*`)."""
        arch = meta["general.architecture"]

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        hidden = get("embedding_length")
        heads = get("attention.head_count")
        scaling = None
        if get("rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
        eos = meta.get("tokenizer.ggml.eos_token_id")
        vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv") or heads,
            head_dim=get("rope.dimension_count") or hidden // heads,
            rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=get("rope.freq_base", 10000.0),
            rope_scaling=scaling,
            max_position_embeddings=get("context_length", 2048),
            tie_word_embeddings=False,  # decided by the loader: no `output.weight` tensor means tied
            attention_bias=arch == "qwen2",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(eos,) if eos is not None else (),
            name=name,
        )


# Known models by short name. Real checkpoints bring their own config; these entries let tests and
# benchmarks build the same shapes with random weights, and give the registry a canonical name.
KNOWN_MODELS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_ids=(0,),
        name="tiny",
    ),
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="smollm2-135m",
    ),
    "smollm2-360m": ModelConfig(
        vocab_size=49152,
        hidden_size=960,
        intermediate_size=2560,
        num_layers=32,
        num_heads=15,
        num_kv_heads=5,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        name="smollm2-360m",
    ),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=True,
        bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009),
        name="llama-3.2-1b",
    ),
}


def tiny_config(**changes: Any) -> ModelConfig:
    """The tiny random-weight config used by tests (byte-level vocabulary, no tokenizer file)."""
    return KNOWN_MODELS["tiny"].with_(**changes)
