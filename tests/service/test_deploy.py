"""The deployment files under docker/ agree with the code: compose references exist, the Prometheus config and
the dashboard queries are valid (promtool: CI installs the Debian package `prometheus`), the dashboard uses only
metrics the service exports, the service image holds no torch and no image runs as root, the API scales behind
HAProxy (whose config `haproxy -c` accepts: the Debian package `haproxy`) and only HAProxy is published.

No Docker engine is needed: these are static checks of the files against the package (and the API's health check
command, run against a real server). tests/service/test_replicas.py runs the HAProxy config for real.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nextstep.cli import build_parser
from nextstep.service.app import create_app
from nextstep.service.metrics import Metrics
from nextstep.service.settings import Settings

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE = DOCKER / "compose.yaml"
PROMETHEUS = DOCKER / "prometheus" / "prometheus.yml"
HAPROXY = DOCKER / "haproxy" / "haproxy.cfg"
DASHBOARDS = DOCKER / "grafana" / "dashboards"
SERVICE_DOCKERFILE = DOCKER / "service.Dockerfile"
TRAIN_DOCKERFILE = DOCKER / "train.Dockerfile"
# bind-mount sources the user creates (trained artifacts), not files of the repository
RUNTIME_SOURCES = {"../artifacts"}
CLI_VARIABLES = {"NEXTSTEP_DEMO"}  # read by `nextstep serve` (nextstep/cli.py), not by the service's Settings


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not on PATH; install it (Debian/Ubuntu: `apt-get install prometheus`)")
    return path


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comments dropped, continuation lines joined."""
    logical, current = [], ""
    for line in dockerfile.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        logical.append(current + stripped)
        current = ""
    assert not current, f"{dockerfile.name}: dangling line continuation"
    out = []
    for text in logical:
        keyword, _, args = text.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def _env(dockerfile: Path) -> dict[str, str]:
    env = {}
    for keyword, args in _instructions(dockerfile):
        if keyword == "ENV":
            for item in shlex.split(args):
                key, sep, value = item.partition("=")
                assert sep, f"{dockerfile.name}: use ENV KEY=VALUE, got {item!r}"
                env[key] = value
    return env


def _uninterpolated(volume: str) -> str:
    """A short-syntax volume with each ${VAR...} replaced by $VAR (its default may hold a colon)."""
    return re.sub(r"\$\{[^}]*\}", "$VAR", volume)


def _bind_mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) of a compose service's volumes that are bind mounts (short or long syntax)."""
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            if volume.get("type") == "bind":
                mounts.append((volume["source"], volume["target"]))
            continue
        source, _, rest = _uninterpolated(volume).partition(":")
        if source.startswith((".", "/", "$", "~")):
            mounts.append((source, rest.split(":")[0]))
    return mounts


def _named_volumes(service: dict) -> list[str]:
    names = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            if volume.get("type") == "volume":
                names.append(volume["source"])
            continue
        source = _uninterpolated(volume).partition(":")[0]
        if not source.startswith((".", "/", "$", "~")):
            names.append(source)
    return names


# -- compose ---------------------------------------------------------------------------------------------------


def test_compose_references_exist():
    compose = _compose()
    services = compose["services"]
    assert {"api", "haproxy", "redis", "prometheus", "grafana", "train"} <= set(services)
    declared_volumes = set(compose.get("volumes") or {})
    checked = 0
    for name, service in services.items():
        build = service.get("build")
        if build is not None:
            context = (DOCKER / build["context"]).resolve()
            assert context.is_dir(), f"{name}: build context {build['context']} missing"
            dockerfile = context / build.get("dockerfile", "Dockerfile")
            assert dockerfile.is_file(), f"{name}: dockerfile {dockerfile} missing"
            for keyword, args in _instructions(dockerfile):  # COPY sources lie in the context
                if keyword in ("COPY", "ADD") and "--from" not in args:
                    sources = [a for a in shlex.split(args) if not a.startswith("--")][:-1]
                    for source in sources:
                        assert (context / source).exists(), f"{dockerfile.name}: COPY source {source} missing"
                        checked += 1
        for source, target in _bind_mounts(service):
            if "$" in source or source in RUNTIME_SOURCES:
                continue  # external data or files the user produces
            assert (DOCKER / source).exists(), f"{name}: bind mount {source} -> {target} missing"
            checked += 1
        for volume in _named_volumes(service):
            assert volume in declared_volumes, f"{name}: volume {volume} not declared at the top level"
    assert checked >= 7


