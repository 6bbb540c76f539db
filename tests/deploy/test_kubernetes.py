"""The Kubernetes manifests under deploy/kubernetes/: valid against the Kubernetes API schemas (offline: the
`kubernetes-validate` package bundles them), rendered by `kubectl kustomize` where kubectl is installed, and in
agreement with the code: probes on routes the app has, the port `nextstep serve` listens on, only real settings in
the ConfigMap, the image's user, placeholder API keys that stop a pod from starting (the check runs for real).

No cluster is needed.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from nextstep.cli import build_parser
from nextstep.service.app import create_app
from nextstep.service.settings import Settings, SettingsError

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
KUSTOMIZATION = K8S / "kustomization.yaml"
OPTIONAL = {"servicemonitor.yaml",  # needs the Prometheus Operator's CRDs: not in the kustomization
            "retrain-cronjob.yaml"}  # needs a shared artifacts volume in place of the artifacts image
CLI_VARIABLES = {"NEXTSTEP_DEMO"}  # read by `nextstep serve`, not by Settings
# the oldest Kubernetes these manifests claim (README.md) and the newest the package knows
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
POD_LABELS = {"app.kubernetes.io/name": "nextstep-api"}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _manifests() -> dict[str, list[dict]]:
    return {p.name: _docs(p) for p in sorted(K8S.glob("*.yaml")) if p.name != KUSTOMIZATION.name}


def _one(kind: str) -> dict:
    (doc,) = [d for docs in _manifests().values() for d in docs if d["kind"] == kind]
    return doc


def _deployment() -> dict:
    return _one("Deployment")


def _pod() -> dict:
    return _deployment()["spec"]["template"]["spec"]


def _container(name: str, init: bool = False) -> dict:
    (c,) = [c for c in _pod()["initContainers" if init else "containers"] if c["name"] == name]
    return c


def _validate(doc: dict) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


# -- schemas and kustomize -----------------------------------------------------------------------------------------


def test_manifests_validate_against_the_kubernetes_schemas():
    kinds = []
    for name, docs in _manifests().items():
        for doc in docs:
            if name in OPTIONAL:
                continue
            try:
                _validate(doc)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc}")
            kinds.append(doc["kind"])
    assert sorted(kinds) == ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Namespace",
                             "PodDisruptionBudget", "Secret", "Service"]


@pytest.mark.parametrize("mutate, where", [
    (lambda d: d["spec"].__setitem__("replicas", "two"), "replicas"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__("readinesProbe", {}), "readinesProbe"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].__setitem__("containerPort", "http"),
     "containerPort"),
], ids=["wrong-type", "unknown-field", "port-name-as-number"])
def test_the_schema_check_catches_mistakes(mutate, where):
    """The validation is not vacuous: a wrong type or a misspelt field in the Deployment is an error."""
    doc = copy.deepcopy(_deployment())
    mutate(doc)
    with pytest.raises(kubernetes_validate.ValidationError, match=where):
        _validate(doc)


def test_the_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load(KUSTOMIZATION.read_text())
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    assert set(listed) == set(_manifests()) - OPTIONAL
    assert all((K8S / r).is_file() for r in listed)
    # the image names the manifests use are the ones the kustomization pins
    images = {i["name"]: i for i in kustomization["images"]}
    pod = _pod()
    used = {c["image"] for c in pod["containers"] + pod["initContainers"]}
    assert used == set(images) == {"nextstep-api", "nextstep-artifacts"}
    for image in images.values():
        assert image["newTag"] and image["newTag"] != "latest"


def test_kustomize_renders_valid_manifests():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomization is checked statically only (test above)")
    result = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert sorted(d["kind"] for d in rendered) == sorted(
        d["kind"] for name, docs in _manifests().items() if name not in OPTIONAL for d in docs)
    for doc in rendered:
        _validate(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "nextstep", doc["kind"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "nextstep"
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert {c["image"] for c in pod["containers"] + pod["initContainers"]} == {
        "registry.example.com/nextstep-api:0.1.0", "registry.example.com/nextstep-artifacts:0.1.0"}
    assert deployment["spec"]["selector"]["matchLabels"] == POD_LABELS  # part-of stays out of selectors


# -- the manifests agree with the code -----------------------------------------------------------------------------


def test_probes_port_and_scrape_annotations_match_the_app():
    api = _container("api")
    args = build_parser().parse_args(api["args"][1:])
    assert api["args"][0] == "nextstep" and args.command == "serve"
    assert (args.host, args.workers, args.demo) == ("0.0.0.0", 1, False)
    (port,) = api["ports"]
    assert (port["name"], port["containerPort"]) == ("http", args.port)
    routes = {getattr(r, "path", None) for r in create_app(Settings(redis_url=None)).routes}
    probes = {kind: api[kind]["httpGet"] for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert {k: p["path"] for k, p in probes.items()} == {
        "startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    assert all(p["port"] == "http" and p["path"] in routes for p in probes.values())
    # /readyz waits up to 2 s for Redis: the probe must wait longer than that
    assert api["readinessProbe"]["timeoutSeconds"] > 2
    annotations = _deployment()["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == args.port
    assert annotations["prometheus.io/path"] == "/metrics" and "/metrics" in routes


def test_service_hpa_pdb_and_servicemonitor_point_at_the_pods():
    deployment = _deployment()
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == POD_LABELS
    assert POD_LABELS.items() <= labels.items()
    service, pdb, hpa = _one("Service"), _one("PodDisruptionBudget"), _one("HorizontalPodAutoscaler")
    assert service["spec"]["selector"] == POD_LABELS
    assert pdb["spec"]["selector"]["matchLabels"] == POD_LABELS
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] == "http" and service_port["name"] == "http"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    # CPU utilization is measured against requests: every container must request CPU
    assert all("cpu" in c["resources"]["requests"] for c in _pod()["containers"])
    # a drain can always proceed (maxUnavailable 1) and never empties the service (at least 2 replicas)
    assert pdb["spec"]["maxUnavailable"] == 1 and hpa["spec"]["minReplicas"] >= 2
    assert deployment["spec"]["replicas"] == hpa["spec"]["minReplicas"]
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    monitor = yaml.safe_load((K8S / "servicemonitor.yaml").read_text())
    assert monitor["kind"] == "ServiceMonitor" and monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"] and endpoint["path"] == "/metrics"


def test_pods_run_unprivileged_with_a_read_only_root():
    pod = _pod()
    assert pod["automountServiceAccountToken"] is False
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["seccompProfile"]["type"] == "RuntimeDefault"
    # the uid the service image creates and runs as (docker/service.Dockerfile)
    dockerfile = (REPO / "docker" / "service.Dockerfile").read_text()
    assert f"--uid {security['runAsUser']} " in dockerfile and f"--gid {security['runAsGroup']} " in dockerfile
    for c in pod["containers"] + pod["initContainers"]:
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"], c["name"]
        assert "memory" in c["resources"]["limits"], c["name"]
    # what the API may write: nothing but /tmp; the artifacts are read-only to it
    mounts = {m["mountPath"]: m for m in _container("api")["volumeMounts"]}
    assert set(mounts) == {"/artifacts", "/tmp"} and mounts["/artifacts"]["readOnly"] is True
    assert mounts["/tmp"].get("readOnly") is not True and "emptyDir" in {v["name"]: v for v in pod["volumes"]}[
        mounts["/tmp"]["name"]]
    assert _namespace_labels()["pod-security.kubernetes.io/enforce"] == "restricted"


def _namespace_labels() -> dict:
    return _one("Namespace")["metadata"]["labels"]


def test_the_configmap_holds_settings_and_the_secret_holds_the_keys():
    config, secret = _one("ConfigMap")["data"], _one("Secret")["stringData"]
    fields = {f"NEXTSTEP_{name.upper()}" for name in Settings.model_fields} | CLI_VARIABLES
    assert not sorted(set(config) - fields), "not settings of nextstep/service/settings.py"
    assert set(secret) == {"NEXTSTEP_API_KEYS", "NEXTSTEP_ADMIN_KEYS"} <= fields
    assert not any("KEY" in k or "PASSWORD" in k for k in config)
    assert config["NEXTSTEP_DEMO"] == "false" and config["NEXTSTEP_REDIS_URL"].startswith("redis://")
    # the settings parse as the service will read them
    settings = Settings(**{k.removeprefix("NEXTSTEP_").lower(): v for k, v in config.items() if k not in CLI_VARIABLES})
    assert str(settings.artifacts_dir) == "/artifacts"
    api = _container("api")
    assert api["envFrom"] == [{"configMapRef": {"name": _one("ConfigMap")["metadata"]["name"]}},
                                           {"secretRef": {"name": _one("Secret")["metadata"]["name"]}}]
    # the artifacts volume is mounted where the settings say the artifacts are
    assert any(m["mountPath"] == config["NEXTSTEP_ARTIFACTS_DIR"] for m in api["volumeMounts"])


def _check_keys(env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run the check-keys init container's command (python -c SCRIPT) with this environment."""
    command = _container("check-keys", init=True)["command"]
    assert command[:2] == ["python", "-c"]
    return subprocess.run([sys.executable, *command[1:]], env={"PATH": os.environ.get("PATH", ""), **env},
                          capture_output=True, text=True, timeout=30)


