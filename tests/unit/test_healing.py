"""tandem-unit's healing decisions without a server: which process is a stub of which model, the
arguments it adds, the readiness mark's calls, a reload's load request and when it counts, the
stub's own health sink, and the two failure domains of the unit's health."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from tandem.serving import process_tree, stub_healing
from tandem.serving.control_api import ControlError
from tandem.serving.health import parse_health
from tandem.serving.readiness import CLEAR_AFTER_S, MARK_MODEL, ReadinessMark
from tandem.serving.server_args import strict_readiness, with_auto_complete_off
from tandem.serving.stub_guard import StubHealth, own_region
from tandem.serving.stub_healing import RELOAD_PARAMETER, StubHealer, UnitState

STUB = "/venv/var/tandem/backends/python/triton_python_backend_stub"


def _repo(tmp_path: Path, *models: str) -> Path:
    repo = tmp_path / "model_repository"
    for m in models:
        (repo / m / "1").mkdir(parents=True)
        (repo / m / "config.pbtxt").write_text(f'name: "{m}"\n')
    return repo


def test_a_stub_is_known_by_its_model_file_under_a_repository(tmp_path: Path) -> None:
    repo = _repo(tmp_path, "decode", "voices")
    region = "tandem_0_u_1234_9a23d03f"
    assert process_tree.model_of([STUB, f"{repo}/decode/1/model.py", region], [str(repo)]) == "decode"
    # a relative repository (make serve's `--model-repository model_repository`), through a link
    link = tmp_path / "link"
    link.symlink_to(repo)
    assert process_tree.model_of([STUB, f"{link}/voices/1/model.py", region], [str(repo)]) == "voices"
    # the readiness mark's stub runs from files its load carried: no model of the repository
    marker = [STUB, "/tmp/folderAbC123/1/model.py", region]
    assert process_tree.model_of(marker, [str(repo)]) is None
    assert process_tree.model_of(["/usr/bin/python3", f"{repo}/decode/1/model.py"], [str(repo)]) is None


def test_config_completion_is_off_unless_the_caller_chose() -> None:
    assert with_auto_complete_off([]) == ["--disable-auto-complete-config"]
    assert with_auto_complete_off(["--strict-model-config=false"]) == ["--strict-model-config=false"]
    assert with_auto_complete_off(["--disable-auto-complete-config"]) == ["--disable-auto-complete-config"]
    assert strict_readiness([]) and strict_readiness(["--strict-readiness=true"])
    assert not strict_readiness(["--strict-readiness", "false"])


def test_the_stubs_region_is_its_third_argument() -> None:
    assert own_region([STUB, "/r/decode/1/model.py", "tandem_0_u_h_uuid", "1048576"]) == "tandem_0_u_h_uuid"
    assert own_region(["/usr/bin/python3", "x", "y"]) == ""
    assert own_region([STUB, "/r/decode/1/model.py", "../etc/passwd"]) == ""


class FakeApi:
    """The control API as the readiness mark and the healer use it; records every call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict[str, Any] | None]] = []
        self.loadable = {MARK_MODEL: False}
        self.states: dict[str, tuple[str, str]] = {}
        self.on_load: Any = None

    def load(self, model: str, parameters: dict[str, Any] | None = None, timeout_s: float = 0) -> None:
        self.calls.append(("load", model, dict(parameters or {})))
        config = json.loads((parameters or {}).get("config", "{}"))
        if model == MARK_MODEL and config.get("platform") != "ensemble":
            raise ControlError(f"POST load: 400 load failed for model '{model}': no backend", 400)
        if self.on_load is not None:
            self.on_load(model, config)

    def unload(self, model: str, timeout_s: float = 0) -> None:
        self.calls.append(("unload", model, None))

    def index(self, timeout_s: float = 0) -> dict[str, tuple[str, str]]:
        return dict(self.states)

    def config(self, model: str, timeout_s: float = 0) -> dict[str, Any]:
        io = {
            "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}],
            "output": [{"name": "ROWS"}],
        }
        params = {"parameters": {"tandem.device": {"string_value": "cpu"}}}
        return {"name": model, "backend": "python", "max_batch_size": 0, **io, **params}