def test_compose_wiring():
    services = _compose()["services"]
    api, redis = services["api"], services["redis"]
    assert api["build"]["dockerfile"] == "docker/service.Dockerfile"
    assert services["train"]["build"]["dockerfile"] == "docker/train.Dockerfile"
    assert services["train"]["profiles"] == ["train"]
    assert api["environment"]["NEXTSTEP_REDIS_URL"] == "redis://redis:6379/0"
    assert api["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "redis-cli" in redis["healthcheck"]["test"] and "ping" in redis["healthcheck"]["test"]
    assert "--appendonly" in redis["command"] and "/data" in str(redis["volumes"])
    assert ("../artifacts", "/artifacts") in _bind_mounts(api)
    assert any(v.startswith("../artifacts:/artifacts:ro") for v in api["volumes"] if isinstance(v, str))
    # every NEXTSTEP_* variable given to the service is a real setting (or one `nextstep serve` reads itself)
    env = {**_env(SERVICE_DOCKERFILE), **api["environment"]}
    fields = {f"NEXTSTEP_{name.upper()}" for name in Settings.model_fields} | CLI_VARIABLES
    unknown = sorted(k for k in env if k.startswith("NEXTSTEP_") and k not in fields)
    assert not unknown, f"not settings of nextstep/service/settings.py: {unknown}"
    assert env["NEXTSTEP_ARTIFACTS_DIR"] == "/artifacts"


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} and ${VAR} with the given environment ($$ stays an escaped $)."""
    def one(match: re.Match) -> str:
        name, default = match.group(1), match.group(3)
        return env.get(name) or (default or "")
    return re.sub(r"(?<!\$)\$\{(\w+)(:-([^}]*))?\}", one, text)


def test_every_image_tag_is_pinned_to_an_exact_version():
    for name, service in _compose()["services"].items():
        if "build" in service:
            continue  # built here from the repository
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: image {image} is not pinned to x.y.z"


def test_the_api_is_published_on_loopback_unless_told_otherwise():
    """Through HAProxy: the API containers publish nothing (so `--scale api=N` binds no host port twice)."""
    services = _compose()["services"]
    (port,) = services["haproxy"]["ports"]
    assert _interpolate(port, {}) == "127.0.0.1:8000:8000"
    assert _interpolate(port, {"NEXTSTEP_BIND": "0.0.0.0"}) == "0.0.0.0:8000:8000"
    assert "ports" not in services["api"]
    for name, service in _compose()["services"].items():  # nothing else is published beyond loopback
        for published in service.get("ports", []):
            assert _interpolate(str(published), {}).startswith("127.0.0.1:"), f"{name}: {published}"


def test_no_default_credentials():
    compose = _compose()
    text = COMPOSE.read_text()
    assert not re.search(r":-\s*admin\b", text), "a default admin password"
    grafana = compose["services"]["grafana"]
    env = grafana["environment"]
    assert _interpolate(env["GF_SECURITY_ADMIN_PASSWORD"], {}) == ""  # only from the environment
    assert _interpolate(env["GF_SECURITY_ADMIN_PASSWORD"], {"GRAFANA_ADMIN_PASSWORD": "s3cret"}) == "s3cret"
    assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"  # anonymous visitors only view
    # with no password given, the entrypoint sets a random one before Grafana creates its admin user; run that
    # shell line for real (Compose turns $$ into $) with /run.sh replaced by printing what Grafana would get
    entrypoint = [part.replace("$$", "$") for part in grafana["entrypoint"]]
    assert entrypoint[:2] == ["/bin/sh", "-c"] and entrypoint[2].endswith("exec /run.sh")
    script = entrypoint[2].removesuffix("exec /run.sh") + 'printf %s "$GF_SECURITY_ADMIN_PASSWORD"'
    passwords = [subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, check=True,
                                env={"PATH": "/usr/bin:/bin", "GF_SECURITY_ADMIN_PASSWORD": given}).stdout
                 for given in ("", "", "s3cret")]
    assert passwords[0] != passwords[1] and len(passwords[0]) >= 24 and "admin" not in passwords[:2]
    assert passwords[2] == "s3cret"
    api = compose["services"]["api"]["environment"]
    assert _interpolate(api["NEXTSTEP_API_KEYS"], {}) == ""  # no built-in key either


def test_the_api_serves_the_bundled_demo_models_when_artifacts_are_empty(tmp_path, monkeypatch):
    """Compose's default NEXTSTEP_DEMO makes the image's command serve the demo models bundled in the package
    (which the image installs: package data) instead of exiting and restart-looping on an empty ../artifacts."""
    api = _compose()["services"]["api"]
    demo_env = _interpolate(api["environment"]["NEXTSTEP_DEMO"], {})
    instructions = _instructions(SERVICE_DOCKERFILE)
    (cmd,) = [_exec_form(args) for keyword, args in instructions if keyword == "CMD"]
    monkeypatch.setenv("NEXTSTEP_DEMO", demo_env)
    assert build_parser().parse_args(cmd[1:]).demo is True
    monkeypatch.setenv("NEXTSTEP_DEMO", _interpolate(api["environment"]["NEXTSTEP_DEMO"], {"NEXTSTEP_DEMO": "false"}))
    assert build_parser().parse_args(cmd[1:]).demo is False
    # the demo models are package data: a wheel of the package (what the image installs) holds them
    import zipfile

    from nextstep.demo import BUNDLED, MODELS
    pyproject = (DOCKER.parent / "pyproject.toml").read_text()
    assert 'nextstep = ["demo_artifacts/*/*/*"]' in pyproject
    source = tmp_path / "source"  # the image's COPY: pyproject.toml, constraints.txt, README.md, nextstep/
    source.mkdir()
    for name in ("pyproject.toml", "constraints.txt", "README.md"):
        shutil.copy2(DOCKER.parent / name, source / name)
    shutil.copytree(DOCKER.parent / "nextstep", source / "nextstep", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("nextstep-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for model in MODELS:
        for f in (BUNDLED / model / "demo").iterdir():
            assert f"nextstep/demo_artifacts/{model}/demo/{f.name}" in names


# -- Prometheus and Grafana ------------------------------------------------------------------------------------


def test_prometheus_config_is_valid():
    result = subprocess.run([_promtool(), "check", "config", str(PROMETHEUS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load(PROMETHEUS.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "nextstep-api"]
    assert job["scrape_interval"] == "5s"
    assert job.get("metrics_path", "/metrics") == "/metrics"
    # every replica is a target of its own (its counters are its process's): Docker DNS, one A record per container
    (sd,) = job["dns_sd_configs"]
    assert (sd["names"], sd["type"], sd["port"]) == (["api"], "A", 8000)
    assert "static_configs" not in job
    (haproxy,) = [j for j in config["scrape_configs"] if j["job_name"] == "haproxy"]
    assert haproxy["static_configs"][0]["targets"] == ["haproxy:8404"]
    # the paths the deployment relies on are routes of the app
    paths = {getattr(route, "path", None) for route in create_app(Settings(redis_url=None)).routes}
    assert {"/healthz", "/readyz", "/metrics"} <= paths


# -- several replicas behind HAProxy ---------------------------------------------------------------------------


def _haproxy() -> str:
    path = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if path is None:
        pytest.fail("haproxy is not on PATH; install it (Debian/Ubuntu: `apt-get install haproxy`)")
    return path


def _haproxy_sections() -> dict[str, list[list[str]]]:
    """docker/haproxy/haproxy.cfg as {"backend api": [[keyword, args...], ...], ...}, comments dropped."""
    sections, current = {}, None
    for line in HAPROXY.read_text().splitlines():
        words = line.split("#")[0].split()
        if not words:
            continue
        if not line[0].isspace():
            current = " ".join(words)
            sections[current] = []
        else:
            sections[current].append(words)
    return sections


def test_haproxy_config_is_valid():
    result = subprocess.run([_haproxy(), "-c", "-f", str(HAPROXY)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_api_scales_behind_haproxy():
    """`docker compose up --scale api=N`: nothing in the api service is per container (no container name, no host
    port), HAProxy finds every replica through Docker's DNS and sends traffic to those that answer /readyz."""
    services = _compose()["services"]
    api, proxy = services["api"], services["haproxy"]
    assert "container_name" not in api and "ports" not in api
    assert [str(p) for p in api["expose"]] == ["8000"]
    (cmd,) = [_exec_form(args) for keyword, args in _instructions(SERVICE_DOCKERFILE) if keyword == "CMD"]
    assert build_parser().parse_args(cmd[1:]).port == 8000
    # HAProxy: the official image reads /usr/local/etc/haproxy/haproxy.cfg; the file is the one tested here
    assert ("./haproxy/haproxy.cfg", "/usr/local/etc/haproxy/haproxy.cfg") in _bind_mounts(proxy)
    assert any(v.endswith(":ro") for v in proxy["volumes"])
    assert proxy["image"].startswith("haproxy:") and "api" in proxy["depends_on"]
    sections = _haproxy_sections()
    assert ["bind", ":8000"] in sections["frontend api"]  # the published container port
    assert ["default_backend", "api"] in sections["frontend api"]
    backend = sections["backend api"]
    assert ["balance", "roundrobin"] in backend
    (template,) = [w for w in backend if w[0] == "server-template"]
    _, prefix, slots, address, *options = template
    assert address == "api:8000" and int(slots) >= 3  # the service name and its port; one slot per replica
    assert options[options.index("resolvers") + 1] == "docker" and options[options.index("init-addr") + 1] == "none"
    (nameserver,) = [w for w in sections["resolvers docker"] if w[0] == "nameserver"]
    assert nameserver[2] == "127.0.0.11:53"  # Docker's embedded DNS server
    # health checks: GET /readyz, 200 only, on every server
    assert ["option", "httpchk"] in backend
    (send,) = [w for w in backend if w[:2] == ["http-check", "send"]]
    assert send[send.index("meth") + 1] == "GET" and send[send.index("uri") + 1] == "/readyz"
    assert ["http-check", "expect", "status", "200"] in backend
    (default,) = [w for w in backend if w[0] == "default-server"]
    assert "check" in default
    # the stats frontend is where Prometheus scrapes HAProxy, and is not published
    assert ["bind", ":8404"] in sections["frontend stats"]
    assert not any("8404" in str(p) for p in proxy["ports"])


