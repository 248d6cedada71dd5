"""Each GPU kernel's first call, made before an engine serves: a Triton kernel's first call with a new
specialisation compiles (seconds), which inside the loop would stall its streams. The engines'
`start()` call `warm_up`; D's graphs are captured by `cuda_graphs.GraphedDecode.warm_up` instead.
"""

from __future__ import annotations

import logging
import time

import torch

from tandem.backend.kv.pool import KVPool
from tandem.backend.model.decoder import Decoder

log = logging.getLogger("tandem")

# Prompt shapes `warm_up` runs: (rows, start). Triton specialises a kernel on an integer argument
# being 1 or a multiple of 16 and on a pointer being 16-byte aligned (a prompt after an odd-length
# cached prefix passes an unaligned slice of its slots), so these cover every variant a prefill meets.
# (rope_kv_write's row count is no longer specialised; the 1/16/17-row shapes stay until a GPU run
# shows which the other kernels and pointers still need.)
WARM_PREFILLS = ((1, 0), (16, 0), (17, 0), (1, 1), (16, 1), (17, 1))


@torch.inference_mode()
def warm_up(decoder: Decoder, pool: KVPool) -> float:
    """One prefill per `WARM_PREFILLS` shape and an eager decode step at batch 1 and 2, on pages taken
    from `pool` and given back (the KV written is garbage in free pages). A no-op on a CPU (nothing
    compiles there); logs and returns the seconds it took."""
    if decoder.device.type != "cuda":
        return 0.0
    t0 = time.perf_counter()
    cfg = decoder.cfg
    longest = max(r + s for r, s in WARM_PREFILLS) + 1
    if pool.num_free_pages < 2 * pool.pages_for(longest):
        log.warning(
            "kernel warm-up skipped: it needs %d free KV pages, the pool has %d; the first prompts "
            "will compile the kernels inside the engine loop",
            2 * pool.pages_for(longest),
            pool.num_free_pages,
        )
        return 0.0
    pages = [pool.allocate(pool.pages_for(longest)) for _ in range(2)]
    try:
        tables = [pool.slots(p, longest) for p in pages]
        for rows, start in WARM_PREFILLS:
            prompt = torch.zeros((rows, cfg.row_width), dtype=torch.long, device=decoder.device)
            decoder.prefill(prompt, pool, tables[0][: start + rows], start)
        for b in (1, 2):
            step = torch.zeros((b, cfg.row_width), dtype=torch.long, device=decoder.device)
            decoder.decode(step, pool, [t[:longest] for t in tables[:b]], torch.full((b,), longest - 1))
        torch.cuda.synchronize(decoder.device)
    finally:
        for p in pages:
            pool.free(p)
    took = time.perf_counter() - t0
    log.info("kernels warmed up in %.1f s (first calls compile them)", took)
    return took
