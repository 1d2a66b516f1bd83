"""A small kustomize renderer for the tests, which need no kustomize or kubectl binary (where one is
installed, test_kubernetes.py also checks that the real one builds the same objects).

It implements the subset deploy/k8s uses (resources, namespace, configMapGenerator and secretGenerator
with `files`, `literals`, `envs` and `behavior: replace|merge`, images) and fails loudly on any other
field, so the manifests cannot quietly grow a feature these tests do not render. Names stay unhashed:
kustomize adds a content hash and rewrites every reference, so cross-references are checked by base name.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {
    "apiVersion",
    "kind",
    "namespace",
    "resources",
    "configMapGenerator",
    "secretGenerator",
    "images",
}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}

# A kustomization that needs a git-ignored file of secrets renders with the committed example instead.
EXAMPLE_SUFFIX = ".example"


def render(directory: Path) -> list[dict[str, Any]]:
    directory = directory.resolve()
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml: fields this renderer does not support: {unknown}")
    objects: list[dict[str, Any]] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        if path.is_dir():
            # kustomize refuses a base that contains the kustomization naming it ("cycle detected"),
            # so an overlay never lives inside its base's directory.
            if directory.is_relative_to(path.resolve()):
                raise ValueError(
                    f"{directory}/kustomization.yaml: base {entry} contains it (kustomize: cycle)"
                )
            objects.extend(render(path))
        else:
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    for generator in kustomization.get("configMapGenerator", []):
        _apply_generator(objects, _config_map(directory, generator), generator)
    for generator in kustomization.get("secretGenerator", []):
        _apply_generator(objects, _secret(directory, generator), generator)
    namespace = kustomization.get("namespace")
    if namespace:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = namespace
    for image in kustomization.get("images", []):
        for container in _containers(objects):
            name, _, _tag = container["image"].partition(":")
            if name == image["name"]:
                new = image.get("newName", name)
                container["image"] = f"{new}:{image['newTag']}" if "newTag" in image else new
    return objects


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"}:
        return obj["spec"]["template"]["spec"]
    if obj["kind"] == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return None


def secret_files(
    spec: dict[str, Any], container: dict[str, Any], secrets: dict[str, dict[str, str]]
) -> dict[str, tuple[str, str]]:
    """{path in `container`: (Secret name, key)} of every file its mounted Secret volumes hold: the
    volume's `items`, else every key of the Secret in `secrets` ({name: data}). A key an `optional`
    volume names but its Secret lacks is no file."""
    volumes = {v["name"]: v["secret"] for v in spec.get("volumes", []) if "secret" in v}
    files: dict[str, tuple[str, str]] = {}
    for mount in container.get("volumeMounts", []):
        volume = volumes.get(mount["name"])
        if volume is None:
            continue
        name = volume["secretName"]
        data = secrets.get(name, {})
        items = volume.get("items") or [{"key": key, "path": key} for key in data]
        for item in items:
            if item["key"] not in data and volume.get("optional"):
                continue
            if "subPath" in mount:
                if mount["subPath"] == item["path"]:
                    files[mount["mountPath"]] = (name, item["key"])
                continue
            files[f"{mount['mountPath'].rstrip('/')}/{item['path']}"] = (name, item["key"])
    return files


def _containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for obj in objects:
        spec = pod_spec(obj)
        if spec:
            out.extend(spec.get("initContainers", []) + spec["containers"])
    return out


def _data(directory: Path, generator: dict[str, Any]) -> dict[str, str]:
    unknown = set(generator) - {"name", "behavior", "files", "literals", "envs", "options"}
    if unknown:
        raise ValueError(f"generator {generator['name']}: unsupported fields {unknown}")
    data: dict[str, str] = {}
    for entry in generator.get("files", []):
        key, _, source = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
        data[key] = (directory / source).read_text()
    for literal in generator.get("literals", []):
        key, _, value = literal.partition("=")
        data[key] = value
    for entry in generator.get("envs", []):
        path = directory / entry
        if not path.exists():
            path = directory / (entry + EXAMPLE_SUFFIX)
        data.update(parse_env_file(path.read_text()))
    return data


def parse_env_file(text: str) -> dict[str, str]:
    """kustomize's env-file format: KEY=VALUE lines, `#` comments, no quoting or expansion."""
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"line {n}: not KEY=VALUE: {line!r}")
        out[key] = value
    return out


def _metadata(generator: dict[str, Any]) -> dict[str, Any]:
    options = generator.get("options", {})
    meta: dict[str, Any] = {"name": generator["name"]}
    if options.get("labels"):
        meta["labels"] = dict(options["labels"])
    if options.get("annotations"):
        meta["annotations"] = dict(options["annotations"])
    return meta


def _config_map(directory: Path, generator: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(generator),
        "data": _data(directory, generator),
    }


def _secret(directory: Path, generator: dict[str, Any]) -> dict[str, Any]:
    data = {k: base64.b64encode(v.encode()).decode() for k, v in _data(directory, generator).items()}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(generator),
        "type": "Opaque",
        "data": data,
    }


def _apply_generator(
    objects: list[dict[str, Any]], generated: dict[str, Any], generator: dict[str, Any]
) -> None:
    behavior = generator.get("behavior", "create")
    existing = [
        o
        for o in objects
        if o["kind"] == generated["kind"] and o["metadata"]["name"] == generated["metadata"]["name"]
    ]
    if behavior == "create":
        if existing:
            raise ValueError(f"{generated['kind']}/{generated['metadata']['name']} already exists")
        objects.append(generated)
    elif behavior in ("replace", "merge"):
        if len(existing) != 1:
            raise ValueError(
                f"{behavior}: no {generated['kind']}/{generated['metadata']['name']} to {behavior}"
            )
        target = existing[0]
        if behavior == "replace":
            objects[objects.index(target)] = generated
        else:
            merged = copy.deepcopy(target)
            merged["data"] = {**target.get("data", {}), **generated["data"]}
            objects[objects.index(target)] = merged
    else:
        raise ValueError(f"unknown generator behavior {behavior!r}")
