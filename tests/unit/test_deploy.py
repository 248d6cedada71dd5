"""deploy/ validated offline and held against the code.

Schemas: every Kubernetes object against the Kubernetes API schema (kubernetes-validate, strict: an
unknown field fails) for the oldest and newest versions we claim; the KEDA ScaledObject against
`deploy/schemas/keda-scaledobject.schema.json`; the Envoy bootstrap against Envoy's v3 API
(envoy-data-plane's message classes, typed configs unpacked). Then the manifests against the code: the
pod's commands render a repository and name real console scripts, ports agree everywhere, metric names
exist, the KEDA target derives from the measured capacity, the namespace and image tag are set once.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tandem.backend.metrics import BY_NAME
from tandem.backend.model.checkpoint import save_checkpoint
from tandem.backend.model.config import ModelConfig
from tandem.backend.model.decoder import Decoder
from tandem.cli.make_repository import main as tandem_repo
from tandem.transfer.control import control_dir
from tests.support.snac_dir import write_snac_dir

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S_VERSIONS = ("1.29.0", "1.37.0")


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _kustomization() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


def _all_objects() -> list[tuple[str, dict[str, Any]]]:
    return [(name, d) for name in _kustomization()["resources"] for d in _docs(name)]


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for _, d in _all_objects() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _container(obj: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _server() -> dict[str, Any]:
    return _container(_one("StatefulSet", "tandem-unit"), "server")


def _console_scripts() -> set[str]:
    return {ep.name for ep in importlib.metadata.entry_points(group="console_scripts")}


# --- schemas -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_objects_validate_strictly(version):
    checked = 0
    for _name, obj in _all_objects():
        if obj["apiVersion"].startswith("keda.sh/"):
            continue
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked >= 7, "namespace, StatefulSet, two Services, PVC, router Deployment, NetworkPolicy"


def test_the_schema_check_catches_a_misspelled_field():
    svc = json.loads(json.dumps(_one("Service", "tandem-unit")))
    svc["spec"]["portz"] = svc["spec"].pop("ports")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(svc, K8S_VERSIONS[-1], strict=True)


def _keda_schema() -> dict[str, Any]:
    return json.loads((DEPLOY / "schemas" / "keda-scaledobject.schema.json").read_text())


def test_scaled_object_validates_against_the_keda_schema():
    jsonschema.validate(_one("ScaledObject"), _keda_schema())
    broken = json.loads(json.dumps(_one("ScaledObject")))
    broken["spec"]["triggers"][0]["metadata"]["treshold"] = "35"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, _keda_schema())


def _envoy_bootstrap(cfg: dict[str, Any]) -> Any:
    # Each typed config is unpacked by the class registered for its type URL: import them first.
    for url in set(re.findall(r"type\.googleapis\.com/([\w.]+)", json.dumps(cfg))):
        importlib.import_module("envoy_data_plane." + url.rsplit(".", 1)[0])
    from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap

    return Bootstrap.from_dict(cfg)


def _envoy() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "router" / "envoy.yaml").read_text())


def test_envoy_config_parses_against_the_v3_api():
    boot = _envoy_bootstrap(_envoy())
    assert [lst.name for lst in boot.static_resources.listeners] == ["grpc", "http"]
    broken = _envoy()
    hcm = broken["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["stat_prefixx"] = hcm.pop("stat_prefix")
    with pytest.raises((KeyError, ValueError, TypeError)):
        _envoy_bootstrap(broken)


# --- kustomize: namespace, image, files ------------------------------------------------------------


def test_namespace_and_image_are_set_once_in_kustomize():
    k = _kustomization()
    assert k["namespace"] == _one("Namespace")["metadata"]["name"]
    for name, obj in _all_objects():
        assert "namespace" not in obj["metadata"], f"{name}: {obj['kind']} hard-codes a namespace"
    version = importlib.metadata.version("tandem-tts")
    tags = {i["name"]: i["newTag"] for i in k["images"]}
    assert tags["tandem-tts"] == version
    for kind in ("StatefulSet", "Deployment"):
        for c in _one(kind)["spec"]["template"]["spec"]["containers"]:
            assert ":" not in c["image"], f"{c['name']}: the tag belongs in kustomization.yaml"
            assert c["image"] in tags and tags[c["image"]] != "latest"
            assert c["imagePullPolicy"] == "IfNotPresent"
    for gen in k["configMapGenerator"]:
        for f in gen["files"]:
            assert (DEPLOY / f.split("=", 1)[-1]).is_file()
    assert (DEPLOY / "Dockerfile").is_file()


# --- the unit pod against the code ------------------------------------------------------------------


def test_unit_pod_command_renders_a_repository(tmp_path, monkeypatch):
    script = _server()["args"][0]
    repo_cmd = shlex.split(script.split("&&")[0].replace('"$(POD_NAME)"', "tandem-unit-0"))
    assert repo_cmd[0] == "tandem-repo"
    ckpt, snac = tmp_path / "ckpt", write_snac_dir(tmp_path / "snac")
    orpheus_layout = ModelConfig(
        name="orpheus-layout-tiny",
        vocab_size=156940,
        row_width=1,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        eos_token_id=128258,
    )
    save_checkpoint(Decoder.random(orpheus_layout, "cpu", seed=0), ckpt)
    paths = {"/models/tts": str(ckpt), "/models/snac_24khz": str(snac)}
    args = [paths.get(a, a) for a in repo_cmd[1:]]
    args[args.index("--out") + 1] = str(tmp_path / "repo")
    assert tandem_repo(args) == 0
    repo = tmp_path / "repo"
    # The measured unit: Orpheus with SNAC behind the vocoder; P, D and the vocoder on the pod's one GPU.
    for model in ("prefill", "decode", "vocoder"):
        assert "gpus: [ 0 ]" in (repo / model / "config.pbtxt").read_text()
    decode = (repo / "decode" / "config.pbtxt").read_text()
    assert 'string_value: "cuda_ipc"' in decode and 'string_value: "snac"' in decode
    assert _server()["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "rm -rf /run/tandem/repo/tts_mono" in script  # as measured: no monolithic baseline
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert control_dir("tandem-unit-0").name.endswith("tandem-unit-0")  # pod names are valid unit names


def test_scaling_is_keda_s_alone():
    sts = _one("StatefulSet", "tandem-unit")
    assert "replicas" not in sts["spec"], "KEDA owns the scale: a replicas field resets it on every apply"
    ref = _one("ScaledObject")["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "StatefulSet", "tandem-unit")


def test_ports_match_the_server_command_and_the_makefile():
    c = _server()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    script = c["args"][0]
    for name, flag in (("grpc", "--grpc-port"), ("metrics", "--metrics-port")):
        assert f"{flag} {ports[name]}" in script
    assert "--http-address 127.0.0.1" in script, "Triton's HTTP (control APIs) stays inside the pod"
    makefile = (ROOT / "Makefile").read_text()
    assert f"GRPC_PORT ?= {ports['grpc']}" in makefile and f"METRICS_PORT ?= {ports['metrics']}" in makefile


def test_probes_use_real_console_scripts_and_the_metrics_port():
    c = _server()
    metrics_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
    scripts = _console_scripts()
    for probe in ("readinessProbe", "startupProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[0] in scripts
        assert f"127.0.0.1:{metrics_port}/metrics" in cmd[cmd.index("--metrics-url") + 1]
    assert "--allow-draining" not in c["readinessProbe"]["exec"]["command"], "a draining D is not ready"
    gateway = _container(_one("StatefulSet", "tandem-unit"), "gateway")
    assert gateway["command"][0] in scripts


def test_services_policy_and_router_agree_on_ports():
    sts = _one("StatefulSet", "tandem-unit")
    pod_ports = {
        p["name"]: p["containerPort"]
        for c in sts["spec"]["template"]["spec"]["containers"]
        for p in c["ports"]
    }
    svc = _one("Service", "tandem-unit")
    assert svc["spec"]["clusterIP"] == "None"
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(pod_ports)
    policy = _one("NetworkPolicy")
    from_router, from_monitoring = policy["spec"]["ingress"]
    assert from_router["from"][0]["podSelector"]["matchLabels"] == _one("Deployment")["metadata"]["labels"]
    assert {p["port"] for p in from_router["ports"]} == {pod_ports["grpc"], pod_ports["http-gateway"]}
    assert {p["port"] for p in from_monitoring["ports"]} == {pod_ports["metrics"]}
    envoy = _envoy()["static_resources"]
    listen = {lst["name"]: lst["address"]["socket_address"]["port_value"] for lst in envoy["listeners"]}
    router_svc = {p["name"]: p["port"] for p in _one("Service", "tandem-router")["spec"]["ports"]}
    assert router_svc == listen
    upstream = {
        c["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
            "port_value"
        ]
        for c in envoy["clusters"]
    }
    assert upstream == {pod_ports["grpc"], pod_ports["http-gateway"]}
    assert envoy is not None and _envoy()["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"


def test_the_api_key_comes_from_the_mounted_secret():
    """The launcher locks Triton's control APIs with TANDEM_API_KEY_FILE (serving/api_key.py): it must
    point into the mount of the tandem-api-key Secret, or each pod would generate a key of its own."""
    c = _server()
    env = {e["name"]: e.get("value") for e in c["env"]}
    volumes = _one("StatefulSet", "tandem-unit")["spec"]["template"]["spec"]["volumes"]
    secret = next(v for v in volumes if "secret" in v)
    mount = next(m for m in c["volumeMounts"] if m["name"] == secret["name"])
    assert secret["secret"]["secretName"] == "tandem-api-key" and mount["readOnly"]
    assert env["TANDEM_API_KEY_FILE"] == mount["mountPath"] + "/key"
    assert "TANDEM_API_LOCK" not in env, "the lock stays on in a deployment"
    assert not _one("StatefulSet", "tandem-unit")["spec"]["template"]["spec"].get("shareProcessNamespace")


def _claims(pod: dict[str, Any]) -> dict[str, str]:
    """volume name -> claim name of a pod spec's PVC volumes."""
    return {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }


