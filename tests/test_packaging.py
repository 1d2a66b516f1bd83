"""What the distribution installs: import names no other package claims, and kernels/ as weir.kernels.

transformers >= 5.25 depends on Hugging Face's ``kernels`` package and imports it whenever it is
installed; a top-level ``kernels`` of ours shadowed it (and would overwrite it in site-packages)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_other_installed_distribution_provides_our_top_level_packages() -> None:
    ours = importlib.metadata.distribution("weir").read_text("top_level.txt")
    assert ours is not None
    names = ours.split()
    assert "weir" in names and "kernels" not in names
    providers = importlib.metadata.packages_distributions()
    for name in names:
        assert set(providers.get(name, [])) == {"weir"}, (name, providers[name])


def test_the_kernels_directory_does_not_shadow_a_top_level_kernels_package() -> None:
    # The checkout's root is on sys.path under pytest, as it is for `python -m weir` run from it.
    assert str(ROOT) in sys.path or "" in sys.path
    spec = importlib.util.find_spec("kernels")
    if spec is not None:
        assert spec.origin is None or not Path(spec.origin).is_relative_to(ROOT / "kernels"), spec.origin
    native = importlib.util.find_spec("weir.kernels.native")
    assert native is not None and native.origin is not None
    assert Path(native.origin).resolve() == ROOT / "kernels" / "native.py"


def test_the_wheel_ships_kernels_as_weir_kernels_with_their_c_sources(tmp_path: Path) -> None:
    # Build from a copy of the tracked files so the checkout gets no build/ or egg-info of this test's.
    tracked = subprocess.run(
        [
            "git",
            "ls-files",
            "pyproject.toml",
            "README.md",
            "LICENSE",
            "weir",
            "kernels",
            "engine",
            "gateway",
            "routing",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    source = tmp_path / "src"
    for name in tracked:
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, target, follow_symlinks=False)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=source,
        capture_output=True,
        check=True,
    )
    (wheel,) = tmp_path.glob("weir-*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    assert not [f for f in files if f.startswith("kernels/")]
    shipped = {f.removeprefix("weir/kernels/") for f in files if f.startswith("weir/kernels/")}
    expected = {p.name for p in (ROOT / "kernels").iterdir() if p.suffix in {".py", ".c", ".h"}}
    assert "native.py" in expected and "cpu_ops.c" in expected and "cpu_simd.h" in expected
    assert shipped == expected
    assert {f.split("/")[0] for f in files if not f.startswith("weir-")} == {
        "weir",
        "engine",
        "gateway",
        "routing",
    }
