"""Where an engine's tensors live: its device (from Triton's placement), and host -> device copies
that never make the host wait for the device.

Why the copies go through pinned memory: D queues decode step n+1 while step n still runs
(`backend/engines/batch.py`). A copy from pageable host memory may be staged by the driver only once
the stream reaches it, so the host would wait for the running step — and `Tensor.to(device)` without
`non_blocking` always does. From pinned memory the copy is queued like a kernel and the host goes on.
torch's pinned-memory allocator keeps the block until the copy queued from it has run, so the host
tensor may be dropped at once.
"""

from __future__ import annotations

import numpy as np
import torch


def upload(
    data: torch.Tensor | np.ndarray, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`data` (host) as a tensor on `device`, ordered on the current stream after what is queued there.

    On a CUDA device the host side goes through pinned memory and the call returns before the copy
    ran; elsewhere it is a plain conversion. The caller owns the result."""
    t = torch.from_numpy(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else data
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def resolve_device(setting: str, instance_kind: str = "CPU", instance_device_id: int = 0) -> torch.device:
    """`auto` follows Triton's placement: a KIND_GPU instance runs on its own GPU, others on the CPU."""
    if setting == "auto":
        device = (
            torch.device(f"cuda:{instance_device_id}")
            if instance_kind.upper() == "GPU"
            else torch.device("cpu")
        )
    else:
        device = torch.device(setting)
    if device.type == "cuda":
        # Every GPU is visible to a Triton stub; make ours current for this (the initialising) thread so
        # transfer paths probing "the current device" pick the instance's GPU, not GPU 0.
        torch.cuda.set_device(device)
    return device
