"""The gateway and engine images (deploy/docker): multi-stage, non-root, health-checked, nothing secret
inside, and commands the real `weir` CLI accepts. No Docker engine runs here, so nothing is built:
the Dockerfiles are parsed and every fact they rely on is checked against the repository."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest

from tests.deploy.artefacts import DEPLOY, ROOT, SECRET_NAME
from tests.deploy.dockerfiles import (
    Dockerfile,
    dockerignore_excludes,
    exec_form,
    parse,
    read_dockerignore,
)
from tests.deploy.weir_cli import assert_cli_accepts

GATEWAY = DEPLOY / "docker" / "gateway.Dockerfile"
ENGINE = DEPLOY / "docker" / "engine.Dockerfile"
IMAGES = {"gateway": (GATEWAY, 8080, "/readyz"), "engine": (ENGINE, 8000, "/health")}


@pytest.fixture(params=sorted(IMAGES), scope="module")
def image(request: pytest.FixtureRequest) -> tuple[str, Dockerfile]:
    return request.param, parse(IMAGES[request.param][0])


def test_multi_stage_and_the_runtime_stage_carries_no_build_tools(image: tuple[str, Dockerfile]) -> None:
    _, dockerfile = image
    final = dockerfile.final_chain()
    assert len(dockerfile.stages) >= 2
    assert any(v.startswith("--from=build ") for v in final[0].values("COPY"))
    # The runtime image starts again from the slim base: the pip caches and build layers stay behind.
    assert final[-1].base.startswith("python:") and final[-1].base.endswith("-slim-bookworm")
    assert not any("pip install" in v for stage in final for v in stage.values("RUN"))


def test_runs_as_a_non_root_user(image: tuple[str, Dockerfile]) -> None:
    _, dockerfile = image
    (user,) = dockerfile.stages[-1].values("USER")
    uid, _, gid = user.partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
    assert uid.isdigit() and int(uid) >= 1000 and (not gid or int(gid) >= 1000)
    assert any(f"--uid {uid}" in v for v in dockerfile.stages[-1].values("RUN"))


def test_health_check_and_command_agree_on_the_port(image: tuple[str, Dockerfile]) -> None:
    name, dockerfile = image
    _, port, path = IMAGES[name]
    final = dockerfile.stages[-1]
    (healthcheck,) = final.values("HEALTHCHECK")
    options, _, command = healthcheck.partition("CMD")
    probe = " ".join(exec_form(command.strip()))
    assert f"http://127.0.0.1:{port}{path}" in probe
    assert re.search(r"--start-period=\d+s", options)
    assert final.values("EXPOSE") == [str(port)]
    (cmd,) = final.values("CMD")
    argv = exec_form(cmd)
    assert argv[argv.index("--port") + 1] == str(port)
    assert argv[argv.index("--host") + 1] == "0.0.0.0"


def test_base_images_are_pinned(image: tuple[str, Dockerfile]) -> None:
    _, dockerfile = image
    version = dockerfile.args["PYTHON_VERSION"]
    assert re.fullmatch(r"3\.1[1-9]", version)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["requires-python"] == ">=3.11"
    for stage in dockerfile.stages:
        if ":" in stage.base or "/" in stage.base:
            assert not stage.base.endswith(":latest"), stage.base


def test_no_secret_is_baked_into_an_image(image: tuple[str, Dockerfile]) -> None:
    _, dockerfile = image
    for stage in dockerfile.stages:
        for instruction, value in stage.instructions:
            if instruction in ("ENV", "ARG"):
                names = re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=", value) or [value.split("=")[0]]
                assert not any(SECRET_NAME.search(n) for n in names), f"{instruction} {value}"
            if instruction == "COPY":
                assert ".env" not in value and "secret" not in value.lower(), value
    for name in dockerfile.args:
        assert not SECRET_NAME.search(name)


def test_the_command_is_one_the_real_cli_accepts(image: tuple[str, Dockerfile]) -> None:
    _, dockerfile = image
    (cmd,) = dockerfile.stages[-1].values("CMD")
    assert_cli_accepts(exec_form(cmd))


def test_engine_image_has_cpu_and_cuda_variants() -> None:
    dockerfile = parse(ENGINE)
    assert dockerfile.args["VARIANT"] == "cpu"
    chains = {v: [s.name for s in dockerfile.final_chain({"VARIANT": v})] for v in ("cpu", "cuda")}
    assert chains["cpu"] == ["runtime", "runtime-cpu"]
    assert chains["cuda"] == ["runtime", "runtime-cuda", "runtime-cpu"]
    # The build stage installs torch from the variant's index: the CPU wheels for cpu, PyPI's
    # CUDA-bundling Linux wheels for cuda.
    build = dockerfile.stage("build")
    assert build.base == "torch-${VARIANT}"
    cpu, cuda = dockerfile.stage("torch-cpu"), dockerfile.stage("torch-cuda")
    assert any("download.pytorch.org/whl/cpu" in v for v in cpu.values("RUN"))
    assert not any("whl/cpu" in v for v in cuda.values("RUN"))
    # a C compiler in both: the CPU engine's fused decode step, Triton's launcher (cuda builds on cpu)
    assert any("gcc" in v for v in dockerfile.stage("runtime-cpu").values("RUN"))
    # The gateway never needs CUDA: CPU torch only.
    gateway = parse(GATEWAY)
    assert any("download.pytorch.org/whl/cpu" in v for v in gateway.stage("build").values("RUN"))


def test_dependencies_come_from_pyproject_and_nowhere_else() -> None:
    script = DEPLOY / "docker" / "requirements.py"

    def run(*args: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, str(script), str(ROOT / "pyproject.toml"), *args],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return out.splitlines()

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = run("--only", "torch")
    assert len(torch) == 1 and torch[0].startswith("torch==")
    assert sorted(torch + run("--except", "torch")) == sorted(declared)
    missing = subprocess.run(
        [sys.executable, str(script), str(ROOT / "pyproject.toml"), "--only", "nonesuch"],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1 and "nonesuch" in missing.stderr
    # No version of any dependency is written in a Dockerfile.
    for path in (GATEWAY, ENGINE):
        assert not re.search(r"pip install[^\n]*==", path.read_text()), path.name
        # ... and they install at the versions the test suite passed with.
        assert re.search(r"pip install -c constraints\.txt -r /tmp/requirements\.txt", path.read_text())


def test_the_gateway_image_leaves_out_triton_and_serves_without_it() -> None:
    # Triton (about 1 GB: LLVM, ptxas) comes in with xgrammar; the gateway runs on CPU and never needs it.
    installs = " ".join(v for v in parse(GATEWAY).stage("build").values("RUN") if "requirements.txt" in v)
    assert re.search(
        r"pip install -c constraints\.txt -r /tmp/requirements\.txt.*pip uninstall -y triton", installs
    )
    # What the gateway runs, with Triton unimportable as in the image: the app, and the difficulty
    # classifier's encoder (its int8 path included) scoring a prompt.
    script = """
