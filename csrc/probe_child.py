"""The D half of a GPU path's probe, run as a child process (imports no torch, so it starts fast).

    python -m tandem.csrc.probe_child KIND DEVICE NBYTES [FD_SOCKET]

KIND is `cuda_ipc`, `vmm_posix_fd` or `vmm_fabric`. The child allocates NBYTES on DEVICE the way D's
receive arena does, poisons it, and prints one JSON line: the arena export's `meta` (for
`vmm_posix_fd` the fd goes over the inherited unix socket FD_SOCKET with SCM_RIGHTS). It then reads
one JSON line `{"sha256": hex, "nbytes": n}` from stdin — sent after the parent copied its bytes in —
hashes its first `n` bytes on the host and prints `{"ok": bool, "sha256": ...}`. Any failure prints
`{"error": "..."}` and exits 1. Used by `tandem.transfer.paths.cuda` only: a legacy IPC handle cannot be
opened by the process that made it, so a real probe needs a second process.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys


def _say(obj: dict[str, object]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    kind, device, nbytes = argv[0], int(argv[1]), int(argv[2])
    try:
        from tandem.csrc import _cuda_kernels as k

        cleanup: list[tuple[str, int, int]] = []
        if kind == "cuda_ipc":
            ptr = k.malloc(device, nbytes)
            cleanup.append(("free", ptr, 0))
            handle = k.ipc_get_handle(device, ptr)
            meta: dict[str, object] = {
                "kind": "cuda_ipc",
                "nbytes": nbytes,
                "handle": handle.hex(),
                "pid": os.getpid(),
            }
        elif kind in ("vmm_posix_fd", "vmm_fabric"):
            fabric = kind == "vmm_fabric"
            gran = k.vmm_granularity(device, fabric)
            size = -(-nbytes // gran) * gran
            h = k.vmm_create(device, size, fabric)
            cleanup.append(("release", h, 0))
            ptr = k.vmm_map(h, size, [device])
            cleanup.append(("unmap", ptr, size))
            meta = {"kind": "cuda_vmm", "nbytes": nbytes, "size": size, "pid": os.getpid()}
            if fabric:
                meta.update(handle_type="fabric", handle=k.vmm_export_fabric(h).hex())
            else:
                meta["handle_type"] = "posix_fd"
                fd = k.vmm_export_fd(h)
                sock = socket.socket(fileno=int(argv[3]))
                socket.send_fds(sock, [b"f"], [fd])
                os.close(fd)
        else:
            raise ValueError(f"unknown probe kind {kind!r}")
        k.memset(device, ptr, 0xA5, nbytes)
        _say({"meta": meta})
        line = sys.stdin.readline()
        if not line:
            raise RuntimeError("parent closed stdin before the check")
        req = json.loads(line)
        got = hashlib.sha256(k.copy_to_host(device, ptr, int(req["nbytes"]))).hexdigest()
        _say({"ok": got == req["sha256"], "sha256": got})
        for what, a, b in reversed(cleanup):
            if what == "free":
                k.free(device, a)
            elif what == "unmap":
                k.vmm_unmap(a, b)
            else:
                k.vmm_release(a)
        return 0
    except Exception as exc:
        _say({"error": f"{type(exc).__name__}: {exc}"})
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
