"""Mimi (Kyutai's codec, CSM's) behind the codec seam, from its own package: `transformers.MimiModel`.

The directory holds what `kyutai/mimi` ships (`MimiModel.save_pretrained`): `config.json`
(model_type `mimi`) and `model.safetensors`. Loading goes through `MimiModel.from_pretrained(dir)`,
which reads a local directory without touching the network. Mimi: 24 kHz, 12.5 frames a second
(1,920 samples a frame), `num_quantizers` codes a frame (CSM-1B uses all 32), in quantizer order.

Streaming, statelessly: Mimi's decoder is causal (causal convolutions, a causal transformer with a
sliding window of 250 steps at 25 Hz), so a frame's audio depends on the frames before it, not after:
no lookahead is needed, and the lookback bounds how much of that past a window carries. The
vocoder keeps no state between chunks (backend/codec/base.py), so each window re-decodes its
lookback; Mimi's own streaming mode (a padding cache and the transformer's KV per stream) would
decode each frame once but makes the codec stateful. Measured against the offline decode with
random weights (trained attention may reach further back: measure again on kyutai/mimi's): Mimi's
real shape, lookback 4 about 22 dB, 8 about 75 dB, 16 about 81 dB; the tests' tiny Mimi (one
transformer layer) ~100 dB at 8, ~2 dB with none (docs/codecs.md).

Batching: windows of equal frame count go in one `decode` call (as SNAC's do); other lengths get
their own call (padding would change the audio of their last frames through the transformer).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.backend.codec.base import CodecSpec, CodecWindow
from tandem.backend.codec.config import read_codec_dir

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


def read_config(path: str | Path) -> dict[str, Any]:
    """Mimi's `config.json` in `path`; raises ValueError naming what is missing or malformed."""
    directory, config = read_codec_dir(path, "Mimi", CONFIG, WEIGHTS)
    if config.get("model_type") != "mimi":
        raise ValueError(f"{directory / CONFIG}: model_type {config.get('model_type')!r} is not 'mimi'")
    return dict(config)


def mimi_spec(path: str | Path, layout: str, lookback: int, lookahead: int, rows_per_frame: int) -> CodecSpec:
    """The spec of the Mimi in `path` (its config only, through transformers' `MimiConfig`, whose
    `frame_size` is the samples of one frame)."""
    from transformers import MimiConfig

    read_config(path)
    config = MimiConfig.from_pretrained(str(path))
    return CodecSpec(
        kind="mimi",
        layout=layout,
        sample_rate=int(config.sampling_rate),
        samples_per_frame=int(config.frame_size),
        rows_per_frame=rows_per_frame,
        lookback=lookback,
        lookahead=lookahead,
    )


class MimiCodec:
    """`Codec` and `Encoder` over a Mimi model on one device; owned by one model instance (not
    thread-safe)."""

    def __init__(self, path: str | Path, spec: CodecSpec, device: torch.device) -> None:
        from transformers import MimiModel

        read_config(path)
        self._spec = spec
        self.device = device
        model = MimiModel.from_pretrained(str(path))
        # transformers' stubs type PreTrainedModel.to() for a dtype only; a device is what torch takes.
        model.to(device)  # type: ignore[arg-type]
        self._model = model.eval()
        self._quantizers = int(self._model.config.num_quantizers)
        self._codebook = int(self._model.config.codebook_size)

    @property
    def spec(self) -> CodecSpec:
        return self._spec

    def _check_width(self, width: int) -> None:
        if not 1 <= width <= self._quantizers:
            raise ValueError(f"Mimi frames have 1..{self._quantizers} codes, got a frame width of {width}")

    def encode(self, pcm: np.ndarray, frame_width: int) -> np.ndarray:
        """`Encoder.encode`: Mimi's own encoder with `frame_width` quantizers -> frames [F, K]."""
        self._check_width(frame_width)
        x = torch.from_numpy(np.ascontiguousarray(pcm, dtype=np.float32)).reshape(1, 1, -1).to(self.device)
        with torch.inference_mode():
            codes = self._model.encode(x, num_quantizers=frame_width).audio_codes  # [1, K, F]
        return codes[0].T.to(torch.int64).cpu().numpy()

    def decode(self, windows: list[CodecWindow]) -> list[np.ndarray]:
        """See `Codec.decode`: one Mimi call per distinct window length (windows emitting nothing
        cost nothing)."""
        out: list[np.ndarray | None] = [None] * len(windows)
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i, w in enumerate(windows):
            self._check_width(w.frames.shape[1])
            if w.frames.size and (w.frames.min() < 0 or w.frames.max() >= self._codebook):
                raise ValueError(f"Mimi codes must lie in [0, {self._codebook})")
            if w.emitted == 0:
                out[i] = np.zeros(0, dtype=np.float32)
            else:
                groups[w.frames.shape].append(i)
        spf = self._spec.samples_per_frame
        for members in groups.values():
            stacked = np.stack([windows[i].frames for i in members]).transpose(0, 2, 1)  # [B, K, N]
            codes = torch.from_numpy(np.ascontiguousarray(stacked)).to(self.device)
            with torch.inference_mode():
                audio = self._model.decode(codes).audio_values[:, 0].float().cpu().numpy()
            for row, i in enumerate(members):
                w = windows[i]
                lo = (w.emit_from - w.first_frame) * spf
                out[i] = np.ascontiguousarray(audio[row, lo : lo + w.emitted * spf])
        return [a if a is not None else np.zeros(0, dtype=np.float32) for a in out]
