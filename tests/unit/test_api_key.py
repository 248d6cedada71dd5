"""The unit's API key (serving/api_key.py), the launcher's lock flags and tandem-unit's use of the key,
without a server: where the key is made and refused, what each setting does, what is printed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tandem.serving import launcher as tritonserver
from tandem.serving.api_key import (
    FILE_ENV,
    GRPC_HEADER,
    HEADER,
    LOCK_ENV,
    LOCKED_APIS,
    ApiKeyError,
    resolve,
    unit_of,
)
from tandem.serving.launcher import CPU_FLAGS, LauncherError, build_command, cpu_machine, with_cpu_mode
from tandem.serving.repository import render, repository_unit
from tandem.serving.supervisor import Supervisor, parse
from tandem.transfer.control import control_dir

REPO = Path(__file__).resolve().parents[2] / "model_repository"
LOCK_FLAGS = ("--http-restricted-api=", "--grpc-restricted-protocol=")


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The process environment with a private XDG_RUNTIME_DIR and no lock settings."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    monkeypatch.delenv(FILE_ENV, raising=False)
    monkeypatch.delenv(LOCK_ENV, raising=False)
    return dict(os.environ)


def _repo(tmp_path: Path, unit: str) -> Path:
    return render(REPO, tmp_path / "repo", {m: {"tandem.transfer.unit": unit} for m in ("prefill", "decode")})


def test_first_start_makes_a_private_key_in_the_unit_directory(env: dict[str, str], tmp_path: Path) -> None:
    repo = _repo(tmp_path, "u7")
    args = [f"--model-repository={repo}"]
    assert unit_of(args) == "u7"
    # No model names one: the repository's own, the same for every path to it, other for another.
    own = unit_of(["--model-repository", str(REPO)])
    assert own == repository_unit(REPO) and len(own) == 8 and int(own, 16) >= 0
    assert unit_of([f"--model-repository={REPO}/../model_repository"]) == own
    assert repository_unit(tmp_path) != own
    assert unit_of(["--model-repository", "s3://bucket/repo"]) == "default"  # what the engines use then
    lock = resolve(args, env)
    assert lock.source == control_dir("u7") / "api.key"  # the transfer plane's 0700 directory
    assert stat.S_IMODE(lock.source.stat().st_mode) == 0o600
    assert stat.S_IMODE(lock.source.parent.stat().st_mode) == 0o700
    assert lock.key is not None and len(lock.key) == 64 and int(lock.key, 16) >= 0
    assert resolve(args, env).key == lock.key  # every later start (and tandem-unit) reads the same key
    assert lock.key not in repr(lock)


def test_the_lock_flags_name_every_locked_api_with_the_key(env: dict[str, str]) -> None:
    lock = resolve([], env)
    rule = f"model-repository,shared-memory,logging,trace,statistics:tandem-api-key={lock.key}"
    assert LOCKED_APIS == ("model-repository", "shared-memory", "logging", "trace", "statistics")
    assert lock.server_args() == [f"--http-restricted-api={rule}", f"--grpc-restricted-protocol={rule}"]
    assert lock.http_headers() == {HEADER: lock.key} and HEADER == "tandem-api-key"
    assert lock.grpc_headers() == {GRPC_HEADER: lock.key}
    assert GRPC_HEADER == "triton-grpc-protocol-tandem-api-key"  # Triton prefixes gRPC headers
    assert lock.redact(f"x {rule} y") == "x model-repository,shared-memory,logging,trace,statistics:" + (
        "tandem-api-key=<api-key> y"
    )


def test_a_mounted_key_file_is_used_as_it_is(env: dict[str, str], tmp_path: Path) -> None:
    secret = tmp_path / "secret" / "key"
    secret.parent.mkdir()
    secret.write_text("  " + "a1B2_c3-" * 5 + "\n")  # a Secret made with a trailing newline
    lock = resolve([], {**env, FILE_ENV: str(secret)})
    assert lock.key == "a1B2_c3-" * 5 and lock.source == secret
    assert not (control_dir("default") / "api.key").exists()  # nothing is generated beside it


@pytest.mark.parametrize(
    ("content", "says"),
    [("short", "found 5 characters"), ("k" * 40 + ":x=y", "found 44 characters"), ("", "found 0")],
)
def test_a_malformed_mounted_key_is_refused_without_echoing_it(
    env: dict[str, str], tmp_path: Path, content: str, says: str
) -> None:
    secret = tmp_path / "key"
    secret.write_text(content)
    with pytest.raises(ApiKeyError) as err:
        resolve([], {**env, FILE_ENV: str(secret)})
    assert str(secret) in str(err.value) and says in str(err.value)
    assert not content or content not in str(err.value)


def test_a_missing_mounted_key_is_refused(env: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(ApiKeyError, match=rf"{FILE_ENV}=.*missing.*No such file"):
        resolve([], {**env, FILE_ENV: str(tmp_path / "missing")})


def test_an_unsafe_unit_directory_or_key_file_is_refused(env: dict[str, str]) -> None:
    lock = resolve([], env)
    assert lock.source is not None
    os.chmod(lock.source, 0o644)
    with pytest.raises(ApiKeyError, match="mode 600"):
        resolve([], env)
    os.unlink(lock.source)
    os.symlink("/etc/hostname", lock.source)
    with pytest.raises(ApiKeyError, match="symlink"):
        resolve([], env)
    os.unlink(lock.source)
    os.chmod(lock.source.parent, 0o755)
    with pytest.raises(ApiKeyError, match="expected 700"):
        resolve([], env)


def test_the_opt_out_is_explicit_and_warns_at_every_start(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TANDEM_TRITONSERVER_BINARY", "/bin/true")
    monkeypatch.setenv(LOCK_ENV, "off")
    _, argv, _ = build_command(["--model-repository", str(REPO)])
    cpu = CPU_FLAGS if cpu_machine() else ()  # CPU mode's own flags (launcher.with_cpu_mode)
    assert argv == ["/bin/true", "--model-repository", str(REPO), *cpu]
    err = capsys.readouterr().err
    assert "WARNING: TANDEM_API_LOCK=off" in err and "answer anyone" in err
    monkeypatch.setenv(LOCK_ENV, "no")
    with pytest.raises(LauncherError, match="TANDEM_API_LOCK='no': want `on`"):
        build_command([])


def test_every_binary_gets_the_lock(
    env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`TANDEM_TRITONSERVER_BINARY`, the NGC image's binary and the pytriton wheel's binary all start
    with both lock flags, keyed on the unit's key."""
    key = resolve(["--model-repository", str(REPO)], env).key
    monkeypatch.setenv("TANDEM_TRITONSERVER_BINARY", "/elsewhere/tritonserver")
    _, explicit, _ = build_command(["--model-repository", str(REPO)])
    monkeypatch.delenv("TANDEM_TRITONSERVER_BINARY")
    ngc = tmp_path / "opt" / "tritonserver"
    ngc.parent.mkdir()
    ngc.write_text("")
    monkeypatch.setattr(tritonserver, "NGC_BINARY", ngc)
    ngc_binary, image, _ = build_command(["--model-repository", str(REPO)])
    assert ngc_binary == str(ngc)
    monkeypatch.setattr(tritonserver, "NGC_BINARY", tmp_path / "absent")
    _, wheel, _ = build_command(["--model-repository", str(REPO)])
    assert wheel[0].endswith("pytriton/tritonserver/bin/tritonserver")
    for argv in (explicit, image, wheel):
        flags = [a for a in argv if a.startswith(LOCK_FLAGS)]
        assert len(flags) == 2 and all(f.endswith(f":tandem-api-key={key}") for f in flags), argv


