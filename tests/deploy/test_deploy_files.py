"""The files under deploy/: they parse, their configurations load, and every command they run is
one the ``kvstore`` CLI has, with flags it accepts and settings that exist.

No docker, kubectl or systemd is needed: the files are read, not applied. The compose health
check, being Python, is run against a real metadata service and daemon.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvstore import cli
from kvstore.config import Config, load_config, parse_size

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CONFIGS = DEPLOY / "configs"
COMPOSE = DEPLOY / "docker" / "compose.yaml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
K8S = DEPLOY / "k8s"
SYSTEMD = DEPLOY / "systemd"

YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
CONFIG_FILES = sorted(CONFIGS.glob("*.yaml"))
UNIT_FILES = sorted(SYSTEMD.glob("*.service"))


def _rel(p: Path) -> str:
    return str(p.relative_to(REPO))


# ---- helpers ------------------------------------------------------------------------------------


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    for action in cli._parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("kvstore CLI has no subcommands")


def _parse(argv: list[str], where: str) -> argparse.Namespace:
    """Parses ``kvstore argv`` as the CLI would; a test failure naming ``where`` if it refuses."""
    assert argv, f"{where}: empty command"
    assert argv[0] in _subcommands(), f"{where}: {argv[0]!r} is not a kvstore subcommand ({', '.join(_subcommands())})"
    try:
        return cli._parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: kvstore refuses the arguments {argv}")


def _effective_config(
    argv: list[str], env: dict[str, str], config_dir: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> Config:
    """The configuration ``kvstore argv`` would run with, given its environment; ``--config`` paths
    are looked up by file name in ``config_dir`` (where the deployment gets them from)."""
    ns = _parse(argv, where)
    if ns.config:
        local = config_dir / Path(ns.config).name
        assert local.is_file(), f"{where}: --config {ns.config} has no source {_rel(local)}"
        ns.config = str(local)
    for name in list(os.environ):
        if name.startswith("KVSTORE_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, str(value))
    return cli._config(ns)


def _docker_size(value: str | int) -> int:
    """Compose sizes (shm_size): b, k, m, g suffixes, powers of 1024."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([bkmg]?)b?\s*", str(value).lower())
    assert m, f"cannot read compose size {value!r}"
    return int(float(m.group(1)) * {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)])


def _port(addr: str) -> int:
    return int(addr.rpartition(":")[2])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- every YAML file ----------------------------------------------------------------------------


def test_deploy_has_the_expected_yaml_files():
    names = {_rel(p) for p in YAML_FILES}
    assert "deploy/docker/compose.yaml" in names
    assert {"single-node.yaml", "cluster-meta.yaml", "cluster-daemon.yaml"} <= {p.name for p in CONFIG_FILES}
    assert len(list(K8S.glob("*.yaml"))) >= 3


@pytest.mark.parametrize("path", YAML_FILES, ids=_rel)
def test_yaml_file_parses(path: Path):
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs, f"{_rel(path)} has no documents"
    assert all(isinstance(d, dict) for d in docs), f"{_rel(path)}: every document should be a mapping"


# ---- deploy/configs -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", CONFIG_FILES, ids=_rel)
def test_config_loads(path: Path):
    cfg = load_config(path, env={})
    assert isinstance(cfg, Config)
    assert not cfg.meta.allow_clock_skew, "allow_clock_skew is for tests only"
    sections = yaml.safe_load(path.read_text())
    assert set(sections) <= {"meta", "daemon", "client", "log", "tls", "cluster"}
    if cfg.meta.listen and not cfg.meta.listen.startswith(("127.", "localhost", "[::1]")) and "meta" in sections:
        # A cluster listener off loopback: TLS files, or plaintext said out loud.
        assert cfg.tls.enabled or cfg.tls.allow_plaintext, path