def test_placeholder_or_missing_keys_stop_the_pod():
    check = _container("check-keys", init=True)
    assert check["image"] == _container("api")["image"]  # it needs python: the API image
    assert check["envFrom"] == [{"secretRef": {"name": _one("Secret")["metadata"]["name"]}}]
    assert _pod()["initContainers"][0]["name"] == "check-keys"  # before anything else
    shipped = _one("Secret")["stringData"]
    result = _check_keys(shipped)
    assert result.returncode != 0
    assert "NEXTSTEP_API_KEYS" in result.stderr and "NEXTSTEP_ADMIN_KEYS" in result.stderr
    good = "3f6c1e0a9b7d42e8a1c5f0e2d4b6a8c9"
    # an empty or blank entry beside good ones, a key with a space or not a string: the service refuses them too
    entries = [(good, json.dumps(["", good[::-1]])), (good, json.dumps([" " * 20, good[::-1]])),
               (f"{good},", good[::-1]), (f"{good},,{good[::-1]}", good[::-1]), (json.dumps([f" {good}"]), good[::-1]),
               (json.dumps([good, 12]), good[::-1]), ("[not json", good[::-1])]
    for api_keys, admin_keys in [("", good), (good, ""), (good, "changeme"), (good, f"{good},REPLACE-ME-later"),
                                 (f"{good},replace_me_please_xx", good), (" , ", good), *entries]:
        result = _check_keys({"NEXTSTEP_API_KEYS": api_keys, "NEXTSTEP_ADMIN_KEYS": admin_keys})
        assert result.returncode != 0, (api_keys, admin_keys)
        assert "Traceback" not in result.stderr and "NEXTSTEP_" in result.stderr, result.stderr
    for api_keys, admin_keys in entries:
        with pytest.raises(SettingsError):
            Settings(api_keys=api_keys, admin_keys=admin_keys)
    assert _check_keys({"NEXTSTEP_ADMIN_KEYS": good}).returncode != 0  # unset
    admin = "a7c2e9f14b3d8e6052c1f9a8d7b3e4c1"
    for api_keys in (good, f"{good}, {good[::-1]}", json.dumps([good, good[::-1]])):
        result = _check_keys({"NEXTSTEP_API_KEYS": api_keys, "NEXTSTEP_ADMIN_KEYS": admin})
        assert result.returncode == 0, result.stderr
        assert Settings(api_keys=api_keys).api_keys in ([good], [good, good[::-1]])  # what the service reads


