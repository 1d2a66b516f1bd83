"""`weir ARGS` run as a user runs it: the `weir` of this environment, in a process of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

WEIR = [str(Path(sys.executable).with_name("weir"))]


def run(args: list[str], stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`weir ARGS`, `stdin` on its standard input, its output captured."""
    return subprocess.run([*WEIR, *args], input=stdin, capture_output=True, text=True, timeout=timeout)