def test_checkpoint_claim_is_defined_and_a_job_fills_it():
    """The units mount the checkpoints read-only; the fill Job writes them where the server's
    `tandem-repo --checkpoint --codec` reads them."""
    pod = _one("StatefulSet", "tandem-unit")["spec"]["template"]["spec"]
    claim = _claims(pod)["models"]
    assert "ReadOnlyMany" in _one("PersistentVolumeClaim", claim)["spec"]["accessModes"]
    mount = next(m for m in _server()["volumeMounts"] if m["name"] == "models")
    assert mount["readOnly"]
    job = _one("Job", "tandem-fill-checkpoints")["spec"]["template"]["spec"]
    assert _claims(job) == {"models": claim}
    fill = job["containers"][0]
    assert (
        not fill["volumeMounts"][0].get("readOnly")
        and fill["volumeMounts"][0]["mountPath"] == mount["mountPath"]
    )
    script = fill["args"][0]
    args = shlex.split(_server()["args"][0].split("&&")[0])
    for flag in ("--checkpoint", "--codec"):
        assert f'local_dir="{args[args.index(flag) + 1]}"' in script, flag
    compile(script, "fill", "exec")  # the Job's Python parses


def test_registered_voices_live_on_a_shared_volume():
    """Voices outlive the pod and every unit sees them: the unit's --state-dir is a ReadWriteMany
    claim's mount (backend/voices/store.py: <state dir>/voices)."""
    pod = _one("StatefulSet", "tandem-unit")["spec"]["template"]["spec"]
    mount = next(m for m in _server()["volumeMounts"] if m["name"] == "voices")
    assert _one("PersistentVolumeClaim", _claims(pod)["voices"])["spec"]["accessModes"] == ["ReadWriteMany"]
    unit = shlex.split(_server()["args"][0].split("exec ", 1)[1])
    assert unit[unit.index("--state-dir") + 1] == mount["mountPath"]


