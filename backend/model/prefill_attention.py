"""Prefill's causal attention of one prompt on a GPU: which fused kernel runs, and the plans it needs.

`attend_gpu(q, k, v, start)` is what `Decoder.prefill_many` calls per prompt on a GPU. By default it
is torch's flash attention (grouped K/V natively where this torch supports it), or, after a cached
prefix, memory-efficient attention with a lower-right causal bias.

Opt-in (`TANDEM_PREFILL_ATTENTION=cudnn`): long prompts from position 0 go through torch's cuDNN
backend instead, padded to a length bucket.
- Why: measured on an H200 at 2,048 rows of the 4B shape, cuDNN took 85 us a layer against flash's
  166 (405 against 207 TFLOP/s).
- The catch: cuDNN builds an execution plan for every new sequence length (79 ms each). In the engine
  loop that would be a stall.
- So prompts of at least `CUDNN_MIN_ROWS` rows are padded with zero rows up to a multiple of
  `CUDNN_BUCKET`. Causal attention never lets a real row see a later one, so the padding changes no
  real row's output.
- `plan_cudnn` (called by `warm_up.warm_up`) builds every bucket's plan before the engine serves.
- Only a bucket planned there is ever sent to cuDNN; any other length keeps flash, so a plan is never
  built while serving.
- Opt-in until a GPU measures it against flash in `tandem-bench-decoder --prompts` (no device was lent
  to the session that wrote it).
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

__all__ = [
    "CUDNN_BUCKET",
    "CUDNN_MIN_ROWS",
    "PREFILL_BACKENDS",
    "USE_CUDNN",
    "attend_gpu",
    "bucket",
    "padded_causal",
    "plan_cudnn",
]

log = logging.getLogger("tandem")

# Prefill's SDPA backends: flash (causal, no cached prefix) and memory-efficient (masked) kernels have
# no per-shape setup, while backends that build a plan per new sequence length (cuDNN attention) would
# pay it on the first prompt of every length a server sees (cuDNN runs only through `plan_cudnn`'s
# buckets). Math stays as the fallback of last resort.
PREFILL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

_mode = os.environ.get("TANDEM_PREFILL_ATTENTION", "flash").strip()
if _mode not in ("flash", "cudnn"):
    raise ValueError(f"TANDEM_PREFILL_ATTENTION must be flash or cudnn, got {_mode!r}")
USE_CUDNN = _mode == "cudnn"
CUDNN_MIN_ROWS = 1024  # below this the attention is a small part of a prefill (and flash is close)
CUDNN_BUCKET = 256  # padded rows <= 255: <= 25 % more attention work at 1,024 rows, ~12 % at 2,048

# Whether flash attention takes grouped K/V itself (`enable_gqa`), per dtype, probed on the first GPU
# prefill of that dtype: where it does, K and V are not expanded to one copy per query head (2 x T x nh
# x hd per layer). Flash has no float32 kernel, so float32 always expands.
_FLASH_GQA: dict[torch.dtype, bool] = {}
# (device index, dtype, query heads, KV heads, head_dim, padded length) that `plan_cudnn` planned ->
# whether K/V go expanded per query head (cuDNN refused grouped K/V at planning).
_CUDNN_PLANNED: dict[tuple[int, torch.dtype, int, int, int, int], bool] = {}


def bucket(rows: int) -> int:
    """The padded length cuDNN runs a prompt of `rows` rows at: the next multiple of `CUDNN_BUCKET`."""
    return -(-rows // CUDNN_BUCKET) * CUDNN_BUCKET


def padded_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, expand: bool = False
) -> torch.Tensor:
    """Causal attention of q [t, nh, hd] over k/v [t, kvh, hd] computed at `length` >= t rows (zero rows
    appended, their outputs dropped) -> [t, nh*hd], under whatever SDPA backends the caller enabled;
    `expand` repeats K/V per query head instead of passing them grouped. The same function builds the
    plans and runs the prompts, so their tensors' shapes and strides match."""
    t = q.shape[0]
    if length < t:
        raise ValueError(f"padded length {length} is shorter than the prompt's {t} rows")
    if expand and q.shape[1] != k.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    pad = (0, 0, 0, 0, 0, length - t)
    qh, kh, vh = (F.pad(x, pad).transpose(0, 1)[None] for x in (q, k, v))
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return o[0, :, :t].transpose(0, 1).reshape(t, -1)


def _planned_key(
    q: torch.Tensor, k: torch.Tensor, length: int
) -> tuple[int, torch.dtype, int, int, int, int]:
    return (q.device.index or 0, q.dtype, q.shape[1], k.shape[1], q.shape[2], length)


def plan_cudnn(
    device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, max_rows: int
) -> int:
    """Build cuDNN's plan for every bucket from `CUDNN_MIN_ROWS` to `max_rows` (one call each on zero
    tensors) so `attend_gpu` can use them; a no-op unless `USE_CUDNN`. Stops at the first length cuDNN
    refuses (that torch or GPU has no such kernel: flash keeps every prompt) with a warning. Logs and
    returns the number of buckets planned."""
    if not USE_CUDNN or device.type != "cuda":
        return 0
    t0 = time.perf_counter()
    planned = 0
    expand = False
    for length in range(CUDNN_MIN_ROWS, bucket(max_rows) + 1, CUDNN_BUCKET):
        q = torch.zeros(length, heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(length, kv_heads, head_dim, dtype=dtype, device=device)
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                try:
                    padded_causal(q, kv, kv, length, expand)
                except RuntimeError:
                    if expand or heads == kv_heads:
                        raise
                    expand = True  # this cuDNN takes no grouped K/V: expanded, as flash's fallback
                    padded_causal(q, kv, kv, length, expand)
        except RuntimeError as exc:
            log.warning(
                "cuDNN prefill attention unavailable at %d rows (%s); prefill keeps flash", length, exc
            )
            break
        _CUDNN_PLANNED[_planned_key(q, kv, length)] = expand
        planned += 1
    torch.cuda.synchronize(device)
    log.info(
        "cuDNN prefill attention planned for %d lengths (%d..%d rows) in %.1f s",
        planned,
        CUDNN_MIN_ROWS,
        CUDNN_MIN_ROWS + CUDNN_BUCKET * max(planned - 1, 0),
        time.perf_counter() - t0,
    )
    return planned


def attend_gpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of one prompt on a GPU: q [t, nh, hd] over k/v [start + t, kvh, hd] -> [t, nh*hd].

    Fused kernels only: without a cached prefix flash attention (grouped K/V native where this torch
    supports it, else expanded per query head as HF's repeat_kv), or cuDNN for a planned bucket (see the
    module docstring); with a prefix, a lower-right causal bias rather than a boolean mask, which flash
    and memory-efficient attention take without falling back to the math backend."""
    t, group = q.shape[0], q.shape[1] // k.shape[1]
    if USE_CUDNN and not start and t >= CUDNN_MIN_ROWS:
        expand = _CUDNN_PLANNED.get(_planned_key(q, k, bucket(t)))
        if expand is not None:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return padded_causal(q, k, v, bucket(t), expand)
    qh = q.transpose(0, 1)[None]
    native = _FLASH_GQA.get(q.dtype)
    if not start and group > 1 and native is not False:
        kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        try:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        except RuntimeError:
            if native:
                raise
            _FLASH_GQA[q.dtype] = False
        else:
            _FLASH_GQA[q.dtype] = True
            return o[0].transpose(0, 1).reshape(t, -1)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if start:
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(t, start + t))
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    return o[0].transpose(0, 1).reshape(t, -1)