def test_the_mark_fails_a_load_and_clearing_loads_it_then_the_next_mark_unloads_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api, said = FakeApi(), []
    api.states = {"frontend": ("READY", ""), "decode": ("READY", ""), "tts": ("READY", "")}
    mark = ReadinessMark(api, said.append)  # type: ignore[arg-type]
    clock = [100.0]
    monkeypatch.setattr("tandem.serving.readiness.time.monotonic", lambda: clock[0])
    mark.update(["decode: its stub died (reloading)"])
    assert mark.marked and [c[:2] for c in api.calls] == [("load", MARK_MODEL)]
    config = json.loads(api.calls[0][2]["config"])  # type: ignore[index]
    assert "platform" not in config and any(k.startswith("file:") for k in api.calls[0][2])  # type: ignore[union-attr]
    mark.update(["decode decode_0_0: engine down"])  # still down: no second load
    assert len(api.calls) == 1
    mark.update([])  # well, but not for CLEAR_AFTER_S yet
    assert mark.marked and len(api.calls) == 1
    clock[0] += CLEAR_AFTER_S
    mark.update([])
    assert not mark.marked and mark.loaded
    clear = json.loads(api.calls[1][2]["config"])  # type: ignore[index]
    assert api.calls[1][0] == "load" and clear["platform"] == "ensemble"  # no process of its own
    step = clear["ensemble_scheduling"]["step"][0]
    assert step["model_name"] == "frontend" and step["input_map"] == {"TEXT": "TEXT"}
    assert step["output_map"] == {"ROWS": "ROWS"} and clear["input"][0]["name"] == "TEXT"
    mark.update(["prefill: its stub died (reloading)"])
    assert [c[:2] for c in api.calls[2:]] == [("unload", MARK_MODEL), ("load", MARK_MODEL)]
    assert mark.marked and any("server marked not ready" in s for s in said)


def test_a_server_that_cannot_be_marked_is_said_once_and_left_alone() -> None:
    api, said = FakeApi(), []

    def refuse(model: str, parameters: Any = None, timeout_s: float = 0) -> None:
        api.calls.append(("load", model, None))
        raise ControlError("POST load: 503 explicit model load / unload is not allowed", 503)

    api.load = refuse  # type: ignore[method-assign]
    api.states = {"frontend": ("READY", "")}
    mark = ReadinessMark(api, said.append)  # type: ignore[arg-type]
    mark.update(["decode down"])
    mark.update(["decode down"])
    assert not mark.marked and mark.broken and len(api.calls) == 1
    assert len([s for s in said if "cannot mark" in s]) == 1


def test_a_reload_carries_the_running_config_with_a_new_value_and_counts_once_a_new_stub_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stubs = {11: process_tree.Stub("decode", "r_old"), 12: process_tree.Stub("prefill", "r_p")}
    monkeypatch.setattr(stub_healing.process_tree, "stub_details", lambda pid, repos: dict(stubs))
    api, said = FakeApi(), []
    api.states = {"decode": ("READY", "")}
    state = UnitState(tmp_path / "unit-state.json")
    healer = StubHealer(api, ["/r"], "tandem_0_u_", state, said.append, 60.0)  # type: ignore[arg-type]

    class Server:
        pid = 1

        def poll(self) -> None:
            return None

    healer.reset(Server())  # type: ignore[arg-type]
    assert healer.scan(answered=True) == []  # first sight of the stubs
    loads: list[dict[str, Any]] = []

    def new_stub(model: str, config: dict[str, Any]) -> None:
        loads.append(config)
        stubs[21] = process_tree.Stub("decode", "r_new")

    api.on_load = new_stub
    del stubs[11]  # decode's stub died
    assert healer.scan(answered=True) == ["decode"]
    assert "decode" in healer.down  # down (the supervisor marks the server) before the reload starts
    healing = healer.healing["decode"]
    assert not healing.started
    healer.start_pending()
    assert healing.thread is not None
    healing.thread.join(5)
    assert healing.ok and healing.new_pids == [21]
    assert len(loads) == 1 and loads[0]["parameters"]["tandem.device"] == {"string_value": "cpu"}
    assert RELOAD_PARAMETER in loads[0]["parameters"] and not RELOAD_PARAMETER.startswith("tandem.")
    assert json.loads(state.path.read_text()) == {"reloads": {"decode": 1}}
    assert "decode" not in healer.down
    assert any("decode: reloaded in" in s and "new stub pid 21 serves" in s for s in said)