def test_artifacts_come_from_the_artifacts_image(tmp_path):
    """The init container copies the artifacts image's /artifacts into the volume the API mounts read-only; run its
    command on a copy of the bundled demo models and check the tree arrives whole."""
    pod = _pod()
    copier = _container("copy-artifacts", init=True)
    (mount,) = copier["volumeMounts"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mount["name"]]
    assert any(m["name"] == mount["name"] and m["readOnly"] for m in _container("api")["volumeMounts"])
    dockerfile = REPO / "docker" / "artifacts.Dockerfile"
    text = dockerfile.read_text()
    assert "COPY artifacts /artifacts" in text and "USER 10001:10001" in text
    assert (REPO / "docker" / "artifacts.Dockerfile.dockerignore").read_text().splitlines()[-2:] == ["*", "!artifacts"]
    command = copier["command"]
    assert command[:2] == ["cp", "-R"] and command[2] == "/artifacts/." and command[3] == mount["mountPath"] + "/"
    image, volume = tmp_path / "image-artifacts", tmp_path / "volume"
    shutil.copytree(REPO / "nextstep" / "demo_artifacts", image)
    volume.mkdir()
    subprocess.run(["cp", "-R", f"{image}/.", f"{volume}/"], check=True)
    files = sorted(p.relative_to(image) for p in image.rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(volume) for p in volume.rglob("*") if p.is_file())
    assert all((volume / f).read_bytes() == (image / f).read_bytes() for f in files)