def test_the_gateway_takes_tenant_keys_from_a_secret_and_trusts_only_the_router():
    pod = _one("StatefulSet", "tandem-unit")["spec"]["template"]["spec"]
    gw = _container(_one("StatefulSet", "tandem-unit"), "gateway")
    cmd = gw["command"]
    keys = next(v for v in pod["volumes"] if v["name"] == "gateway-keys")
    mount = next(m for m in gw["volumeMounts"] if m["name"] == "gateway-keys")
    assert keys["secret"]["secretName"] == "tandem-gateway-keys" and mount["readOnly"]
    assert cmd[cmd.index("--api-keys") + 1] == mount["mountPath"] + "/keys"
    assert "--trusted-proxies" in cmd
    # the trust rests on the policy: port 8080 admits the router's pods alone
    rules = _one("NetworkPolicy")["spec"]["ingress"]
    to_8080 = [r for r in rules if any(p["port"] == 8080 for p in r["ports"])]
    assert [r["from"] for r in to_8080] == [[{"podSelector": {"matchLabels": {"app": "tandem-router"}}}]]


def test_the_router_upgrades_websockets_and_forwards_the_client():
    """The rendered Envoy config (the file kustomize's configMapGenerator ships), parsed by Envoy's
    v3 API: the HTTP listener upgrades WebSockets (WS /v1/audio/speech/stream-input) and puts the
    client's own address in X-Forwarded-For."""
    from envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3 import (
        HttpConnectionManager,
    )

    boot = _envoy_bootstrap(_envoy())
    http = next(lst for lst in boot.static_resources.listeners if lst.name == "http")
    hcm = HttpConnectionManager().parse(http.filter_chains[0].filters[0].typed_config.value)
    assert [u.upgrade_type for u in hcm.upgrade_configs] == ["websocket"]
    assert hcm.use_remote_address
    generated = _kustomization()["configMapGenerator"][0]["files"]
    assert generated == ["envoy.yaml=router/envoy.yaml"]


