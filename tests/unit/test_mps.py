"""`tandem-unit --mps`: when the unit runs a CUDA MPS daemon of its own (serving/mps.py), and its
refusal where MPS was asked for and cannot run. The daemon itself runs on a GPU machine only
(bench/device/run_orpheus_unit.sh serves through tandem-unit with `--mps on`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tandem.cli.make_repository import main as make_repository
from tandem.serving.mps import CONTROL, LOG_ENV, PIPE_ENV, MpsDaemon, MpsError, MpsMode, plan, server_env
from tandem.serving.supervisor import main as tandem_unit

REPO = Path(__file__).resolve().parents[2] / "model_repository"


def _which(present: bool):  # type: ignore[no-untyped-def]
    return lambda name: f"/usr/bin/{name}" if present and name == CONTROL else None


def _placed(tmp_path: Path, name: str, *placement: str) -> Path:
    out = tmp_path / name
    assert make_repository(["--out", str(out), "--preset", "tiny", "--path", "host_shm", *placement]) == 0
    return out


def test_auto_runs_mps_only_where_engines_share_a_gpu_and_the_binary_exists(tmp_path: Path) -> None:
    one_gpu = _placed(tmp_path, "one", "--prefill-gpus", "0", "--decode-gpus", "0", "--vocoder-gpus", "0")
    split = _placed(tmp_path, "split", "--prefill-gpus", "0", "--decode-gpus", "1")
    mono_beside_p = _placed(
        tmp_path, "mono", "--prefill-gpus", "0", "--decode-gpus", "1", "--mono-gpus", "0,1"
    )
    decision = plan(MpsMode.AUTO, [one_gpu], _which(True))
    assert decision.run and "GPU 0: decode, prefill, vocoder, voices" in decision.reason
    assert plan(MpsMode.AUTO, [mono_beside_p], _which(True)).run  # tts_mono beside P on 0, beside D on 1
    for repo, why in ((REPO, "no GPU holds two"), (split, "no GPU holds two")):
        decision = plan(MpsMode.AUTO, [repo], _which(True))
        assert not decision.run and why in decision.reason
    missing = plan(MpsMode.AUTO, [one_gpu], _which(False))
    assert not missing.run and f"{CONTROL} not on PATH" in missing.reason and "time-slice" in missing.reason
    assert not plan(MpsMode.OFF, [one_gpu], _which(True)).run
    assert not plan(MpsMode.ON, [REPO], _which(True)).run  # a CPU repository: nothing to share


def test_on_refuses_without_the_control_binary(tmp_path: Path) -> None:
    one_gpu = _placed(tmp_path, "one", "--prefill-gpus", "0", "--decode-gpus", "0")
    with pytest.raises(MpsError, match=f"--mps on, but {CONTROL} is not on PATH"):
        plan(MpsMode.ON, [one_gpu], _which(False))
    with pytest.raises(MpsError, match="not on PATH"):
        plan(MpsMode.ON, [REPO], _which(False))  # asked for: refused even where nothing is shared


@pytest.mark.skipif(shutil.which(CONTROL) is not None, reason="this machine has the MPS control daemon")
def test_tandem_unit_with_mps_on_refuses_to_start_and_leaves_nothing(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No server is started, the unit's directory holds no MPS directory, the status says why."""
    one_gpu = _placed(tmp_path, "one", "--prefill-gpus", "0", "--decode-gpus", "0")
    with pytest.raises(SystemExit) as exited:
        tandem_unit(["--mps", "on", "--", f"--model-repository={one_gpu}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"cannot share the GPU without time-slicing: --mps on, but {CONTROL} is not on PATH" in err
    assert "started tritonserver" not in err
    assert not list(run_dir.rglob("mps"))


def test_a_daemon_binary_that_cannot_run_is_refused_and_cleaned_up(tmp_path: Path) -> None:
    """`start` with a control binary that cannot be executed (here: a directory) names the cause and
    removes the pipe and log directories it made."""
    not_a_program = tmp_path / "bin"
    not_a_program.mkdir()
    daemon = MpsDaemon(tmp_path / "unit" / "mps", str(not_a_program))
    with pytest.raises(MpsError, match="could not run"):
        daemon.start()
    assert not (tmp_path / "unit" / "mps").exists() and not daemon.running
    assert server_env({"A": "1"}, daemon) == {"A": "1"}  # a daemon that is not running adds nothing


def test_the_servers_environment_names_the_units_own_pipe_and_log_directories(tmp_path: Path) -> None:
    daemon = MpsDaemon(tmp_path / "unit" / "mps")
    unit = tmp_path / "unit"
    assert daemon.env() == {PIPE_ENV: str(unit / "mps/pipe"), LOG_ENV: str(unit / "mps/log")}
    assert server_env({"A": "1"}, None) == {"A": "1"}


def test_mps_mode_words() -> None:
    from tandem.serving.mps import parse_mode

    assert [parse_mode(w) for w in ("off", "auto", "ON")] == [MpsMode.OFF, MpsMode.AUTO, MpsMode.ON]
    with pytest.raises(ValueError, match="off, auto or on"):
        parse_mode("yes")
