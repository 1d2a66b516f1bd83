"""Model names resolve to local files; the models folder is listed and cleaned; errors say what to do."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import registry


@pytest.fixture
def models_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("WEIR_MODELS_DIR", str(tmp_path))
    return tmp_path


def test_a_registry_name_that_is_not_pulled_says_how_to_get_it(models_dir: Path) -> None:
    with pytest.raises(registry.ModelNotFoundError, match="weir models pull smollm2-135m"):
        registry.resolve("smollm2-135m")
    with pytest.raises(registry.ModelNotFoundError, match="unknown model 'gpt-9'"):
        registry.resolve("gpt-9")
    assert registry.list_local() == []


def test_pulled_files_resolve_by_name_and_alias(models_dir: Path) -> None:
    entry = registry.REGISTRY["smollm2-135m"]
    target = models_dir / "smollm2-135m" / entry.filename
    target.parent.mkdir()
    target.write_bytes(b"GGUF" + b"\0" * 60)
    assert registry.resolve("smollm2-135m") == target
    assert registry.resolve("smollm2") == target
    hf = models_dir / "my-llama"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    assert registry.resolve("my-llama") == hf
    assert [(m.name, m.format, m.size_bytes) for m in registry.list_local()] == [
        ("smollm2-135m", "gguf", 64),
        ("my-llama", "hf", 2),
    ]
    assert registry.remove("my-llama") and not registry.remove("my-llama")
    assert [m.name for m in registry.list_local()] == ["smollm2-135m"]


def test_explicit_paths_win(tmp_path: Path, models_dir: Path) -> None:
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF")
    assert registry.resolve(f) == f
    assert registry.resolve(str(f)) == f


def test_pull_rejects_unknown_names(models_dir: Path) -> None:
    with pytest.raises(registry.ModelNotFoundError, match="known: smollm2-135m"):
        registry.pull("nope")
