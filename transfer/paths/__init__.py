"""Data paths: how the bytes of one transfer get from P's KV into D's.

`base` is the contract every path keeps (`TransferPath`, D's `LocalArena`, P's `PeerArena`); one
module per path: `host_shm` (a sealed memfd), `cuda` (`cuda_ipc`, `cuda_vmm`: P writes D's GPU memory),
`proxy` (a sidecar that holds the IPC handles copies for P; the sidecar's process is
`proxy_sidecar`, `tandem-proxy`), `tcp` (chunks over a socket, the degraded path); `registry` builds
one by name from `PathOptions` and probes it (`select_path`). docs/transfer.md says what each costs.

Imports nothing: `tandem-proxy` (`python -m tandem.transfer.paths.proxy_sidecar`) needs no torch.
"""
