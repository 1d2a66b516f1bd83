"""deploy/k8s: every object valid against the Kubernetes API schemas (kubernetes-validate bundles
them; no cluster runs here), and the wiring a user relies on: probes, GPU, HPA, disruption budget,
migration Job, config and secrets, and the vLLM example."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.artefacts import DEPLOY, SECRET_NAME
from tests.deploy.compose_env import variables
from tests.deploy.dockerfiles import exec_form, parse
from tests.deploy.kustomize import find, parse_env_file, pod_spec, render, secret_files
from tests.deploy.weir_cli import assert_cli_accepts

K8S = DEPLOY / "k8s"
VLLM = DEPLOY / "k8s-examples" / "vllm"
ROUTER_TRAIN = DEPLOY / "k8s-examples" / "router-train"
KUBERNETES_VERSION = "1.33"
GENERATED = {"ConfigMap", "Secret"}  # kinds kustomize's generators name with a content hash


@pytest.fixture(scope="module")
def base() -> list[dict[str, Any]]:
    return render(K8S)


@pytest.fixture(scope="module")
def vllm() -> list[dict[str, Any]]:
    return render(VLLM)


def secret_data(objects: list[dict[str, Any]]) -> dict[str, str]:
    secret = find(objects, "Secret", "weir-secrets")
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = pod_spec(obj)
    assert spec is not None
    return spec.get("initContainers", []) + spec["containers"]


def secrets_of(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """{name: decoded data} of every Secret."""
    return {
        o["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in o.get("data", {}).items()}
        for o in objects
        if o["kind"] == "Secret"
    }


def env_at(
    objects: list[dict[str, Any]], obj: dict[str, Any], container: dict[str, Any], directory: Path
) -> dict[str, str]:
    """`container`'s plain environment as a local process sees it: the Secret files it mounts written
    under `directory` (an empty value filled in, as a user would) and every path to one pointed there."""
    spec = pod_spec(obj)
    assert spec is not None
    secrets = secrets_of(objects)
    files = secret_files(spec, container, secrets)
    local: dict[str, str] = {}
    for n, (path, (secret, key)) in enumerate(sorted(files.items())):
        local[path] = str(directory / f"{n}-{key}")
        Path(local[path]).write_text((secrets[secret][key] or f"test-{key.lower()}") + "\n")
    return {e["name"]: local.get(e["value"], e["value"]) for e in container.get("env", []) if "value" in e}


@pytest.mark.parametrize("directory", [K8S, VLLM, ROUTER_TRAIN], ids=["base", "vllm", "router-train"])
def test_every_object_is_valid_against_the_kubernetes_schema(directory: Any) -> None:
    objects = render(directory)
    assert objects
    for obj in objects:
        # strict: an unknown or misspelt field is an error, not silently dropped by the API server.
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), "duplicate objects"
    assert all(o["metadata"].get("namespace") == "weir" for o in objects if o["kind"] != "Namespace")


@pytest.mark.parametrize("directory", [K8S, VLLM, ROUTER_TRAIN], ids=["base", "vllm", "router-train"])
def test_the_real_kustomize_renders_it(directory: Path, tmp_path: Path) -> None:
    """Where kubectl (or kustomize) is installed: what `kubectl apply -k` would build, in a copy of
    deploy/ with secrets.env filled in from its example, as a user's checkout has it."""
    if shutil.which("kubectl"):
        command = ["kubectl", "kustomize"]
    elif shutil.which("kustomize"):
        command = ["kustomize", "build"]
    else:
        pytest.skip("neither kubectl nor kustomize is installed")
    copy = tmp_path / "deploy"
    shutil.copytree(DEPLOY, copy)
    shutil.copy(copy / "k8s" / "secrets.env.example", copy / "k8s" / "secrets.env")
    result = subprocess.run(
        [*command, str(copy / directory.relative_to(DEPLOY))], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    # Generated names carry kustomize's content hash, which this renderer leaves out.
    rendered = {
        (
            o["kind"],
            re.sub(r"-[a-z0-9]{10}$", "", o["metadata"]["name"])
            if o["kind"] in GENERATED
            else o["metadata"]["name"],
        )
        for o in yaml.safe_load_all(result.stdout)
    }
    assert rendered == {(o["kind"], o["metadata"]["name"]) for o in render(directory)}


def test_the_validator_rejects_a_broken_object(base: list[dict[str, Any]]) -> None:
    broken = find(base, "Deployment", "weir-gateway")
    broken = {**broken, "spec": {**broken["spec"], "replicas": "two"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_gateway_deployment_probes_and_rollout(base: list[dict[str, Any]]) -> None:
    deployment = find(base, "Deployment", "weir-gateway")
    (container,) = containers(deployment)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    # Zero-downtime rollout: never fewer ready pods than wanted.
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert container["lifecycle"]["preStop"]
    # The container runs what the image would run, and the CLI accepts it.
    (cmd,) = parse(DEPLOY / "docker" / "gateway.Dockerfile").stages[-1].values("CMD")
    assert container["args"] == exec_form(cmd)
    assert_cli_accepts(container["args"])
    assert ports["http"] == int(container["args"][container["args"].index("--port") + 1])


def test_gateway_scales_and_survives_voluntary_disruption(base: list[dict[str, Any]]) -> None:
    deployment = find(base, "Deployment", "weir-gateway")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    hpa = find(base, "HorizontalPodAutoscaler", "weir-gateway")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == ("apps/v1", "Deployment", "weir-gateway")
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    # Were the Deployment to set replicas, every `kubectl apply` would reset what the HPA scaled to.
    assert "replicas" not in deployment["spec"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    # Utilisation is relative to the request: the HPA needs one.
    (container,) = containers(deployment)
    assert container["resources"]["requests"]["cpu"]
    pdb = find(base, "PodDisruptionBudget", "weir-gateway")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    # A budget that allows no disruption would block node drains forever.
    assert (
        pdb["spec"].get("maxUnavailable", 0) >= 1 or pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]
    )


def test_a_terminating_pod_is_given_longer_than_it_drains(base: list[dict[str, Any]]) -> None:
    from engine.server import DRAIN_TIMEOUT_S as ENGINE_DRAIN_S
    from gateway.cli import STREAMS_END_S
    from gateway.config import DRAIN_TIMEOUT_S

    GATEWAY_DRAIN_S = DRAIN_TIMEOUT_S + STREAMS_END_S  # then what still runs is cancelled

    for name, drain in (("weir-gateway", GATEWAY_DRAIN_S), ("weir-engine", ENGINE_DRAIN_S)):
        spec = pod_spec(find(base, "Deployment", name))
        assert spec is not None
        (container,) = spec["containers"]
        # The grace period counts from the preStop hook's start: SIGTERM comes only after it.
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        pause = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        assert spec["terminationGracePeriodSeconds"] > pause + drain, name


def test_services_select_pods_and_ports_that_exist(vllm: list[dict[str, Any]]) -> None:
    workloads = [o for o in vllm if o["kind"] == "Deployment"]
    for service in (o for o in vllm if o["kind"] == "Service"):
        selector = service["spec"]["selector"]
        matched = [
            w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(matched) == 1, f"Service {service['metadata']['name']} selects {len(matched)} Deployments"
        port_names = {p["name"] for c in containers(matched[0]) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names
        # A Deployment's selector must match its own template.
    for w in workloads:
        assert (
            w["spec"]["selector"]["matchLabels"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        )


def test_engine_requests_a_gpu_and_is_probed_on_health(base: list[dict[str, Any]]) -> None:
    deployment = find(base, "Deployment", "weir-engine")
    (container,) = containers(deployment)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    # Loading a model takes minutes: the startup probe must allow for it before liveness applies.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert container["image"].startswith("weir-engine:") and container["image"].endswith("-cuda")
    assert_cli_accepts(container["args"])


def test_migration_job_runs_weir_db_upgrade_with_the_gateway_image(base: list[dict[str, Any]]) -> None:
    job = find(base, "Job", "weir-db-upgrade")
    (container,) = containers(job)
    assert container["args"] == ["weir", "db", "upgrade"]
    assert_cli_accepts(container["args"])
    (gateway,) = containers(find(base, "Deployment", "weir-gateway"))
    assert container["image"] == gateway["image"]
    assert pod_spec(job)["restartPolicy"] == "Never"  # type: ignore[index]
    assert job["spec"]["backoffLimit"] >= 1
    # `kubectl apply -k deploy/k8s -l weir.dev/phase=pre-upgrade` applies exactly what the migration
    # needs (namespace, config, secret, Job) and none of the workloads, so it can run first.
    phase = {
        (o["kind"], o["metadata"]["name"])
        for o in base
        if o["metadata"].get("labels", {}).get("weir.dev/phase") == "pre-upgrade"
    }
    assert phase == {
        ("Namespace", "weir"),
        ("ConfigMap", "weir-config"),
        ("Secret", "weir-secrets"),
        ("Job", "weir-db-upgrade"),
    }


def test_the_nightly_router_train_job_installs_only_a_better_head() -> None:
    objects = render(ROUTER_TRAIN)
    job = find(objects, "CronJob", "weir-router-train-acme")
    (container,) = containers(job)
    args = container["args"]
    assert args[:3] == ["weir", "router", "train"] and "--install" in args and "--route" in args
    assert_cli_accepts(args)
    # --out is written on the read-only root filesystem's one writable mount.
    assert args[args.index("--out") + 1].startswith("/tmp/")
    (gateway,) = containers(find(objects, "Deployment", "weir-gateway"))
    assert container["image"] == gateway["image"]  # the same Weir, the same embedder recipes
    # The admin DB, and the master key where set: the very files the gateways read.
    for name in ("WEIR_DATABASE_URL_FILE", "WEIR_MASTER_KEY_FILE"):
        assert env_value(container, name) == env_value(gateway, name), name
    assert job["spec"]["concurrencyPolicy"] == "Forbid"
    test_pods_are_locked_down([job])


def test_pods_are_locked_down(base: list[dict[str, Any]]) -> None:
    for obj in base:
        spec = pod_spec(obj)
        if spec is None:
            continue
        name = obj["metadata"]["name"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["runAsUser"] == 10001, name
        # No pod needs the Kubernetes API: no token is mounted, by the pod or by its service account.
        account = spec.get("serviceAccountName")
        automount = spec.get("automountServiceAccountToken")
        if automount is None and account:
            automount = find(base, "ServiceAccount", account)["automountServiceAccountToken"]
        assert automount is False, name
        for container in containers(obj):
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert container["resources"]["requests"], name
            image, _, tag = container["image"].rpartition(":")
            assert image and tag and tag != "latest", f"{name}: pin the image tag ({container['image']})"
            # readOnlyRootFilesystem: everything the process writes is a mounted volume.
            mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
            assert "/tmp" in mounts, name


def test_the_vllm_pod_is_locked_down_and_writes_only_to_volumes(vllm: list[dict[str, Any]]) -> None:
    test_pods_are_locked_down(vllm)  # every pod of the overlay, vLLM's included: non-root, read-only root
    deployment = find(vllm, "Deployment", "vllm")
    (container,) = containers(deployment)
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    # vLLM's image is root's, HOME /root, on what is now a read-only filesystem: HOME (vLLM's, Triton's,
    # FlashInfer's and CUDA's caches) and the weights are volumes, and nothing relies on /root.
    for name in ("HOME", "HF_HOME"):
        assert env[name] in mounts, f"{name}={env[name]} is not a volume"
    assert not any(path.startswith("/root") for path in mounts)
    assert {"/tmp", "/dev/shm"} <= set(mounts)  # torch.compile's cache; NCCL and the workers
    spec = pod_spec(deployment)
    assert spec is not None
    volumes = {v["name"]: v for v in spec["volumes"]}
    written = {m["name"] for m in container["volumeMounts"] if not m.get("readOnly")}
    assert all("emptyDir" in volumes[name] for name in written)
    assert all("emptyDir" in volumes[name] or "secret" in volumes[name] for name in mounts.values())
    # The UID has no passwd entry: torch's getpass.getuser() raises unless USER is set.
    assert env["USER"]
    assert env["VLLM_NO_USAGE_STATS"] == "1"


def env_value(container: dict[str, Any], name: str) -> str | None:
    return next((e.get("value") for e in container.get("env", []) if e["name"] == name), None)


@pytest.mark.parametrize("directory", [K8S, VLLM, ROUTER_TRAIN], ids=["base", "vllm", "router-train"])
def test_secrets_reach_every_pod_as_files_never_as_environment_variables(directory: Path) -> None:
    objects = render(directory)
    secrets = secrets_of(objects)
    for obj in objects:
        spec = pod_spec(obj)
        if spec is None:
            continue
        for volume in spec.get("volumes", []):
            if "secret" not in volume:
                continue
            name = f"{obj['metadata']['name']}: volume {volume['name']}"
            secret = volume["secret"]
            assert secret["secretName"] in secrets, name
            # Only the keys the pod reads, readable by the pod's group (the kubelet hands the files to
            # root and the fsGroup) and by no other user.
            assert secret.get("items"), f"{name}: name the keys the pod reads"
            modes = [secret["defaultMode"]] + [i["mode"] for i in secret["items"] if "mode" in i]
            assert all(mode in (0o400, 0o440) for mode in modes), name
            assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"], name
        for container in containers(obj):
            name = f"{obj['metadata']['name']}/{container['name']}"
            assert not [s for s in container.get("envFrom", []) if "secretRef" in s], (
                f"{name}: envFrom a Secret puts every key in the environment"
            )
            mounted = {m["name"]: m for m in container.get("volumeMounts", [])}
            for volume in spec.get("volumes", []):
                if "secret" in volume and volume["name"] in mounted:
                    assert mounted[volume["name"]].get("readOnly") is True, name
            files = secret_files(spec, container, secrets)
            for env in container.get("env", []):
                assert "secretKeyRef" not in env.get("valueFrom", {}), (
                    f"{name}: {env['name']} takes a secret value from the environment; mount it as a file"
                )
                value = env.get("value", "")
                # Every *_FILE (and Hugging Face's HF_TOKEN_PATH) names a file of a mounted Secret
                # volume, whose Secret holds that key; no other variable holds a secret.
                if env["name"].endswith("_FILE") or SECRET_NAME.search(env["name"]):
                    assert value in files, f"{name}: {env['name']}={value} is no mounted Secret's file"
                    secret, key = files[value]
                    assert key in secrets[secret], f"{name}: {env['name']}: {secret} has no key {key}"
                    assert env["name"].removesuffix("_FILE").removesuffix("_PATH") == key, (
                        f"{name}: {env['name']} names the file of {key}"
                    )
    # The committed example holds no secret: every token and key is empty.
    example = parse_env_file((K8S / "secrets.env.example").read_text())
    assert all(v == "" for k, v in example.items() if k.endswith(("_KEY", "_TOKEN")))
    assert "k8s/secrets.env" in (DEPLOY / ".gitignore").read_text().split()
    # No manifest embeds a Secret: it is generated from the git-ignored env file.
    for path in K8S.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            assert not (isinstance(doc, dict) and doc.get("kind") == "Secret"), path


def test_config_maps_mounted_exist(vllm: list[dict[str, Any]]) -> None:
    configmaps = {o["metadata"]["name"] for o in vllm if o["kind"] == "ConfigMap"}
    for obj in vllm:
        for volume in (pod_spec(obj) or {}).get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps


@pytest.mark.parametrize("directory", [K8S, ROUTER_TRAIN], ids=["base", "router-train"])
def test_each_weir_command_reads_its_secrets_from_the_mounted_files(directory: Path, tmp_path: Path) -> None:
    """What `weir` does at start (export every WEIR_*_FILE) on each Weir pod's environment, with the
    Secret's files where the pod mounts them: the values are the Secret's."""
    from gateway.secret_files import export_secret_files

    objects = render(directory)
    data = secret_data(objects)
    wanted = {
        "weir-gateway": {
            "WEIR_DATABASE_URL",
            "WEIR_REDIS_URL",
            "WEIR_ADMIN_TOKEN",
            "WEIR_DEMO_KEY",
            "WEIR_MASTER_KEY",
        },
        "weir-db-upgrade": {"WEIR_DATABASE_URL"},
        "weir-router-train-acme": {"WEIR_DATABASE_URL", "WEIR_MASTER_KEY"},
    }
    checked = set()
    for obj in objects:
        if pod_spec(obj) is None or obj["metadata"]["name"] not in wanted:
            continue
        (container,) = containers(obj)
        env = env_at(objects, obj, container, tmp_path)
        names = export_secret_files(env)
        assert set(names) == wanted[obj["metadata"]["name"]], obj["metadata"]["name"]
        for key in names:
            assert env[key] == (data[key] or f"test-{key.lower()}")
            assert key + "_FILE" not in env
        checked.add(obj["metadata"]["name"])
    assert checked == {n for n in wanted if any(o["metadata"]["name"] == n for o in objects)}
    assert "weir-gateway" in checked


@pytest.mark.parametrize("directory", [K8S, VLLM], ids=["base", "vllm"])
def test_the_config_map_loads_with_the_real_config_loader(directory: Any, tmp_path: Path) -> None:
    from gateway.config import parse_config
    from gateway.secret_files import export_secret_files

    objects = render(directory)
    text = find(objects, "ConfigMap", "weir-config")["data"]["weir.yaml"]
    gateway = find(objects, "Deployment", "weir-gateway")
    (container,) = containers(gateway)
    # The gateway's environment, its secret files where it mounts them, as `weir serve` sees it.
    env = env_at(objects, gateway, container, tmp_path)
    export_secret_files(env)
    # Every variable the config requires (no default) reaches the gateway, as a file of the Secret.
    required = {name for name, op in variables(yaml.safe_load(text)).items() if op is None}
    assert required <= set(env) | {k.removesuffix("_FILE") for k in env}, f"not given: {required}"
    config = parse_config(text, env)
    assert config.auto_migrate is False  # the weir-db-upgrade Job upgrades the schema, once
    # Every secret of the config is the Secret's value, read from its file.
    assert [t.api_keys for t in config.tenants or []] == [[env["WEIR_DEMO_KEY"]]]
    for backend, key in (
        ("openai", "OPENAI_API_KEY"),
        ("anthropic", "ANTHROPIC_API_KEY"),
        ("vllm", "VLLM_API_KEY"),
    ):
        if any(b.name == backend for b in config.backends):
            assert config.backend(backend).api_key == f"test-{key.lower()}", backend
    # A replica that starts while Redis is away shares every limit out by the replicas that always run.
    assert config.replicas == find(objects, "HorizontalPodAutoscaler", "weir-gateway")["spec"]["minReplicas"]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for backend in config.backends:
        url = backend.url or backend.base_url or ""
        host = url.split("://")[1].split("/")[0] if "://" in url else ""
        name, _, port = host.partition(":")
        if name in services or "." not in name:
            # An in-cluster backend: the Service exists and serves that port.
            assert name in services, f"backend {backend.name}: no Service {name}"
            assert int(port) in {p["port"] for p in services[name]["spec"]["ports"]}


@pytest.mark.parametrize("key", ["a-vllm-key", ""], ids=["set", "empty"])
def test_vllm_gets_its_api_key_from_the_secret_file_only_when_set(
    vllm: list[dict[str, Any]], tmp_path: Path, key: str
) -> None:
    """vLLM reads its key only from the environment: the container's shell sets VLLM_API_KEY from the
    file (when not empty) and execs vLLM with the container's args. Run here with a stand-in python3."""
    deployment = find(vllm, "Deployment", "vllm")
    (container,) = containers(deployment)
    spec = pod_spec(deployment)
    assert spec is not None
    files = secret_files(spec, container, secrets_of(vllm))
    (path,) = [p for p, (_, k) in files.items() if k == "VLLM_API_KEY"]
    (tmp_path / "VLLM_API_KEY").write_text(key + "\n" if key else "")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "python3"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "key=${VLLM_API_KEY-unset}" "$@"\n')
    stub.chmod(0o755)
    command = [c.replace(path, str(tmp_path / "VLLM_API_KEY")) for c in container["command"]]
    result = subprocess.run(
        [*command, *container["args"]],
        capture_output=True,
        text=True,
        timeout=10,
        env={"PATH": f"{bin_dir}:{os.environ['PATH']}"},
        check=True,
    )
    lines = result.stdout.splitlines()
    assert lines[0] == f"key={key or 'unset'}"
    assert lines[1:] == ["-m", "vllm.entrypoints.openai.api_server", *container["args"]]


def test_vllm_is_fronted_as_an_openai_compatible_backend(vllm: list[dict[str, Any]]) -> None:
    from gateway.config import parse_config

    text = find(vllm, "ConfigMap", "weir-config")["data"]["weir.yaml"]
    config = parse_config(text, {k: v or "x" for k, v in secret_data(vllm).items()})
    backend = config.backend("vllm")
    assert backend.type == "openai" and backend.base_url == "http://vllm:8000/v1"
    served = next(
        a
        for a in containers(find(vllm, "Deployment", "vllm"))[0]["args"]
        if a.startswith("--served-model-name=")
    )
    (model,) = [m for m in config.models if m.backend == "vllm"]
    assert model.upstream_model == served.split("=", 1)[1]
    (container,) = containers(find(vllm, "Deployment", "vllm"))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # vLLM reports cache hits in usage only when asked; Weir prices them as cached input.
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(container["args"])
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    # The overlay replaces the config instead of adding a second one.
    assert [o["metadata"]["name"] for o in vllm if o["kind"] == "ConfigMap"] == ["weir-config"]