def test_a_load_that_starts_no_new_stub_is_not_counted_and_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stubs = {11: process_tree.Stub("vocoder", "r_v")}
    monkeypatch.setattr(stub_healing.process_tree, "stub_details", lambda pid, repos: dict(stubs))
    monkeypatch.setattr(stub_healing, "RELOAD_BACKOFF_S", 0.01)
    api, said = FakeApi(), []
    api.states = {"vocoder": ("READY", "")}
    state = UnitState(tmp_path / "unit-state.json")
    healer = StubHealer(api, ["/r"], "p_", state, said.append, 60.0)  # type: ignore[arg-type]
    tries = threading.Event()
    count = [0]

    def second_time_lucky(model: str, config: dict[str, Any]) -> None:
        count[0] += 1
        if count[0] == 2:
            stubs[31] = process_tree.Stub("vocoder", "r_v2")
            tries.set()

    api.on_load = second_time_lucky

    class Server:
        pid = 1

        def poll(self) -> None:
            return None

    healer.reset(Server())  # type: ignore[arg-type]
    healer.scan(answered=True)
    del stubs[11]
    healer.scan(answered=True)
    healer.start_pending()
    assert "vocoder" in healer.down
    h = healer.healing["vocoder"]
    assert h.thread is not None
    h.thread.join(10)
    assert h.ok and count[0] == 2
    assert any("reload 1 failed" in s and "no new stub of vocoder serves" in s for s in said)
    assert json.loads(state.path.read_text()) == {"reloads": {"vocoder": 1}}


class FakePb:
    class MetricFamily:
        GAUGE, COUNTER = "gauge", "counter"

        def __init__(self, name: str, description: str, kind: str) -> None:
            self.name = name

        def Metric(self, labels: dict[str, str]) -> Any:
            values: dict[str, float] = {}

            class M:
                def set(self, v: float) -> None:
                    values["v"] = v

                def increment(self, v: float) -> None:
                    values["v"] = values.get("v", 0.0) + v

            m = M()
            m.values = values  # type: ignore[attr-defined]
            return m


def test_the_stubs_health_sink_holds_one_metric_per_series() -> None:
    health = StubHealth(FakePb, {"model": "decode", "model_instance": "decode_0_0"})
    health.set("tandem_engine_up", 0.0)
    health.set("tandem_engine_up", 1.0)
    health.inc("tandem_engine_restarts_total", 0.0)
    health.inc("tandem_engine_restarts_total", 1.0)
    assert len(health._metrics) == 2
    up = health._metrics[("tandem_engine_up", (("model", "decode"), ("model_instance", "decode_0_0")))]
    assert up.values == {"v": 1.0}
    with pytest.raises(KeyError):
        health.observe("tandem_engine_up", 1.0)


VOICES_DOWN = """\
tandem_engine_up{model="prefill",model_instance="prefill_0_0"} 1
tandem_engine_up{model="decode",model_instance="decode_0_0"} 1
tandem_engine_up{model="frontend",model_instance="frontend_0_0"} 1
tandem_engine_up{model="voices",model_instance="voices_0_0"} 0
tandem_stub_heartbeat_timestamp_seconds{model="decode",model_instance="decode_0_0"} 1000
tandem_stub_heartbeat_timestamp_seconds{model="voices",model_instance="voices_0_0"} 990
"""


def test_voices_is_its_own_failure_domain() -> None:
    h = parse_health(VOICES_DOWN, now=1001.0)
    assert h.ready and h.engines_up and h.reasons == ()
    assert not h.voices_ready
    assert h.voices_reasons == (
        "voices voices_0_0: stub silent for 11.0 s (dead or stopped)",
        "voices voices_0_0: engine down",
    )
    speech_down = parse_health(VOICES_DOWN.replace('"frontend_0_0"} 1', '"frontend_0_0"} 0'), now=1001.0)
    assert not speech_down.ready and speech_down.reasons == ("frontend frontend_0_0: engine down",)
    none = parse_health('tandem_engine_up{model="decode",model_instance="decode_0_0"} 1\n')
    assert none.ready and not none.voices_ready and "registration is not served" in none.voices_reasons[0]