def test_an_unsafe_key_stops_the_launcher(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_TRITONSERVER_BINARY", "/bin/true")
    os.chmod(control_dir("default"), 0o750)
    with pytest.raises(LauncherError, match=r"cannot lock the control APIs: .* expected 700"):
        build_command([])


def test_tandem_unit_logs_the_command_line_without_the_key(env: dict[str, str]) -> None:
    opts, server = parse(["--", "--model-repository", str(REPO)])
    sup = Supervisor(opts, server)
    _, argv, _ = build_command(sup.args)
    key = resolve(["--model-repository", str(REPO)], env).key
    line = sup.api.redact(" ".join(argv))
    assert key is not None and key in " ".join(argv) and key not in line
    assert "tandem-api-key=<api-key>" in line


def test_the_default_unit_is_the_engines_default(tmp_path: Path) -> None:
    """The launcher and the supervisor (which must not import torch) name the unit the engines
    derive for a repository without `tandem.transfer.unit` (the stub adds it to the worker's
    config), so such a repository is one unit everywhere; a named unit is left as it is."""
    import json

    from tandem.backend.settings import TransferSettings, parse_settings, triton_parameters
    from tandem.serving import api_key
    from tandem.serving.engine_worker import with_unit

    assert TransferSettings().unit == api_key.DEFAULT_UNIT  # non-local repositories (s3://)
    repo = render(REPO, tmp_path / "repo")
    config = json.dumps({"name": "decode", "parameters": {}})
    derived = json.loads(with_unit(config, str(repo / "decode")))
    assert parse_settings(triton_parameters(derived)).transfer.unit == unit_of([f"--model-repository={repo}"])
    named = json.dumps({"parameters": {"tandem.transfer.unit": {"string_value": "u7"}}})
    assert with_unit(named, str(repo / "decode")) == named


def test_cpu_mode_adds_the_flags_that_skip_cuda_probing_unless_given(tmp_path):
    """On a machine without /dev/nvidiactl the launcher turns off what makes Triton probe CUDA and
    NVML (each option only where the caller did not set it)."""
    assert cpu_machine(tmp_path) and not cpu_machine(_with_nvidiactl(tmp_path / "gpu"))
    assert with_cpu_mode(["--model-repository=r"]) == ["--model-repository=r", *CPU_FLAGS]
    mine = with_cpu_mode(["--pinned-memory-pool-byte-size=1024"])
    assert mine[0] == "--pinned-memory-pool-byte-size=1024" and len(mine) == len(CPU_FLAGS)


def _with_nvidiactl(dev):
    dev.mkdir()
    (dev / "nvidiactl").touch()
    return dev
