"""The real SmolLM2-135M-Instruct (GGUF Q4_1/Q8_0, dequantised to fp32) against Hugging Face
transformers loading the same file: identical greedy tokens, identical tokenization and chat prompt."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

from engine import registry
from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from engine.weights import plain_view_reader

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
    "Translate 'good morning' into Spanish.",
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return registry.pull("smollm2-135m", quiet=True)  # a no-op once downloaded


@pytest.fixture(scope="module")
def engine(gguf_path: Path) -> LLMEngine:
    return LLMEngine("smollm2-135m", device="cpu", num_kv_blocks=256, progress=False)


@pytest.fixture(scope="module")
def hf(gguf_path: Path) -> tuple[object, object]:
    import gguf

    # transformers parses the file with gguf.GGUFReader for the tokenizer, then for the config and the
    # weights: each time through np.memmap slices, most of this fixture's time. It reads the same
    # bytes through the engine's plain view of the mapping (test_weights checks the two readers agree).
    with mock.patch.object(gguf, "GGUFReader", plain_view_reader()):
        tok = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        ).eval()
    return tok, model


def test_greedy_tokens_match_transformers(engine: LLMEngine, hf: tuple) -> None:  # type: ignore[type-arg]
    tok, model = hf
    tokenizer = engine.tokenizer
    prompts = []
    for q in QUESTIONS:
        messages = [{"role": "user", "content": q}]
        text = tokenizer.apply_chat_template(messages)
        assert text == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text)
        assert ids == tok.encode(text, add_special_tokens=False)
        prompts.append(ids)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    ours = engine.generate(prompts, params)  # all four in one continuous batch
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            # an explicit mask: <|im_end|> doubles as the pad token, and generate() would mask it out
            ref = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )[0, len(prompt) :].tolist()
        assert got == ref, (tokenizer.decode(got), tok.decode(ref))
    assert "Paris" in tokenizer.decode(ours[0])


def test_chat_stops_at_im_end(engine: LLMEngine) -> None:
    tokenizer = engine.tokenizer
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}]))
    out = engine.generate([ids], SamplingParams(max_tokens=64, temperature=0))[0]
    assert out[-1] in tokenizer.eos_token_ids == {2}
    assert tokenizer.decode(out).strip()


def test_long_prompt_in_one_step_matches_transformers(gguf_path: Path, hf: tuple) -> None:  # type: ignore[type-arg]
    """A ~1,000-token prompt prefilled in one step: the CPU path that runs the MLP in row blocks."""
    tok, model = hf
    engine = LLMEngine(
        "smollm2-135m", device="cpu", num_kv_blocks=128, max_num_batched_tokens=1024, progress=False
    )
    facts = " ".join(f"Fact {i}: the number {i} squared is {i * i}." for i in range(1, 58))
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": f"{facts} What is 7 squared?"}])
    prompt = engine.tokenizer.encode(text)
    assert 900 < len(prompt) <= 1024
    got = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
        )[0, len(prompt) :].tolist()
    assert got == ref, (tok.decode(got), tok.decode(ref))


def test_a_json_schema_answer_from_the_real_model(engine: LLMEngine) -> None:
    """The byte-level BPE vocabulary (49,152 tokens, "Ġ" for spaces) through the grammar, end to end."""
    import json

    from engine.sampling import JsonFormat

    tok = engine.tokenizer
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    messages = [{"role": "user", "content": "Describe a cat as JSON with a name and an age."}]
    prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    params = SamplingParams(max_tokens=48, temperature=0, json_format=JsonFormat(json.dumps(schema)))
    [out] = engine.generate([prompt], params)
    value = json.loads(tok.decode(out))
    assert isinstance(value["name"], str) and isinstance(value["age"], int) and set(value) == {"name", "age"}
    assert out[-1] in tok.eos_token_ids and len(out) < 48  # it stopped when the object was complete