def test_the_api_health_check_is_readiness(redis_process, artifacts, serve):
    """The api service's health check asks /readyz: run its command for real (with the port of a test server):
    healthy while Redis answers, unhealthy while it does not, healthy again after."""
    api = _compose()["services"]["api"]
    test = api["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python" and "/readyz" in test[3]
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art, redis_url=redis_process.url)) as url:
        command = [sys.executable, *test[2:]]
        command[-1] = command[-1].replace("http://127.0.0.1:8000", url)
        assert url in command[-1]
        assert subprocess.run(command, capture_output=True, timeout=10).returncode == 0
        redis_process.stop()
        assert subprocess.run(command, capture_output=True, timeout=10).returncode != 0
        redis_process.start()
        assert subprocess.run(command, capture_output=True, timeout=10).returncode == 0


def test_grafana_provisioning_points_at_the_stack():
    datasources = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/dashboards.yml").read_text())
    mounts = dict(_bind_mounts(_compose()["services"]["grafana"]))
    for provider in providers["providers"]:  # the provider's path is where compose mounts the dashboards
        assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    for dashboard in DASHBOARDS.glob("*.json"):
        uids = {d["uid"] for d in _walk(json.loads(dashboard.read_text()), "datasource") if isinstance(d, dict)}
        assert uids == {source["uid"]}, f"{dashboard.name}: data sources {uids}"