import sys
sys.modules["triton"] = sys.modules["triton.language"] = None  # `import triton` raises ImportError
import gateway.app, gateway.cli, kernels, weir.kernels.int8_matmul
from routing.minilm import MiniLMEmbedder
embedder = MiniLMEmbedder("deploy-test", num_layers=1, max_tokens=32)
assert embedder.pool([2000, 2001]).shape == (embedder.dim,)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_the_cpu_engine_image_leaves_out_triton_and_the_cuda_one_keeps_it() -> None:
    # The variant's build arg decides: the build stage's install line run with pip and python stubbed
    # (they print what they were asked), once per variant.
    build = parse(ENGINE).stage("build")
    assert "VARIANT" in build.values("ARG")
    (install,) = [v for v in build.values("RUN") if "requirements.txt" in v]
    stubs = 'pip() { echo "pip $*"; }; python() { echo "python $*"; }; '
    ran = {
        variant: subprocess.run(
            ["sh", "-c", stubs + install],
            env={"VARIANT": variant},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
        for variant in ("cpu", "cuda")
    }
    assert ran["cpu"] == [
        "pip install -c constraints.txt -r /tmp/requirements.txt",
        "pip uninstall -y triton",
    ]
    # The GPU image runs Weir's kernels on Triton: its build checks it is there rather than removing it.
    assert ran["cuda"] == [
        "pip install -c constraints.txt -r /tmp/requirements.txt",
        "python -c import triton",
    ]
    # What the CPU engine runs, with Triton unimportable as in the image: the server and its kernels,
    # and a generation on a tiny model under a JSON schema (xgrammar's token mask).
    script = """
import json, sys
sys.modules["triton"] = sys.modules["triton.language"] = None  # `import triton` raises ImportError
import engine.server, engine.cli, kernels
from engine.config import tiny_config
from engine.llm_engine import LLMEngine
from engine.sampling import JsonFormat, SamplingParams
llm = LLMEngine.from_config(tiny_config(), num_kv_blocks=64, device="cpu")
schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
llm.add_request("r", [5, 6, 7], SamplingParams(max_tokens=48, seed=0, json_format=JsonFormat(json.dumps(schema))))
tokens = []
while llm.has_unfinished_requests():
    tokens += [t for o in llm.step() for t in o.new_token_ids]
assert isinstance(json.loads(bytes(t for t in tokens if t).decode())["ok"], bool), tokens
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_the_build_context_keeps_what_the_image_needs_and_nothing_secret() -> None:
    patterns = read_dockerignore(ROOT / ".dockerignore")
    needed = [
        "pyproject.toml",
        "constraints.txt",
        "README.md",
        "alembic.ini",
        "migrations/env.py",
        "gateway/config.py",
        "engine/__init__.py",
        "routing/__init__.py",
        "kernels/native.py",
        "weir/kernels/native.py",  # kernels/ is imported as weir.kernels through this link
        "weir/cli.py",
        "deploy/docker/requirements.py",
    ]
    for path in needed:
        assert not dockerignore_excludes(patterns, path), f"{path} is left out of the build context"
        assert (ROOT / path).exists(), path
    for path in [
        ".env",
        "deploy/.env",
        "deploy/k8s/secrets.env",
        "deploy/secrets/weir_admin_token",
        ".git/config",
        ".venv/bin/python",
        "var/weir.db",
        "tests/conftest.py",
        "gateway/__pycache__/x.pyc",
        "id.pem",
    ]:
        assert dockerignore_excludes(patterns, path), f"{path} would be sent to the builder"
    # Every COPY source from the context exists and survives the ignore file.
    for dockerfile in (parse(GATEWAY), parse(ENGINE)):
        for stage in dockerfile.stages:
            for value in stage.values("COPY"):
                if value.startswith("--from="):
                    continue
                *sources, _ = value.split()
                for source in sources:
                    if source != ".":
                        assert (ROOT / source).exists() and not dockerignore_excludes(patterns, source), (
                            source
                        )


def test_the_engine_image_pulls_and_serves_a_model_the_registry_knows() -> None:
    from engine.registry import REGISTRY, canonical_name

    dockerfile = parse(ENGINE)
    build = dockerfile.stage("build")
    (model_arg,) = [v for v in build.values("ARG") if v.startswith("MODEL=")]
    model = model_arg.split("=", 1)[1]
    assert canonical_name(model) in REGISTRY
    assert any('weir models pull "$MODEL"' in v for v in build.values("RUN"))
    # Pulled where the runtime looks for it.
    (models_dir,) = {
        v.split("WEIR_MODELS_DIR=")[1].split()[0] for v in build.values("ENV") if "WEIR_MODELS_DIR" in v
    }
    runtime_env = " ".join(dockerfile.stages[-1].values("ENV"))
    assert f"WEIR_MODELS_DIR={models_dir}" in runtime_env
    assert any(v == "--from=build /opt/weir /opt/weir" for v in dockerfile.stages[-1].values("COPY"))
    assert models_dir.startswith("/opt/weir/")
    (cmd,) = dockerfile.stages[-1].values("CMD")
    argv = exec_form(cmd)
    assert canonical_name(argv[argv.index("--model") + 1]) == canonical_name(model)
