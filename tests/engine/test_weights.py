"""Loading checkpoints: a Hugging Face directory (safetensors) and a GGUF file, each checked token for
token against transformers running the same weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
TEXT = ["the quick brown fox jumps over the lazy dog", "hello world, hello engine", "tokens and more tokens"]


def train_tokenizer(vocab_size: int = 300) -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT * 20, trainer)
    return tok


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def make_hf_model(kind: str, vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=10000.0)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 50000.0,
        }
        cfg = transformers.LlamaConfig(**common, rope_parameters=rope)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper than the default init, so greedy paths are well separated
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_directory_matches_transformers(tmp_path: Path, kind: str) -> None:
    tok = train_tokenizer()
    model = make_hf_model(kind, tok.get_vocab_size())
    model.save_pretrained(tmp_path, safe_serialization=True)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>"}')

    engine = LLMEngine(tmp_path, device="cpu", num_kv_blocks=64, progress=False)
    assert engine.tokenizer.eos_token_ids == {tok.token_to_id("<|im_end|>")}
    prompts = [engine.tokenizer.encode(t) for t in TEXT]
    assert prompts[0] == tok.encode(TEXT[0]).ids
    ours = engine.generate(prompts, GREEDY)
    assert ours == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    hidden = engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert hidden == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # ChatML fallback


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    tok: HFTokenizer,
    theta: float = 10000.0,
    freq_factors: list[float] | None = None,
) -> None:
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(theta)
    if freq_factors is not None:  # how llama.cpp stores Llama 3 RoPE scaling
        w.add_tensor("rope_freqs.weight", np.asarray(freq_factors, dtype=np.float32))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t.startswith("<|") else 1 for t, _ in vocab])
    merges = __import__("json").loads(tok.to_str())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_eos_token_id(tok.token_to_id("<|im_end|>"))
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    names = {
        "q_proj": "attn_q",
        "k_proj": "attn_k",
        "v_proj": "attn_v",
        "o_proj": "attn_output",
        "gate_proj": "ffn_gate",
        "up_proj": "ffn_up",
        "down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for name, tensor in model.state_dict().items():
        a = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            out = "output.weight"
        else:
            parts = name.split(".")  # model.layers.N.(self_attn|mlp).X.weight or model.layers.N.X.weight
            key = parts[-2]
            out = f"blk.{parts[2]}.{names[key]}.weight"
            if key == "q_proj":
                a = _llama_cpp_permute(a, cfg.num_attention_heads)
            elif key == "k_proj":
                a = _llama_cpp_permute(a, cfg.num_key_value_heads)
        if out == "blk.0.ffn_down.weight":  # one quantised tensor exercises dequantisation
            w.add_tensor(
                out,
                gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
            with torch.no_grad():  # give transformers the same rounded weights
                deq = gguf.quants.dequantize(
                    gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
                )
                model.model.layers[0].mlp.down_proj.weight.copy_(torch.from_numpy(deq))
        else:
            w.add_tensor(out, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_gguf_file_is_read_through_a_plain_view_of_its_mapping(tmp_path: Path) -> None:
    """open_gguf reads what gguf's own reader does, but hands out no np.memmap slices: each one ran
    memmap's Python hooks, over half of the time a real model's header and weights took to read."""
    import gguf

    from engine.weights import open_gguf

    path = tmp_path / "plain.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list([f"tok{i}" for i in range(500)])
    w.add_token_merges([f"t o{i}" for i in range(300)])
    w.add_block_count(2)
    weight = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    w.add_tensor(
        "blk.0.ffn_down.weight",
        gguf.quants.quantize(weight, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    w.add_tensor("output_norm.weight", weight[0])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    assert {k: f.contents() for k, f in ours.fields.items()} == {
        k: f.contents() for k, f in theirs.fields.items()
    }
    assert ours.fields["tokenizer.ggml.tokens"].contents()[499] == "tok499"
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type) == (ref.name, ref.tensor_type)
        np.testing.assert_array_equal(
            gguf.quants.dequantize(mine.data, mine.tensor_type),
            gguf.quants.dequantize(ref.data, ref.tensor_type),
        )
    assert type(ours.data) is np.ndarray
    parts = [p for f in ours.fields.values() for p in f.parts] + [t.data for t in ours.tensors]
    assert not [p for p in parts if isinstance(p, np.memmap)]


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_gguf_file_matches_transformers(tmp_path: Path, rope: str) -> None:
    tok = train_tokenizer()
    model = make_hf_model("llama", tok.get_vocab_size())  # llama3 RoPE scaling, theta 50000
    factors = None
    if rope == "default":
        model.config.rope_parameters = {"rope_type": "default", "rope_theta": 50000.0}
        model = transformers.LlamaForCausalLM(model.config).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.15)
    else:
        from engine.config import ModelConfig
        from engine.model import rope_inv_freq

        ours = ModelConfig.from_hf(model.config.to_dict())
        factors = (rope_inv_freq(ours.with_(rope_scaling=None)) / rope_inv_freq(ours)).tolist()
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, tok, theta=50000.0, freq_factors=factors)

    engine = LLMEngine(path, device="cpu", num_kv_blocks=64, progress=False)
    assert engine.model_name == "tiny"
    assert engine.tokenizer.encode(TEXT[1]) == tok.encode(TEXT[1]).ids
    assert engine.tokenizer.decode(tok.encode(TEXT[1]).ids) == TEXT[1]
    assert engine.tokenizer.encode("<|im_start|>") == [tok.token_to_id("<|im_start|>")]
    prompts = [engine.tokenizer.encode(t) for t in TEXT]
    assert engine.generate(prompts, GREEDY) == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]


def test_bfloat16_engine_runs_and_mostly_agrees(tmp_path: Path) -> None:
    tok = train_tokenizer()
    model = make_hf_model("llama", tok.get_vocab_size())
    model.save_pretrained(tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    fp32 = LLMEngine(tmp_path, device="cpu", num_kv_blocks=64, progress=False)
    bf16 = LLMEngine(tmp_path, device="cpu", num_kv_blocks=64, progress=False, dtype="bfloat16")
    assert bf16.model.embed_tokens.weight.dtype == torch.bfloat16
    prompt = fp32.tokenizer.encode(TEXT[0])
    a = fp32.generate([prompt], GREEDY)[0]
    b = bf16.generate([prompt], GREEDY)[0]
    assert a[:3] == b[:3]


def test_unsupported_dtype_and_missing_model_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype"):
        LLMEngine("tiny", dtype="int3")
    from engine.registry import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="unknown model"):
        LLMEngine(str(tmp_path / "nope"), progress=False)