def test_keda_scales_on_one_query_that_counts_draining_units_as_full():
    spec = _one("ScaledObject")["spec"]
    triggers = spec["triggers"]
    assert len(triggers) == 1, "KEDA takes the maximum over triggers: draining must be in the one query"
    t = triggers[0]
    assert t["metricType"] == "AverageValue"
    query = t["metadata"]["query"]
    for name in re.findall(r"(tandem_\w+)", query):
        assert name in BY_NAME, name
    assert set(re.findall(r'namespace="([^"]+)"', query)) == {_kustomization()["namespace"]}
    # the capacity measured for the unit unit.yaml renders (Orpheus, P + D + SNAC on one H200), from
    # the bench JSON keda.yaml names
    measured = re.search(
        r"^# measured: (docs/benchmarks/\S+\.json)$", (DEPLOY / "keda.yaml").read_text(), re.M
    )
    assert measured, "keda.yaml names the bench JSON its target derives from"
    bench = json.loads((ROOT / measured.group(1)).read_text())
    capacity = bench["models"]["tts"]["capacity"]
    target = int(t["metadata"]["threshold"])
    assert 0.5 * capacity <= target <= 0.6 * capacity
    assert f"{target} * (count(tandem_draining" in query, "a draining unit counts one full target"
    assert "cooldownPeriod" not in spec or spec["minReplicaCount"] == 0, "cooldown acts only at zero"
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
        "stabilizationWindowSeconds"
    ]


def test_router_hashes_on_voice():
    envoy = _envoy()["static_resources"]
    for cluster in envoy["clusters"]:
        assert cluster["lb_policy"] == "RING_HASH"
        address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        assert address["socket_address"]["address"] == _one("Service", "tandem-unit")["metadata"]["name"]
    for listener in envoy["listeners"]:
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        hashes = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["hash_policy"]
        assert hashes[0]["header"]["header_name"] == "voice-id"


def test_the_image_context_leaves_out_local_builds() -> None:
    """`COPY . .` in deploy/Dockerfile must not carry a developer's .venv or compiled modules."""
    assert "COPY . ." in (DEPLOY / "Dockerfile").read_text()
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip()}
    assert {".venv", ".git", "csrc/*.so", "**/__pycache__"} <= ignored
