"""`tandem-unit`'s own decisions, without a server: the arguments it adds, its unit and its lock."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tandem.serving.repository import render, repository_unit
from tandem.serving.supervisor import (
    Supervisor,
    UnitTaken,
    parse,
    shm_prefix,
    with_exit_timeout,
    with_loopback,
)

REPO = Path(__file__).resolve().parents[2] / "model_repository"


def test_loopback_unless_told() -> None:
    assert with_loopback([]) == [
        "--grpc-address=127.0.0.1",
        "--http-address=127.0.0.1",
        "--metrics-address=127.0.0.1",
    ]
    told = with_loopback(["--grpc-address", "0.0.0.0", "--metrics-address=10.0.0.5"])
    assert told == ["--grpc-address", "0.0.0.0", "--metrics-address=10.0.0.5", "--http-address=127.0.0.1"]


def test_drain_bound_and_shm_prefix_unless_given() -> None:
    assert with_exit_timeout([], 8.0) == ["--exit-timeout-secs=8"]
    assert with_exit_timeout(["--exit-timeout-secs=3"], 8.0) == ["--exit-timeout-secs=3"]
    assert shm_prefix(["--backend-config=python,shm-region-prefix-name=mine_"]) == "mine_"
    assert shm_prefix(["--backend-config=python,shm-default-byte-size=1048576"]) is None


def test_the_default_unit_is_the_repositorys_and_two_repositories_are_two_units(
    run_dir: Path, tmp_path: Path
) -> None:
    one = render(REPO, tmp_path / "a" / "model_repository")
    two = render(REPO, tmp_path / "b" / "model_repository")
    a = Supervisor(*parse(["--", f"--model-repository={one}"]))
    b = Supervisor(*parse(["--", f"--model-repository={two}"]))
    assert a.unit == repository_unit(one) != b.unit == repository_unit(two)
    assert a.prefix is not None and b.prefix is not None and a.prefix != b.prefix
    assert a.prefix.startswith(f"tandem_{os.getuid()}_{a.unit}_")
    assert f"--backend-config=python,shm-region-prefix-name={a.prefix}" in a.args
    assert "--grpc-address=127.0.0.1" in a.args and "--exit-timeout-secs=8" in a.args


def test_a_second_supervisor_of_one_unit_fails_naming_the_setting(run_dir: Path, tmp_path: Path) -> None:
    repo = render(REPO, tmp_path / "model_repository")
    first = Supervisor(*parse(["--", f"--model-repository={repo}"]))
    with pytest.raises(UnitTaken) as taken:
        Supervisor(*parse(["--", f"--model-repository={repo}"]))
    msg = str(taken.value)
    assert f"another tandem-unit serves unit {first.unit!r}" in msg
    assert "tandem.transfer.unit" in msg and "XDG_RUNTIME_DIR" in msg
    del first
