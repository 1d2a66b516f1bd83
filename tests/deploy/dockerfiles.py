"""Parsed Dockerfiles (dockerfile-parse) split into stages, the .dockerignore matcher Docker uses, and an
image's HEALTHCHECK as a command line to run here."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dockerfile_parse import DockerfileParser


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, value)

    def values(self, instruction: str) -> list[str]:
        return [v for i, v in self.instructions if i == instruction]


@dataclass
class Dockerfile:
    args: dict[str, str]  # ARGs declared before the first FROM, with their defaults
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        (stage,) = [s for s in self.stages if s.name == name]
        return stage

    def final_chain(self, build_args: dict[str, str] | None = None) -> list[Stage]:
        """The stages the final image inherits from, last first, with build args applied."""
        args = {**self.args, **(build_args or {})}
        chain = [self.stages[-1]]
        while True:
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], chain[-1].base)
            named = [s for s in self.stages if s.name == base]
            if not named:
                return chain
            chain.append(named[0])


def parse(path: Path) -> Dockerfile:
    parser = DockerfileParser(path=str(path))
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for item in parser.structure:
        instruction, value = item["instruction"], item["value"]
        if instruction == "COMMENT":
            continue
        if instruction == "FROM":
            parts = value.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=parts[0], name=name))
        elif not stages:
            assert instruction == "ARG", f"{path.name}: {instruction} before the first FROM"
            key, _, default = value.partition("=")
            args[key] = default
        else:
            stages[-1].instructions.append((instruction, value))
    return Dockerfile(args=args, stages=stages)


def exec_form(value: str) -> list[str]:
    """CMD/ENTRYPOINT/HEALTHCHECK CMD in exec (JSON) form; the shell form is refused on purpose: it
    would run the process under /bin/sh, which does not forward SIGTERM for a graceful drain."""
    return json.loads(value)


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Whether Docker leaves `path` (relative to the context) out: the last matching pattern wins,
    and a pattern matching a parent directory excludes everything under it."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        regex = _pattern_regex(pattern.strip("/"))
        if any(regex.fullmatch(p) for p in prefixes):
            excluded = not negate
    return excluded


def read_dockerignore(path: Path) -> list[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out)


def healthcheck_argv(dockerfile: Path, port: int) -> list[str]:
    """The image's HEALTHCHECK command, aimed at `port` instead of the container's fixed one."""
    (healthcheck,) = parse(dockerfile).stages[-1].values("HEALTHCHECK")
    argv = exec_form(healthcheck.partition("CMD")[2].strip())
    argv = [a.replace("127.0.0.1:8080", f"127.0.0.1:{port}") for a in argv]
    return [sys.executable if a == "python" else a for a in argv]
