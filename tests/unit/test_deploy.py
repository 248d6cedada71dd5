"""deploy/ against the code: the unit pod's commands parse and render, ports and metric names exist,
and the KEDA target derives from the measured capacity."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

from tandem.backend.checkpoint import save_checkpoint
from tandem.backend.config import preset
from tandem.backend.decoder import Decoder
from tandem.backend.metrics import BY_NAME
from tandem.cli.make_repository import main as tandem_repo
from tandem.transfer.control import control_dir

ROOT = Path(__file__).resolve().parents[2]


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "deploy" / name).read_text()) if d]


def _server_container() -> dict:
    sts = next(d for d in _docs("unit.yaml") if d["kind"] == "StatefulSet")
    return next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "server")


def test_unit_pod_command_renders_a_repository(tmp_path, monkeypatch):
    script = _server_container()["args"][0]
    repo_cmd = shlex.split(script.split("&&")[0].replace('"$(POD_NAME)"', "tandem-unit-0"))
    assert repo_cmd[0] == "tandem-repo"
    ckpt = tmp_path / "ckpt"
    save_checkpoint(Decoder.random(preset("tiny"), "cpu", seed=0), ckpt)
    args = [str(ckpt) if a == "/models/tts" else a for a in repo_cmd[1:]]
    args[args.index("--out") + 1] = str(tmp_path / "repo")
    assert tandem_repo(args) == 0
    decode = (tmp_path / "repo" / "decode" / "config.pbtxt").read_text()
    assert "gpus: [ 1 ]" in decode and 'string_value: "cuda_ipc"' in decode
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert control_dir("tandem-unit-0").name.endswith("tandem-unit-0")  # pod names are valid unit names


def test_ports_match_the_server_command():
    c = _server_container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    script = c["args"][0]
    for name, flag in (("grpc", "--grpc-port"), ("http", "--http-port"), ("metrics", "--metrics-port")):
        assert f"{flag} {ports[name]}" in script
    makefile = (ROOT / "Makefile").read_text()
    assert f"GRPC_PORT ?= {ports['grpc']}" in makefile and f"METRICS_PORT ?= {ports['metrics']}" in makefile


def test_keda_queries_use_published_metrics_and_the_measured_capacity():
    triggers = _docs("keda.yaml")[0]["spec"]["triggers"]
    for t in triggers:
        for name in re.findall(r"(tandem_\w+)", t["metadata"]["query"]):
            assert name in BY_NAME, name
    bench = json.loads((ROOT / "docs" / "benchmarks" / "capacity-h200x2.json").read_text())
    capacity = bench["models"]["tts"]["capacity"]
    target = int(triggers[0]["metadata"]["threshold"])
    assert 0.5 * capacity <= target <= 0.6 * capacity


def test_router_hashes_on_voice():
    text = (ROOT / "deploy" / "router" / "envoy.yaml").read_text()
    cfg = yaml.safe_load(text)
    cluster = cfg["static_resources"]["clusters"][0]
    assert cluster["lb_policy"] == "RING_HASH"
    route = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hashes = route["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["hash_policy"]
    assert hashes[0]["header"]["header_name"] == "voice-id"