def test_config_roles():
    single = load_config(CONFIGS / "single-node.yaml", env={})
    assert single.meta.listen.startswith("127.0.0.1:") and _port(single.client.meta) == _port(single.meta.listen)

    meta = load_config(CONFIGS / "cluster-meta.yaml", env={})
    assert meta.meta.listen.rpartition(":")[0] in ("0.0.0.0", "[::]"), "a cluster's metadata service listens on all"

    daemon = load_config(CONFIGS / "cluster-daemon.yaml", env={})
    assert _port(daemon.daemon.meta) == _port(meta.meta.listen)
    assert daemon.daemon.data_port and daemon.daemon.control_port, "cluster daemons use fixed ports"
    assert daemon.daemon.data_port != daemon.daemon.control_port
    assert daemon.daemon.shm_dir == "/dev/shm"


# ---- docker -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_base_install_and_entrypoint():
    ins = _dockerfile_instructions()
    assert [r for op, r in ins if op == "FROM"] == ["python:3.11-slim"]
    runs = " ".join(r for op, r in ins if op == "RUN")
    assert re.search(r"pip install (\S+ )*\.(\s|$)", runs), "the image installs the package from the context root"
    assert "torch" not in runs.lower(), "the store needs no torch"
    assert [r for op, r in ins if op == "ENTRYPOINT"] == ['["kvstore"]']
    users = [r for op, r in ins if op == "USER"]
    assert users and not users[-1].startswith(("root", "0")), "the image runs unprivileged"