def _walk(node, key):
    """Every value stored under `key` anywhere in a JSON document."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                yield v
            yield from _walk(v, key)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item, key)


def _exported_names() -> set[str]:
    """Every series name the service's registry can expose (labelled metrics have no samples until used)."""
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("", "_sum", "_count", "_created"), "gauge": ("",)}
    names = set()
    for family in Metrics().registry.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}


def _metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords, labels or durations."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors and $__rate_interval
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)  # label lists
    names = set()
    for match in re.finditer(r"(?<![\w.$])[a-zA-Z_:][\w:]*", expr):
        if expr[match.end():].lstrip().startswith("("):
            continue  # a function or aggregation
        if match.group().lower() not in PROMQL_WORDS:
            names.add(match.group())
    return names


def _dashboard_queries() -> list[tuple[str, str]]:
    queries = []
    for dashboard in sorted(DASHBOARDS.glob("*.json")):
        queries += [(dashboard.name, expr) for expr in _walk(json.loads(dashboard.read_text()), "expr")]
    return queries


def test_dashboard_uses_only_exported_metrics():
    queries = _dashboard_queries()
    assert len(queries) >= 8
    exported = _exported_names()
    used = set()
    for name, expr in queries:
        metrics = _metric_names(expr)
        assert metrics, f"{name}: no metric in {expr!r}"
        unknown = metrics - exported
        assert not unknown, f"{name}: {sorted(unknown)} not exported by nextstep/service/metrics.py ({expr!r})"
        used |= metrics
    # the dashboard shows each family of the service
    families = {f.name for f in Metrics().registry.collect()}
    shown = {f for f in families if any(n == f or n.startswith(f + "_") for n in used)}
    assert shown == families, f"not on the dashboard: {sorted(families - shown)}"


