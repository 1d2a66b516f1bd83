"""`weir engine serve` and `weir models` as a user runs them: real processes, real HTTP, the openai SDK."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner

from tests.fixtures.net import free_port
from weir.cli import main

ROOT = Path(__file__).resolve().parents[2]


def weir(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(Path(sys.executable).with_name("weir")), *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def tiny_hf_model(path: Path) -> Path:
    """A Hugging Face model directory (config.json, safetensors, tokenizer.json) with random weights."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    tokenizer.train_from_iterator(["hello world, the weir serves tokens"] * 10, trainer)
    path.mkdir()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.token_to_id("<|im_end|>"),
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def wait_healthy(proc: subprocess.Popen[str], url: str, timeout: float = 120) -> list[int]:
    """Polls /health until 200; returns every status seen (503 while loading)."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            status = httpx.get(f"{url}/health", timeout=2).status_code
        except httpx.TransportError:
            status = 0  # not listening yet
        seen.append(status)
        if status == 200:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"not healthy after {timeout}s: {seen[-5:]}")


@pytest.mark.slow
def test_engine_serve_a_hugging_face_directory(tmp_path: Path) -> None:
    model_dir = tiny_hf_model(tmp_path / "tiny-llama")
    port = free_port()
    proc = weir(
        "engine",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--served-model-name",
        "tiny-llama",
        "--num-kv-blocks",
        "32",
        "--max-num-seqs",
        "4",
        "--threads",
        "1",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-llama"]
        resp = client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": "hello world"}],
            max_tokens=5,
            temperature=0,
        )
        assert resp.usage and resp.usage.completion_tokens <= 5 and resp.usage.prompt_tokens > 2
        assert resp.choices[0].finish_reason in ("stop", "length")
        # --model as given is accepted as an alias of the served name
        assert client.completions.create(model=str(model_dir), prompt="hello", max_tokens=2).choices
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output
    assert "ready" in output


@pytest.mark.parametrize(
    ("model", "status", "said"),
    [
        ("no-such-model", os.EX_CONFIG, "unknown model 'no-such-model'"),
        ("not-a-model.gguf", 1, "GGUF magic invalid"),
    ],
)
def test_engine_serve_exits_non_zero_when_the_model_cannot_load(
    tmp_path: Path, model: str, status: int, said: str
) -> None:
    """A model that is not there exits os.EX_CONFIG, which a supervisor does not retry (a missing
    file stays missing); another failure to load exits 1."""
    (tmp_path / "not-a-model.gguf").write_bytes(b"not a model")
    proc = weir(
        "engine",
        "serve",
        "--model",
        str(tmp_path / model) if model.endswith(".gguf") else model,
        "--port",
        str(free_port()),
        env={"WEIR_MODELS_DIR": str(tmp_path)},
    )
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == status, output
    assert said in output


def test_models_list_shows_known_models_not_pulled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_MODELS_DIR", str(tmp_path))
    result = CliRunner().invoke(main, ["models", "list"])
    assert result.exit_code == 0, result.output
    assert "smollm2-135m" in result.output and "weir models pull smollm2-135m" in result.output


@pytest.mark.parametrize("under", [False, True])
def test_models_list_says_when_the_models_directory_is_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, under: bool
) -> None:
    """Every model was listed as not pulled, with a `weir models pull` hint that could only fail."""
    file = tmp_path / "models"
    file.write_text("")
    root = file / "weir" if under else file
    monkeypatch.setenv("WEIR_MODELS_DIR", str(root))
    result = CliRunner().invoke(main, ["models", "list"])
    assert result.exit_code == 1
    assert result.output == (
        f"Error: models directory {root} (WEIR_MODELS_DIR): {file} is a file, not a directory; "
        "point WEIR_MODELS_DIR at a directory\n"
    )


def test_models_pull_unknown_name_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_MODELS_DIR", str(tmp_path))
    result = CliRunner().invoke(main, ["models", "pull", "gpt-5"])
    assert result.exit_code == 1
    assert "unknown model 'gpt-5'" in result.output


@pytest.mark.slow
def test_models_pull_downloads_smollm2_and_lists_it(tmp_path: Path) -> None:
    env = {"WEIR_MODELS_DIR": str(tmp_path)}
    pull = weir("models", "pull", "smollm2-135m", env=env)
    output = pull.communicate(timeout=600)[0]
    assert pull.returncode == 0, output
    gguf = tmp_path / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.is_file() and gguf.stat().st_size > 50_000_000
    assert gguf.read_bytes()[:4] == b"GGUF"
    listing = weir("models", "list", env=env).communicate(timeout=60)[0]
    assert "smollm2-135m" in listing and "gguf" in listing and str(gguf) in listing
    again = weir("models", "pull", "smollm2-135m", env=env)  # idempotent: no second download
    assert again.communicate(timeout=60)[0].strip().endswith(str(gguf))


def test_engine_serve_log_format_json_writes_nothing_but_json_lines(tmp_path: Path) -> None:
    """What the gateway asks of the engines it starts: their output shares its stdout, JSON lines."""
    args = ["engine", "serve", "--model", "no-such-model", "--port", str(free_port()), "--log-format", "json"]
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("weir")), *args],
        cwd=ROOT,
        env={**os.environ, "WEIR_MODELS_DIR": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == os.EX_CONFIG
    assert err == ""
    lines = [json.loads(line) for line in out.splitlines()]  # a line that is not JSON fails here
    listening = [line for line in lines if line["event"].startswith("listening on")]
    assert listening and listening[0]["logger"] == "engine.server" and listening[0]["level"] == "info"
    failed = [line for line in lines if line["level"] == "error"]
    assert failed and "unknown model 'no-such-model'" in failed[0]["event"]


def test_engine_serve_port_0_logs_the_port_it_bound(tmp_path: Path) -> None:
    """`--port 0` lets the system choose: the log line says which port, and /health answers on it."""
    model_dir = tiny_hf_model(tmp_path / "tiny-llama")
    proc = weir("engine", "serve", "--model", str(model_dir), "--port", "0", "--log-format", "json")
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the line comes before the model loads
            event = json.loads(line)["event"]
            if event.startswith("listening on"):
                break
        port = int(event.removeprefix("listening on http://127.0.0.1:").split(",")[0])
        assert port != 0, event
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code in (200, 503)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--block-size", "0", "0 is not in the range x>=1"),  # "integer division or modulo by zero"
        ("--threads", "0", "0 is not in the range x>=1"),  # a RuntimeError traceback from torch
        ("--num-kv-blocks", "0", "0 is not in the range x>=1"),
        ("--max-model-len", "0", "0 is not in the range x>=1"),  # served the model's full length
        ("--kv-cache-memory", "-1", "-1.0 is not in the range x>0"),  # served with a 16-token window
        ("--kv-cache-memory", "nan", "must be a number, not NaN"),
        ("--speculative", "bogus", "unknown speculative method 'bogus'"),
        ("--speculative", "self:layers=0", "unknown speculative method 'self:layers=0'"),
    ],
)
def test_engine_serve_refuses_a_bad_value_before_loading_the_model(
    option: str, value: str, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each was taken, and either failed once the model had loaded (minutes for a large one; a
    traceback for --threads), or served something other than what was asked (0 as unset, a negative
    cache size as a tiny one): a usage error now, naming the option, and nothing loads."""
    import engine.server

    loaded: list[str] = []
    monkeypatch.setattr(engine.server, "run", lambda model, **_: loaded.append(model) or 0)
    result = CliRunner().invoke(main, ["engine", "serve", option, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output and message in result.output, result.output
    assert loaded == []
