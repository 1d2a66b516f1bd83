"""Print the runtime requirements declared in pyproject.toml, one per line, for the image builds.

The images install dependencies in their own layer before copying the source (so a code change does
not reinstall torch), and torch separately from a variant-specific index. Reading pyproject.toml here
keeps it the one place where versions are pinned.

    python requirements.py pyproject.toml --only torch      # the torch pin alone
    python requirements.py pyproject.toml --except torch    # everything else
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path


def requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(0)).lower()


def runtime_requirements(pyproject: Path) -> list[str]:
    with pyproject.open("rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pyproject", type=Path)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--only", action="append", default=[], metavar="NAME")
    which.add_argument("--except", dest="exclude", action="append", default=[], metavar="NAME")
    args = parser.parse_args(argv)
    only = {requirement_name(n) for n in args.only}
    exclude = {requirement_name(n) for n in args.exclude}
    selected = [
        r
        for r in runtime_requirements(args.pyproject)
        if (not only or requirement_name(r) in only) and requirement_name(r) not in exclude
    ]
    missing = only - {requirement_name(r) for r in selected}
    if missing:
        print(f"not in pyproject.toml dependencies: {', '.join(sorted(missing))}", file=sys.stderr)
        return 1
    print("\n".join(selected))
    return 0


if __name__ == "__main__":
    sys.exit(main())