def test_dashboard_queries_parse(tmp_path):
    """promtool parses every query (as a recording rule, Grafana's $__rate_interval replaced by 1m)."""
    rules = [{"record": f"dashboard:query_{i}", "expr": expr.replace("$__rate_interval", "1m")}
             for i, (_, expr) in enumerate(_dashboard_queries())]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_metric_name_extraction():
    assert _metric_names('histogram_quantile(0.99, sum by (le, route) (rate(a_bucket{x="y(z)"}[5m])))') == {
        "a_bucket"}
    assert _metric_names("(sum(rate(b_total[$__rate_interval])) or vector(0)) / sum(c)") == {"b_total", "c"}


# -- images ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", [SERVICE_DOCKERFILE, TRAIN_DOCKERFILE, DOCKER / "artifacts.Dockerfile"],
                         ids=lambda p: p.name)
def test_images_run_as_non_root(dockerfile):
    users = [args for keyword, args in _instructions(dockerfile) if keyword == "USER"]
    assert users, f"{dockerfile.name}: no USER instruction (the image would run as root)"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"{dockerfile.name}: runs as {users[-1]}"


def test_service_image_installs_serve_only():
    instructions = _instructions(SERVICE_DOCKERFILE)
    runs = " ".join(args for keyword, args in instructions if keyword == "RUN")
    assert "torch" not in " ".join(args for _, args in instructions).lower()
    assert "-c constraints.txt" in runs and "'.[serve]'" in runs
    assert "[train" not in runs and "[dev" not in runs
    (base,) = [args for keyword, args in instructions if keyword == "FROM"]
    assert base == "python:3.11-slim"
    assert [args for keyword, args in instructions if keyword == "EXPOSE"] == ["8000"]
    (health,) = [args for keyword, args in instructions if keyword == "HEALTHCHECK"]
    assert "/healthz" in health and "curl" not in health and "wget" not in health
    # the command is a valid `nextstep serve` invocation
    (cmd,) = [_exec_form(args) for keyword, args in instructions if keyword == "CMD"]
    assert cmd[0] == "nextstep"
    args = build_parser().parse_args(cmd[1:])
    assert (args.command, args.host, args.port, args.demo) == ("serve", "0.0.0.0", 8000, False)


def test_train_image_installs_cpu_torch():
    instructions = _instructions(TRAIN_DOCKERFILE)
    runs = " ".join(args for keyword, args in instructions if keyword == "RUN")
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs
    assert "'.[train,serve,client]'" in runs and "-c constraints.txt" in runs  # (serve, client: nextstep retrain)
    (entrypoint,) = [_exec_form(args) for keyword, args in instructions if keyword == "ENTRYPOINT"]
    assert entrypoint == ["nextstep"]
    (cmd,) = [_exec_form(args) for keyword, args in instructions if keyword == "CMD"]
    with pytest.raises(SystemExit) as exit_:  # `--help` prints the usage and exits 0
        build_parser().parse_args(cmd)
    assert exit_.value.code == 0
    train = _compose()["services"]["train"]
    targets = {target for _, target in _bind_mounts(train)}
    assert targets == {"/data", "/artifacts"}
    assert any(v.endswith(":/data:ro") for v in train["volumes"])
