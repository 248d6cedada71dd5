"""The unit's real CUDA MPS daemon (serving/mps.py) on a GPU machine: it starts with pipes of its
own, a CUDA client given its environment runs through it (an MPS server appears), and `stop`
leaves neither the daemon nor its directories. Skipped where there is no GPU or no
`nvidia-cuda-mps-control` (the CPU machine: tests/unit/test_mps.py covers the decisions there)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tandem.serving.mps import CONTROL, MpsDaemon

CLIENT = (
    "import torch; x = torch.ones(1 << 20, device='cuda'); torch.cuda.synchronize(); print(float(x.sum()))"
)


@pytest.mark.gpu
def test_the_units_daemon_serves_a_client_and_leaves_nothing(tmp_path: Path) -> None:
    if not torch.cuda.is_available() or shutil.which(CONTROL) is None:
        pytest.skip(f"needs a GPU and {CONTROL}")
    daemon = MpsDaemon(tmp_path / "unit" / "mps", shutil.which(CONTROL) or CONTROL)
    daemon.start()
    try:
        env = {**os.environ, **daemon.env()}
        out = subprocess.run(
            [sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True, timeout=120, check=True
        )
        assert out.stdout.strip() == str(float(1 << 20))
        # An MPS server was started for the client (it logs to the unit's log directory): the
        # client used the daemon, not a context of its own.
        server_log = daemon.log / "server.log"
        assert server_log.is_file() and server_log.stat().st_size > 0, list(daemon.log.iterdir())
    finally:
        daemon.stop()
    assert not (tmp_path / "unit" / "mps").exists()
    env = {**os.environ, **daemon.env()}
    again = subprocess.run(
        [CONTROL], input="get_server_list", env=env, capture_output=True, text=True, timeout=30, check=False
    )
    assert again.returncode != 0, "the daemon still answers after stop"
