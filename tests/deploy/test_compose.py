"""deploy/compose.yaml: valid against the Compose specification, and the one-host topology a user
expects: migrations once before 2 gateway replicas, health-gated start-up, secrets only as files."""

from __future__ import annotations

import json
import os
import re
import subprocess
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import redis

from tests.deploy.artefacts import DEPLOY, SECRET_NAME, load_yaml
from tests.deploy.compose_env import (
    SECRETS_MOUNT,
    at_secrets,
    example_env,
    interpolate,
    new_secrets,
    variables,
)
from tests.deploy.dockerfiles import exec_form, parse
from tests.deploy.kustomize import parse_env_file
from tests.deploy.processes import redis_server
from tests.deploy.weir_cli import assert_cli_accepts

COMPOSE_DIR = DEPLOY  # the project directory: relative paths and .env resolve from here
LONG_RUNNING = {"postgres", "redis", "engine", "gateway", "lb", "prometheus", "grafana"}


def test_compose_file_is_valid_against_the_compose_specification(compose: dict[str, Any]) -> None:
    schema = json.loads(
        files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    )
    jsonschema.validate(compose, schema)
    gpu = load_yaml(DEPLOY / "compose.gpu.yaml")
    jsonschema.validate(gpu, schema)
    assert gpu["services"]["engine"]["build"]["args"]["VARIANT"] == "cuda"
    devices = gpu["services"]["engine"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_the_one_host_topology(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == LONG_RUNNING | {"migrate"}
    assert services["gateway"]["deploy"]["replicas"] == 2
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["redis"]["image"].startswith("redis:")
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    assert services["grafana"]["image"].startswith("grafana/")
    # The gateways and the migration run the same image, so the schema matches the code.
    assert services["migrate"]["image"] == services["gateway"]["image"]
    assert services["migrate"]["build"] == services["gateway"]["build"]
    # Only the load balancer, Prometheus and Grafana publish ports; the last two on loopback only.
    published = {name for name, s in services.items() if s.get("ports")}
    assert published == {"lb", "prometheus", "grafana"}
    for name in ("prometheus", "grafana"):
        assert all(str(p).startswith("127.0.0.1:") for p in services[name]["ports"])


def test_migrations_run_once_before_any_gateway_starts(compose: dict[str, Any]) -> None:
    services = compose["services"]
    migrate = services["migrate"]
    assert migrate["command"] == ["weir", "db", "upgrade"]
    assert migrate["restart"] == "no"
    assert "deploy" not in migrate  # exactly one container
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    gateway = services["gateway"]["depends_on"]
    assert gateway["migrate"]["condition"] == "service_completed_successfully"
    assert gateway["postgres"]["condition"] == "service_healthy"
    assert gateway["redis"]["condition"] == "service_healthy"
    assert services["lb"]["depends_on"]["gateway"]["condition"] == "service_healthy"
    # Both talk to the same database.
    url = "WEIR_DATABASE_URL_FILE"
    assert (
        migrate["environment"][url] == services["gateway"]["environment"][url] == "/run/secrets/database_url"
    )
    assert "database_url" in migrate["secrets"] and "database_url" in services["gateway"]["secrets"]


def test_every_long_running_service_has_a_healthcheck(compose: dict[str, Any]) -> None:
    for name in LONG_RUNNING:
        check = compose["services"][name].get("healthcheck")
        assert check and not check.get("disable") and check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert compose["services"][name]["restart"] == "unless-stopped", name
    # The gateway and engine checks are their images' own HEALTHCHECK commands (/readyz, /health).
    for name in ("gateway", "engine"):
        (healthcheck,) = parse(DEPLOY / "docker" / f"{name}.Dockerfile").stages[-1].values("HEALTHCHECK")
        image_check = ["CMD", *exec_form(healthcheck.partition("CMD")[2].strip())]
        assert compose["services"][name]["healthcheck"]["test"] == image_check, name
    assert "/readyz" in " ".join(compose["services"]["gateway"]["healthcheck"]["test"])


def test_secrets_reach_the_services_as_files_never_as_environment_variables(compose: dict[str, Any]) -> None:
    declared = compose["secrets"]
    used: set[str] = set()
    for path in (DEPLOY / "compose.yaml", DEPLOY / "compose.gpu.yaml"):
        doc = load_yaml(path)
        for name, service in doc["services"].items():
            env = service.get("environment", {})
            assert isinstance(env, dict), f"{name}: use the mapping form of environment"
            mounted = set(service.get("secrets", []))
            used |= mounted
            for key, value in env.items():
                # WEIR_ADMIN_TOKEN_FILE, POSTGRES_PASSWORD_FILE, Grafana's GF_..._PASSWORD__FILE
                if SECRET_NAME.search(key.removesuffix("_FILE").removesuffix("_")):
                    assert key.endswith("_FILE"), (
                        f"{path.name}: {name}.{key} puts a secret in the environment"
                    )
                    assert str(value).startswith(SECRETS_MOUNT), f"{path.name}: {name}.{key}={value}"
            # Every secret a service reads (environment, entrypoint, health check) is mounted in it.
            read = set(re.findall(re.escape(SECRETS_MOUNT) + r"(\w+)", json.dumps(service)))
            assert read <= mounted, f"{path.name}: {name} reads {read - mounted}, not mounted"
            assert mounted <= set(declared), (
                f"{path.name}: {name} mounts undeclared {mounted - set(declared)}"
            )
            for key in (service.get("build") or {}).get("args", {}):
                assert not SECRET_NAME.search(key), f"{name}: a secret as a build arg ends up in the image"
    assert used == set(declared), f"declared but never mounted: {set(declared) - used}"
    # Each is a file of deploy/secrets/, which git ignores.
    for secret, spec in declared.items():
        assert spec == {"file": f"./secrets/{secret}"}, secret
    assert "secrets/" in (DEPLOY / ".gitignore").read_text().split()
    # No variable of the file (deploy/.env, the shell) carries a secret, and the example names none.
    assert not [k for k in variables(compose) if SECRET_NAME.search(k)]
    example = parse_env_file((DEPLOY / ".env.example").read_text())
    assert not [k for k in example if SECRET_NAME.search(k)]
    assert set(variables(compose)) <= set(example)


def test_new_secrets_makes_every_secret_compose_mounts_and_keeps_them(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    secrets = new_secrets(tmp_path / "secrets")
    assert {p.name for p in secrets.iterdir()} == set(compose["secrets"])
    text = {p.name: p.read_text().rstrip("\n") for p in secrets.iterdir()}
    # The URLs carry the passwords the servers get; the optional secrets are empty until filled in.
    assert text["database_url"] == f"postgresql+asyncpg://weir:{text['postgres_password']}@postgres:5432/weir"
    assert text["redis_url"] == f"redis://:{text['redis_password']}@redis:6379/0"
    for name in ("postgres_password", "redis_password", "weir_admin_token", "weir_demo_key"):
        assert len(text[name]) >= 32, name
    assert text["openai_api_key"] == text["anthropic_api_key"] == text["weir_master_key"] == ""
    # Readable by the containers' users (gateway 10001, postgres 70, grafana 472) in a directory
    # closed to everyone else.
    assert secrets.stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in secrets.iterdir())
    # Run again, it changes nothing: a password postgres was initialised with stays.
    (secrets / "openai_api_key").write_text("sk-mine\n")
    new_secrets(secrets)
    assert {p.name: p.read_text().rstrip("\n") for p in secrets.iterdir()} == {
        **text,
        "openai_api_key": "sk-mine",
    }


def test_with_the_example_env_filled_in_everything_interpolates(compose: dict[str, Any]) -> None:
    env = example_env()
    resolved = interpolate(compose, env)
    assert resolved["services"]["lb"]["ports"] == [f"{env['WEIR_HTTP_PORT']}:8080"]
    assert interpolate(compose, {})["services"]["lb"]["ports"] == ["8080:8080"]


def test_bind_mounts_and_build_files_exist(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE_DIR / source).exists(), f"{name}: {source} does not exist"
        build = service.get("build")
        if build:
            context = (COMPOSE_DIR / build["context"]).resolve()
            assert (context / build["dockerfile"]).is_file(), name
    named = {v.split(":")[0] for s in compose["services"].values() for v in s.get("volumes", [])}
    assert {n for n in named if not n.startswith(".")} <= set(compose["volumes"])


def test_the_gateway_config_loads_with_the_real_config_loader(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    from gateway.config import parse_config

    secrets = new_secrets(tmp_path)
    env = at_secrets(interpolate(compose, example_env())["services"]["gateway"]["environment"], secrets)
    config = parse_config(gateway_config_source(compose).read_text(), env)
    assert (config.server.host, config.server.port) == ("0.0.0.0", 8080)
    assert config.auto_migrate is False  # the `migrate` service upgrades the schema, once
    # A replica that starts while Redis is away shares every limit out by the replicas compose runs.
    assert config.replicas == compose["services"]["gateway"]["deploy"]["replicas"]
    engine = config.backend("engine")
    assert engine.type == "engine"
    # The engine backend points at the engine service, on the port its command listens on.
    command = compose["services"]["engine"]["command"]
    port = command[command.index("--port") + 1]
    assert engine.url == f"http://engine:{port}/v1"
    # The demo key, like every secret of the config, read from the file compose mounts.
    demo_key = (secrets / "weir_demo_key").read_text().strip()
    assert [t.api_keys for t in config.tenants or []] == [[demo_key]]
    assert config.backend("openai").api_key == ""  # the empty optional secret


def gateway_config_source(compose: dict[str, Any]) -> Path:
    """The file compose mounts as the gateway's /etc/weir/weir.yaml."""
    (source,) = [
        v.split(":")[0]
        for v in compose["services"]["gateway"]["volumes"]
        if v.split(":")[1] == "/etc/weir/weir.yaml"
    ]
    return COMPOSE_DIR / source


def duration_s(value: str) -> float:
    """A compose duration (`40s`, `1m30s`, `500ms`) in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|us|m|s)", value)
    assert parts and "".join(n + u for n, u in parts) == value, f"not a duration: {value!r}"
    return sum(float(n) * units[u] for n, u in parts)


def test_a_stopping_service_is_given_longer_than_it_drains(compose: dict[str, Any]) -> None:
    from engine.server import DRAIN_TIMEOUT_S as ENGINE_DRAIN_S
    from gateway.cli import STREAMS_END_S
    from gateway.config import DRAIN_TIMEOUT_S

    GATEWAY_DRAIN_S = DRAIN_TIMEOUT_S + STREAMS_END_S  # then what still runs is cancelled

    services = compose["services"]
    # Docker's default is 10 s: a service draining longer is killed mid-stream without its own period.
    for name, drain in (("gateway", GATEWAY_DRAIN_S), ("engine", ENGINE_DRAIN_S)):
        assert duration_s(services[name].get("stop_grace_period", "10s")) > drain, name


def test_the_gateway_usage_spool_outlives_a_recreated_replica(compose: dict[str, Any]) -> None:
    from gateway.admin.control_plane import ControlPlaneSettings

    # The spool (where usage events wait while Redis is away) lies under the working directory...
    assert not Path(ControlPlaneSettings.spool_dir).is_absolute()
    (workdir,) = parse(DEPLOY / "docker" / "gateway.Dockerfile").stages[-1].values("WORKDIR")
    # ...which a named volume holds, so `up -d` recreating the replicas keeps what they spooled. A
    # directory of the image (not a new path) also gives the volume the image's owner, UID 10001.
    mounts = dict(v.split(":")[1::-1] for v in compose["services"]["gateway"]["volumes"])
    assert mounts.get(workdir) in compose["volumes"]


def test_nginx_balances_over_every_gateway_replica(compose: dict[str, Any]) -> None:
    conf = (DEPLOY / "compose" / "nginx.conf").read_text()
    # Re-resolved through Docker's DNS so `--scale gateway=N` needs no reload.
    assert re.search(r"server\s+gateway:8080\s+resolve", conf)
    assert re.search(r"resolver\s+127\.0\.0\.11", conf)
    assert re.search(r"zone\s+weir_gateway", conf)
    assert "proxy_buffering off" in conf  # server-sent events must not be buffered
    assert "non_idempotent" not in conf  # a chat completion is never replayed on another replica
    listen = re.search(r"listen\s+(\d+)", conf)
    assert listen and compose["services"]["lb"]["ports"][0].endswith(f":{listen.group(1)}")


def test_nginx_drops_idle_gateway_connections_before_the_gateway_does() -> None:
    from gateway.cli import KEEP_ALIVE_S

    conf = (DEPLOY / "compose" / "nginx.conf").read_text()
    upstream = re.search(r"upstream\s+weir_gateway\s*\{(.*?)\}", conf, re.S)
    assert upstream is not None
    # nginx keeps an idle upstream connection 60 s by default, far past the gateway's keep-alive.
    timeout = re.search(r"keepalive_timeout\s+(\w+);", upstream.group(1))
    assert timeout is not None, "no keepalive_timeout: nginx's 60 s default outlives the gateway's"
    assert duration_s(timeout.group(1)) < KEEP_ALIVE_S


def test_prometheus_scrapes_each_gateway_replica_and_the_engine(compose: dict[str, Any]) -> None:
    config = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    (sd,) = jobs["weir-gateway"]["dns_sd_configs"]
    assert sd["names"] == ["gateway"] and sd["port"] == 8080 and sd["type"] == "A"
    assert jobs["weir-engine"]["static_configs"][0]["targets"] == ["engine:8000"]
    mounted = {v.split(":")[1]: Path(v.split(":")[0]) for v in compose["services"]["prometheus"]["volumes"]}
    rules_dir = COMPOSE_DIR / mounted["/etc/prometheus/rules"]
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    assert sorted(rules_dir.glob("*.yml")), "no rule file would be loaded"


@pytest.mark.redis
def test_redis_runs_with_the_compose_command_and_the_gateway_url_authenticates(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    """The compose Redis entrypoint and command, run by the local redis-server (the image runs the same
    binary; its docker-entrypoint.sh only drops root before it execs the command: a stand-in here
    that does only that, and writes down the arguments it was given, which `ps` shows)."""
    secrets = new_secrets(tmp_path / "secrets")
    redis_service = at_secrets(interpolate(compose, example_env())["services"]["redis"], secrets)
    stand_in = tmp_path / "docker-entrypoint.sh"
    stand_in.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv\nexec "$@"\n')
    stand_in.chmod(0o755)
    entrypoint = [a.replace("docker-entrypoint.sh", str(stand_in)) for a in redis_service["entrypoint"]]
    with redis_server([*entrypoint, *redis_service["command"]], tmp_path) as port:
        # The password is in no process's arguments: not the entrypoint's, not redis-server's.
        password = (secrets / "redis_password").read_text().strip()
        argv = (tmp_path / "argv").read_text()
        assert argv.startswith("redis-server\n-\n") and password not in argv, argv
        url = (secrets / "redis_url").read_text().strip()
        assert url.startswith("redis://:") and "@redis:6379/" in url
        client = redis.Redis.from_url(url.replace("@redis:6379", f"@127.0.0.1:{port}"))
        assert client.ping()
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, password="wrong").ping()
        # The health check, as compose runs it inside the container, with the password from its file.
        kind, command = redis_service["healthcheck"]["test"]
        assert kind == "CMD-SHELL"
        command = command.replace("redis-cli", f"redis-cli -p {port}")
        env = {k: v for k, v in os.environ.items() if k != "REDISCLI_AUTH"}
        assert subprocess.run(["sh", "-c", command], env=env).returncode == 0
        (tmp_path / "wrong").write_text("wrong\n")
        wrong = command.replace(str(secrets / "redis_password"), str(tmp_path / "wrong"))
        assert subprocess.run(["sh", "-c", wrong], env=env, capture_output=True).returncode != 0


def test_every_weir_command_is_one_the_real_cli_accepts(compose: dict[str, Any]) -> None:
    gpu = load_yaml(DEPLOY / "compose.gpu.yaml")
    commands = [
        s["command"] for s in [*compose["services"].values(), *gpu["services"].values()] if "command" in s
    ]
    weir = [c for c in commands if c[0] == "weir"]
    assert len(weir) == 3  # migrate, engine, the GPU engine
    for argv in weir:
        assert_cli_accepts(argv)
    # The CPU engine runs exactly what its image would.
    (cmd,) = parse(DEPLOY / "docker" / "engine.Dockerfile").stages[-1].values("CMD")
    assert compose["services"]["engine"]["command"] == exec_form(cmd)
