"""Dockerfile and deploy/: hadolint, Kubernetes schema validation (offline schemas shipped by the
kubernetes-validate package), and the cross-references between the pieces (ports, probes, labels,
metric names) that no schema checks."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
K8S_VERSIONS = ("1.28.0", "1.33.0")     # an older and a current cluster


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def resources() -> dict[str, dict]:
    return {d["kind"]: d for p in MANIFESTS for d in docs(p)}


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    assert found, f"{name} is not installed (make setup installs it)"
    return found


def test_hadolint_passes():
    r = subprocess.run([_tool("hadolint"), "--no-color", "Dockerfile"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """The check is not vacuous: an unpinned image and pip install fail it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN pip install fastapi\n")
    r = subprocess.run([_tool("hadolint"), "--no-color", str(bad)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "DL3013" in r.stdout


def test_dockerfile_uses_the_tested_triton_version():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM nvcr\.io/nvidia/tritonserver:24\.10-py3$", text, re.M)
    # 24.10 ships Triton 2.51: the same server version as the tritonclient the tests pin.
    assert "tritonclient[all]==2.51.0" in (ROOT / "pyproject.toml").read_text()
    for copied in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / copied).exists(), copied
    assert "deploy/serve_container.py" in text


def test_dockerignore_keeps_local_state_out():
    lines = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "models"} <= lines


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(path, version):
    import kubernetes_validate

    for doc in docs(path):
        kubernetes_validate.validate(doc, version, strict=True)   # raises on any error


def test_schema_validation_is_not_vacuous():
    import kubernetes_validate
    from kubernetes_validate.utils import ValidationError

    bad = json.loads(json.dumps(resources()["Deployment"]))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "8080"
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_deployment_gpu_probes_and_service_agree():
    r = resources()
    pod = r["Deployment"]["spec"]["template"]
    (c,) = pod["spec"]["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"openai": 8080, "http": 8000, "grpc": 8001, "metrics": 8002}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    assert c["startupProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "openai"}
    assert any(v["mountPath"] == "/dev/shm" for v in c["volumeMounts"])
    svc = r["Service"]["spec"]
    labels = pod["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["selector"].items())
    assert {p["targetPort"] for p in svc["ports"]} <= set(ports)
    ann = pod["metadata"]["annotations"]
    assert ann["prometheus.io/port"] == str(ports["metrics"])


def test_hpa_scales_on_waiting_requests_through_the_adapter():
    r = resources()
    hpa = r["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == r["Deployment"]["metadata"]["name"]
    (metric,) = hpa["metrics"]
    name = metric["pods"]["metric"]["name"]
    rules = yaml.safe_load(r["ConfigMap"]["data"]["config.yaml"])["rules"]
    rule = next(x for x in rules if x["name"]["as"] == name)
    assert rule["seriesQuery"].startswith("vllm:num_requests_waiting{")
    assert re.fullmatch(rule["name"]["matches"], "vllm:num_requests_waiting")


def test_prometheus_scrape_config_targets_triton_metrics():
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    keep = [rl for rl in jobs["pagedbackend"]["relabel_configs"] if rl.get("action") == "keep"]
    assert any(rl["regex"] == "pagedbackend" for rl in keep)
    address = next(rl for rl in jobs["pagedbackend"]["relabel_configs"]
                   if rl.get("target_label") == "__address__")
    joined = "10.0.0.7:8080;8002"       # what Prometheus joins source labels into
    assert re.sub(f"^(?:{address['regex']})$", address["replacement"].replace("$", "\\"),
                  joined) == "10.0.0.7:8002"
    assert jobs["pagedbackend-local"]["static_configs"][0]["targets"] == ["127.0.0.1:8002"]


def _exported_metrics() -> set[str]:
    """The vllm:* names the engine model publishes (parsed from its source, so they stay in step)."""
    src = ROOT / "pagedbackend" / "serving" / "metrics.py"
    if not src.exists():
        pytest.skip("the engine's metrics module is not there yet")
    return set(re.findall(r'"(vllm:[a-z0-9_]+)"', src.read_text()))


def test_grafana_dashboard_uses_exported_metrics():
    dash = json.loads((DEPLOY / "grafana" / "pagedbackend-dashboard.json").read_text())
    assert dash["uid"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exported = _exported_metrics()
    used = set()
    for p in dash["panels"]:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            for m in re.findall(r"vllm:[a-z0-9_]+", t["expr"]):
                base = re.sub(r"_(bucket|sum|count)$", "", m)
                assert base in exported, (p["title"], m)
                used.add(base)
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds"} <= used


def test_kustomization_lists_existing_files():
    k = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = list(k["resources"]) + [f for g in k["configMapGenerator"] for f in g["files"]]
    assert all((DEPLOY / f).exists() for f in files)
    assert {f"kubernetes/{p.name}" for p in MANIFESTS} == set(k["resources"])


def test_container_entrypoint_commands(tmp_path, monkeypatch):
    """The container's two commands: Triton on all interfaces, the gateway pointed at its gRPC."""
    sys.path.insert(0, str(DEPLOY))
    try:
        import serve_container
    finally:
        sys.path.remove(str(DEPLOY))
    import pagedbackend.serving.launcher as launcher
    monkeypatch.setattr(serve_container, "find_tritonserver", lambda: Path("/x/bin/tritonserver"))
    monkeypatch.setattr(serve_container, "backend_directory", lambda b, w: Path("/x/backends"))
    monkeypatch.setenv("PAGEDBACKEND_BLOCK_SIZE", "32")
    args = serve_container.parse_args(["--served-model-name", "a", "b"])
    triton, gateway = serve_container.commands(args, tmp_path)
    assert triton[:1] == ["/x/bin/tritonserver"]
    flags = dict(zip(triton[1::2], triton[2::2]))
    assert flags["--http-address"] == "0.0.0.0" and flags["--grpc-port"] == "8001"
    assert flags["--metrics-port"] == "8002"
    engine_cfg = (tmp_path / "model_repository" / "engine" / "config.pbtxt").read_text()
    assert re.search(r'key: "block_size"\s+value: \{ string_value: "32" \}', engine_cfg)
    assert 'string_value: "/' in engine_cfg.split('key: "model"')[1][:80]   # absolute model dir
    g = dict(zip(gateway[3::2], gateway[4::2]))
    assert gateway[1:3] == ["-m", "client.openai_gateway"]
    assert g["--triton-grpc"] == "127.0.0.1:8001" and g["--port"] == "8080"
    assert gateway[-3:] == ["--served-model-name", "a", "b"]
    assert launcher.REPO_ROOT == ROOT