def test_dockerfile_copies_exist_and_are_not_ignored():
    ignored = {
        line.strip().rstrip("/")
        for line in (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    copies = [r for op, r in _dockerfile_instructions() if op == "COPY"]
    assert copies
    for rest in copies:
        *sources, _dest = [a for a in rest.split() if not a.startswith("--")]
        for src in sources:
            assert (REPO / src).exists(), f"Dockerfile copies {src}, which is not in the repository"
            assert src.rstrip("/").split("/")[0] not in ignored, f"{src} is excluded from the build context"
    # The compose files read their configs from /etc/kvstore in the image.
    assert any(r.split()[-2:] == ["deploy/configs/", "/etc/kvstore/"] for r in copies)


def _kvstore_services(compose: dict) -> dict[str, dict]:
    """The compose services that run the kvstore image (not Prometheus, Grafana)."""
    return {
        n: s for n, s in compose["services"].items() if s.get("build") or str(s.get("image", "")).startswith("kvstore:")
    }


def test_compose_services_run_existing_subcommands(compose):
    services = _kvstore_services(compose)
    assert services
    used = set()
    for name, svc in services.items():
        assert svc.get("image") or svc.get("build"), f"service {name} has no image"
        assert isinstance(svc["command"], list), f"service {name}: command should be a list (exec form)"
        used.add(_parse(svc["command"], f"compose service {name}").cmd)
    assert {"meta", "daemon"} <= used


def test_compose_one_meta_two_daemons_with_health_checks(compose, monkeypatch):
    services = _kvstore_services(compose)
    build = services[next(iter(services))].get("build")
    assert build and (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE.resolve()

    metas = {n: s for n, s in services.items() if s["command"][0] == "meta"}
    daemons = {n: s for n, s in services.items() if s["command"][0] == "daemon"}
    assert len(metas) == 1 and len(daemons) == 2
    (meta_name, meta_svc), = metas.items()  # fmt: skip
    meta_cfg = _effective_config(meta_svc["command"], meta_svc.get("environment", {}), CONFIGS, monkeypatch, meta_name)
    meta_port = _port(meta_cfg.meta.listen)
    assert meta_cfg.meta.listen.rpartition(":")[0] in ("0.0.0.0", "[::]")

    check = meta_svc["healthcheck"]["test"]
    assert check[:3] == ["CMD", "python", "-c"] and _port(check[-1]) == meta_port

    ids = set()
    for name, svc in daemons.items():
        cfg = _effective_config(svc["command"], svc.get("environment", {}), CONFIGS, monkeypatch, name)
        d = cfg.daemon
        meta_host, _, port = d.meta.rpartition(":")
        assert meta_host == meta_name and int(port) == meta_port, f"{name}: daemon.meta {d.meta}"
        assert d.host == svc["hostname"], f"{name}: daemon.host must be the name it is reachable by"
        assert d.daemon_id and d.daemon_id not in ids, f"{name}: needs its own stable daemon_id"
        ids.add(d.daemon_id)
        assert d.data_port and d.control_port
        assert _docker_size(svc["shm_size"]) > d.dram_bytes, f"{name}: shm_size must hold daemon.dram_bytes"
        assert svc["depends_on"][meta_name]["condition"] == "service_healthy"
        check = svc["healthcheck"]["test"]
        assert check[:3] == ["CMD", "python", "-c"] and check[-1] == f"{d.host}:{d.control_port}"
        for key in ("interval", "timeout", "retries"):
            assert key in svc["healthcheck"]

    for name, svc in services.items():
        if svc["command"][0] == "stat":
            cfg = _effective_config(svc["command"], svc.get("environment", {}), CONFIGS, monkeypatch, name)
            assert cfg.client.meta == f"{meta_name}:{meta_port}"


def _health(script: str, addr: str) -> int:
    return subprocess.run([sys.executable, "-c", script, addr], capture_output=True, timeout=60).returncode


def test_compose_health_check_against_real_servers(compose, cluster):
    services = _kvstore_services(compose)
    scripts = {svc["command"][0]: svc["healthcheck"]["test"][3] for svc in services.values() if "healthcheck" in svc}
    assert set(scripts) == {"meta", "daemon"}
    cluster.start_meta()
    daemon = cluster.start_daemon()
    assert _health(scripts["meta"], cluster.meta_addr) == 0
    assert _health(scripts["daemon"], f"127.0.0.1:{daemon.info['control_port']}") == 0
    assert _health(scripts["meta"], f"127.0.0.1:{_free_port()}") != 0, "nothing listening must be unhealthy"


# ---- kubernetes ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def k8s() -> list[dict]:
    return [d for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def _one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _container(workload: dict) -> dict:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def _k8s_configs(docs: list[dict], tmp_path: Path) -> Path:
    """Writes the ConfigMap's files to ``tmp_path`` (what pods see at its mount path)."""
    for name, text in _one(docs, "ConfigMap", "kvstore-config")["data"].items():
        (tmp_path / name).write_text(text)
    return tmp_path


def _k8s_cfg(docs, kind: str, tmp_path: Path, monkeypatch, placeholders: dict[str, str]) -> tuple[dict, Config]:
    workload = _one(docs, kind)
    c = _container(workload)
    env = {}
    for e in c.get("env", []):
        if e["name"].startswith("KVSTORE_"):
            env[e["name"]] = e.get("value", placeholders.get(e["name"], "x"))
    cfg = _effective_config(c["args"], env, _k8s_configs(docs, tmp_path), monkeypatch, f"{kind} {c['name']}")
    mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
    config_arg = c["args"][c["args"].index("--config") + 1]
    vol = mounts.get(str(Path(config_arg).parent))
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    assert vol and volumes[vol]["configMap"]["name"] == _one(docs, "ConfigMap", "kvstore-config")["metadata"]["name"]
    return workload, cfg


def test_k8s_kinds_and_metadata(k8s):
    kinds = [d["kind"] for d in k8s]
    assert {"Namespace", "ConfigMap", "Deployment", "Service", "DaemonSet"} <= set(kinds)
    ns = _one(k8s, "Namespace")["metadata"]["name"]
    for d in k8s:
        assert d.get("apiVersion") and d["metadata"].get("name"), d
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == ns, f"{d['kind']} {d['metadata']['name']} outside {ns}"
    # Applied in file-name order: the namespace must come first.
    first = yaml.safe_load(sorted(K8S.glob("*.yaml"))[0].read_text())
    assert first["kind"] == "Namespace"


def test_k8s_configmap_configs_load(k8s, tmp_path):
    cm = _one(k8s, "ConfigMap", "kvstore-config")
    assert {"meta.yaml", "daemon.yaml"} <= set(cm["data"])
    for name, text in cm["data"].items():
        (tmp_path / name).write_text(text)
        load_config(tmp_path / name, env={})


def test_k8s_meta_deployment_and_service(k8s, tmp_path, monkeypatch):
    dep, cfg = _k8s_cfg(k8s, "Deployment", tmp_path, monkeypatch, {})
    c = _container(dep)
    assert c["args"][0] == "meta"
    assert dep["spec"]["replicas"] == 1, "one metadata service per cluster"
    assert dep["spec"]["strategy"]["type"] == "Recreate"
    port = _port(cfg.meta.listen)
    assert cfg.meta.listen.rpartition(":")[0] in ("0.0.0.0", "[::]")
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == port, f"{probe} must use the gRPC health service on {port}"
        assert c[probe]["grpc"].get("service", "") in ("", "kvstore.v1.MetaService")
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert dep["spec"]["template"]["spec"].get("enableServiceLinks") is False

    svc = _one(k8s, "Service")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (sp,) = svc["spec"]["ports"]
    named = {p.get("name"): p["containerPort"] for p in c["ports"]}
    assert named.get(sp["targetPort"], sp["targetPort"]) == port

    # Daemons and clients find it by the Service's name.
    daemon_cfg = load_config(tmp_path / "daemon.yaml", env={})
    assert daemon_cfg.daemon.meta == f"{svc['metadata']['name']}:{sp['port']}"
    client_cfg = load_config(tmp_path / "client.yaml", env={})
    assert client_cfg.client.meta.split(".")[0].split(":")[0] == svc["metadata"]["name"]
    assert _port(client_cfg.client.meta) == sp["port"]


def test_k8s_daemonset(k8s, tmp_path, monkeypatch):
    placeholders = {"KVSTORE_DAEMON__HOST": "10.1.2.3", "KVSTORE_DAEMON__DAEMON_ID": "node-a"}
    ds, cfg = _k8s_cfg(k8s, "DaemonSet", tmp_path, monkeypatch, placeholders)
    c = _container(ds)
    pod = ds["spec"]["template"]["spec"]
    assert c["args"][0] == "daemon"
    assert cfg.daemon.host == "10.1.2.3" and cfg.daemon.daemon_id == "node-a"
    env = {e["name"]: e for e in c["env"]}
    assert env["KVSTORE_DAEMON__HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "fieldRef" in env["KVSTORE_DAEMON__DAEMON_ID"]["valueFrom"], "a stable id from the downward API"
    assert pod.get("enableServiceLinks") is False

    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    shm = mounts[cfg.daemon.shm_dir]["emptyDir"]
    assert cfg.daemon.shm_dir == "/dev/shm"
    assert shm["medium"] == "Memory"
    assert parse_size(shm["sizeLimit"]) > cfg.daemon.dram_bytes, "the /dev/shm volume must hold the segment"
    data = mounts[cfg.daemon.data_dir]
    assert "emptyDir" in data or "hostPath" in data

    res = c["resources"]
    assert res["requests"]["cpu"] and res["requests"]["memory"]
    assert parse_size(res["limits"]["memory"]) > parse_size(shm["sizeLimit"]), "shm pages count as container memory"

    ports = {p["containerPort"] for p in c["ports"]}
    assert {cfg.daemon.data_port, cfg.daemon.control_port} <= ports
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == cfg.daemon.control_port


# ---- systemd ------------------------------------------------------------------------------------


def _unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Sections of a unit file as (key, value) lists: keys such as Environment= repeat."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in re.sub(r"\\\n", " ", path.read_text()).splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None and "=" in line, f"{path.name}: cannot read {raw!r}"
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def _get(section: list[tuple[str, str]], key: str) -> list[str]:
    return [v for k, v in section if k == key]


def test_systemd_has_meta_and_daemon_template():
    assert {p.name for p in UNIT_FILES} == {"kvstore-meta.service", "kvstore-daemon@.service"}


@pytest.mark.parametrize("path", UNIT_FILES, ids=lambda p: p.name)
def test_systemd_unit(path: Path, monkeypatch):
    unit = _unit(path)
    assert {"Unit", "Service", "Install"} <= set(unit)
    svc = unit["Service"]
    (exec_start,) = _get(svc, "ExecStart")
    argv = shlex.split(exec_start)
    assert argv[0].startswith("/") and argv[0].endswith("/bin/kvstore"), "ExecStart needs the venv's absolute path"
    ns = _parse(argv[1:], path.name)
    expected = "daemon" if "@" in path.name else "meta"
    assert ns.cmd == expected
    assert _get(svc, "Restart") == ["on-failure"]
    assert _get(svc, "LimitMEMLOCK"), "LimitMEMLOCK must be set"
    (user,) = _get(svc, "User")
    assert user and user not in ("root", "0")
    assert _get(unit["Install"], "WantedBy")

    env = {}
    for value in _get(svc, "Environment"):
        for item in shlex.split(value):
            k, _, v = item.partition("=")
            env[k] = v
    kvstore_env = {k: v for k, v in env.items() if k.startswith("KVSTORE_") and "__" in k}
    if ns.config and Path(ns.config).name in {p.name for p in CONFIG_FILES}:
        _effective_config(argv[1:], kvstore_env, CONFIGS, monkeypatch, path.name)
    else:
        load_config(env=kvstore_env)  # every KVSTORE_<SECTION>__<KEY> names a real setting

    if expected == "daemon":
        assert "%i" in exec_start, "each instance gets its own config and data dir"
        assert _get(svc, "RemoveIPC") == ["no"], "the DRAM segment must survive restarts"
        assert not _get(svc, "PrivateDevices") and not _get(svc, "PrivateIPC")


def test_systemd_user_matches_sysusers():
    users = {line.split()[1] for line in (SYSTEMD / "kvstore.sysusers.conf").read_text().splitlines()
             if line.startswith("u ")}  # fmt: skip
    for path in UNIT_FILES:
        assert set(_get(_unit(path)["Service"], "User")) <= users


# ---- references between files ------------------------------------------------------------------


def test_every_path_the_deploy_files_mention_exists():
    files = [p for p in DEPLOY.rglob("*") if p.is_file()]
    missing = []
    for p in files:
        text = p.read_text()
        for m in re.finditer(r"(?<![\w/.-])deploy/[\w./@-]*", text):
            ref = m.group(0).rstrip(".")
            tail = ref[len("deploy/") :]
            if "/" not in tail and "." not in tail:
                continue  # not a path: `kubectl exec deploy/kvstore-meta`
            if not (REPO / ref).exists():
                missing.append(f"{_rel(p)}: {ref}")
    for m in re.finditer(r"\]\(([^)#]+)\)", (DEPLOY / "README.md").read_text()):
        if not re.match(r"\w+://", m.group(1)) and not (DEPLOY / m.group(1)).exists():
            missing.append(f"deploy/README.md: link {m.group(1)}")
    assert not missing, "\n".join(missing)


# ---- monitoring ---------------------------------------------------------------------------------

MONITORING = DEPLOY / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "kvstore.json"


def _dashboard_metrics() -> set[str]:
    import json

    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    names = set()
    for e in exprs:
        names |= set(re.findall(r"\bkvstore_[a-z0-9_]+", e))
    return names


def test_compose_runs_prometheus_and_grafana_on_the_servers_metrics_ports(compose, monkeypatch):
    services = compose["services"]
    prom, graf = services["prometheus"], services["grafana"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in prom["volumes"]}
    (src, dst), = mounts.items()  # fmt: skip
    assert (COMPOSE.parent / src).resolve() == (MONITORING / "prometheus.yml").resolve()
    assert f"--config.file={dst}" in prom["command"]
    scrape = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    targets = {j["job_name"]: set(j["static_configs"][0]["targets"]) for j in scrape["scrape_configs"]}
    want_meta, want_daemons = set(), set()
    for name, svc in _kvstore_services(compose).items():
        if svc.get("profiles"):
            continue
        cfg = _effective_config(svc["command"], svc.get("environment", {}), CONFIGS, monkeypatch, name)
        if svc["command"][0] == "meta":
            assert cfg.meta.metrics_port > 0 and cfg.meta.metrics_host == "0.0.0.0"
            want_meta.add(f"{name}:{cfg.meta.metrics_port}")
        else:
            assert cfg.daemon.metrics_port > 0 and cfg.daemon.metrics_host == "0.0.0.0"
            want_daemons.add(f"{svc['hostname']}:{cfg.daemon.metrics_port}")
    assert targets == {"kvstore-meta": want_meta, "kvstore-daemon": want_daemons}
    gmounts = {(COMPOSE.parent / v.split(":")[0]).resolve(): v.split(":")[1] for v in graf["volumes"]}
    assert gmounts[(MONITORING / "grafana" / "provisioning").resolve()] == "/etc/grafana/provisioning"
    dash_dir = gmounts[DASHBOARD.parent.resolve()]
    provider = yaml.safe_load((MONITORING / "grafana/provisioning/dashboards/kvstore.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == dash_dir
    source = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    import json

    uids = {t["datasource"]["uid"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]}
    assert uids == {source["datasources"][0]["uid"]}


def test_k8s_pods_are_annotated_with_their_metrics_ports(k8s, tmp_path, monkeypatch):
    cm = next(d for d in k8s if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kvstore-config")
    ports = {}
    for fname, section in (("meta.yaml", "meta"), ("daemon.yaml", "daemon")):
        path = tmp_path / fname
        path.write_text(cm["data"][fname])
        ports[section] = getattr(load_config(str(path), env={}), section).metrics_port
    for name, section in (("kvstore-meta", "meta"), ("kvstore-daemon", "daemon")):
        wl = next(d for d in k8s if d["kind"] in ("Deployment", "DaemonSet") and d["metadata"]["name"] == name)
        ann = wl["spec"]["template"]["metadata"]["annotations"]
        assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == ports[section]
        c = wl["spec"]["template"]["spec"]["containers"][0]
        assert {"name": "metrics", "containerPort": ports[section], "protocol": "TCP"} in c["ports"]
    mon = next(d for d in k8s if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "kvstore-prometheus")
    jobs = {j["job_name"] for j in yaml.safe_load(mon["data"]["prometheus.yml"])["scrape_configs"]}
    assert jobs == {"kvstore-meta", "kvstore-daemon"}
    ds = next(d for d in k8s if d["kind"] == "DaemonSet")
    c = ds["spec"]["template"]["spec"]["containers"][0]
    # A daemon is restarted only when its process stops answering, never because the service is away.
    assert c["livenessProbe"]["grpc"]["service"] == "kvstore.liveness"
    assert c["startupProbe"]["grpc"]["service"] == "kvstore.liveness"
    assert c["readinessProbe"]["grpc"].get("service", "") == ""


def test_dashboard_queries_name_only_metrics_the_servers_export(tmp_path):
    """Every metric a dashboard panel queries is exported by a real service and a real daemon
    with an SSD segment (scraped and parsed with prometheus-client's parser)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from kvstore.procs import start

    child = start(["serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "d"), "--dram", "16MiB",
                   "--metrics-port", "0", "--set", "daemon.ssd_bytes=16MiB"], cwd=REPO)  # fmt: skip
    try:
        from kvstore import SyncKVStoreClient

        with SyncKVStoreClient(child.info["meta"]) as c:
            c.lookup([b"\x01" * 16])  # an RPC, so that its histogram has samples
            c.remove([b"\x02" * 16])
        with urllib.request.urlopen(f"http://127.0.0.1:{child.info['metrics_port']}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        child.stop()
    exported = set()
    for fam in text_string_to_metric_families(text):
        exported |= {s.name for s in fam.samples}
    # Counters whose value is 0 still export (an error counter exports once an error happened).
    exported.add("kvstore_rpc_errors_total")
    missing = sorted(_dashboard_metrics() - exported)
    assert not missing, f"dashboard queries metrics nobody exports: {missing}"
    # The hit-rate panel: hits (every get's, fast-path reads included) over hits and misses.
    import json

    panel = next(p for p in json.loads(DASHBOARD.read_text())["panels"] if p["title"] == "Hit rate of gets")
    names = set(re.findall(r"\bkvstore_[a-z0-9_]+", panel["targets"][0]["expr"]))
    assert names == {"kvstore_meta_hits_total", "kvstore_meta_misses_total"} and names <= exported
    assert "kvstore_meta_touch_interval_seconds" in panel["description"]
    assert "kvstore_meta_touch_interval_seconds" in exported


def test_the_secured_cluster_files_load(tmp_path):
    """deploy/security: the configurations load once their certificate paths exist, the auth
    example parses, and the identities the configs rely on are in it."""
    from kvstore.certs import make
    from kvstore.meta.auth import Authority

    make(tmp_path / "tls", ("meta", "daemon", "ops", "tenant-a"))
    sec = REPO / "deploy" / "security"
    auth = tmp_path / "auth.yaml"
    auth.write_text((sec / "auth.example.yaml").read_text())
    for name in ("meta", "daemon", "client"):
        text = (sec / f"{name}.yaml").read_text().replace("/etc/kvstore/tls", str(tmp_path / "tls"))
        text = text.replace("/etc/kvstore/auth.yaml", str(auth))
        p = tmp_path / f"{name}.yaml"
        p.write_text(text)
        cfg = load_config(p, env={})
        assert cfg.tls.enabled and not cfg.tls.allow_plaintext, name
    a = Authority(str(auth), str(tmp_path / "secret"))
    assert a.certs["daemon"].role == "daemon" and a.certs["ops"].role == "admin"
    assert a.certs["tenant-a"].role == "tenant"


# ---- a sharded cluster --------------------------------------------------------------------------


def test_sharded_configs_name_one_cluster():
    meta = load_config(CONFIGS / "sharded-meta.yaml", env={})
    daemon = load_config(CONFIGS / "sharded-daemon.yaml", env={})
    client = load_config(CONFIGS / "sharded-client.yaml", env={})
    assert meta.cluster.redis and meta.cluster.shards >= 1
    assert daemon.cluster.redis == meta.cluster.redis and daemon.cluster.name == meta.cluster.name
    assert client.client.meta == f"{meta.cluster.redis}#{meta.cluster.name}"
    assert (DEPLOY / "redis" / "sentinel.conf").read_text().count("sentinel monitor kvstore ") == 1


def test_k8s_sharded_manifests(tmp_path):
    docs = [d for p in sorted((K8S / "sharded").glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    cm = _one(docs, "ConfigMap", "kvstore-sharded-config")
    for name in ("meta.yaml", "daemon.yaml", "client.yaml"):
        (tmp_path / name).write_text(cm["data"][name])
    meta = load_config(tmp_path / "meta.yaml", env={})
    daemon = load_config(tmp_path / "daemon.yaml", env={})
    assert daemon.cluster.redis == meta.cluster.redis
    sts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    # A primary and a standby per shard; the shard comes from the pod's ordinal.
    assert sts["kvstore-meta"]["spec"]["replicas"] == 2 * meta.cluster.shards
    args = sts["kvstore-meta"]["spec"]["template"]["spec"]["containers"][0]["args"][0]
    assert f"% {meta.cluster.shards}" in args and "cluster.advertise=" in args
    assert sts["kvstore-redis"]["spec"]["replicas"] == 3
    sentinel = cm["data"]["sentinel.conf"]
    assert "kvstore-redis-0.kvstore-redis 6379 2" in sentinel
    assert meta.cluster.redis.endswith("/kvstore") and meta.cluster.redis.count(":26379") == 3
