"""SNAC (the `snac` package) behind the codec seam, loaded from a local directory.

The directory holds what `hubertsiuzdak/snac_24khz` ships: `config.json` (SNAC's constructor
arguments, every one honoured, `noise` included: with `noise: true` the decoder adds fresh Gaussian
noise in every call, as upstream does, so two decodes of one window differ slightly) and
`pytorch_model.bin` (its state dict). Loading goes through `SNAC.from_pretrained(directory)`, the
package's own loader, which reads a local directory without touching the network.

A frame is one code of the coarsest level and `vq_strides[0] // s` codes of each level of stride s
(24 kHz: 1 + 2 + 4 = 7 codes), `hop_length * vq_strides[0]` samples (2,048). Frames arrive in the
canonical order: level by level, each level's codes in time order.

Batching: `decode` stacks the windows of equal frame count (streams in their steady state all send
the same window size) into one call on the codec's device; windows of other sizes go in their own
call. Padding windows to one length would change the audio of their last frames (the decoder's
convolutions see the padding), so it is not done.

At load, SNAC's weight-norm parametrisations are folded into plain weights (inference recomputes
nothing per call; the audio is the same to float rounding), and `warm` decodes each window length
the vocoder will see once, so no stream's first chunk pays a shape's first call.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from tandem.backend.codec.base import CodecSpec, CodecWindow
from tandem.backend.codec.config import read_codec_dir

_M = TypeVar("_M", bound=torch.nn.Module)
CONFIG = "config.json"
WEIGHTS = "pytorch_model.bin"
# hubertsiuzdak/snac_24khz config.json: the codec Orpheus was trained with (19.5 M parameters).
SNAC_24KHZ: dict[str, Any] = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}


def write_random(path: str | Path, *, noise: bool = True, seed: int = 0) -> Path:
    """A SNAC directory as hubertsiuzdak/snac_24khz ships it (the real 24 kHz config, `noise` as
    given) with random weights (seeded): what tests and benchmarks use where no weights can be
    downloaded. Writes config.json + pytorch_model.bin (~78 MB) into `path`; returns it."""
    from snac import SNAC

    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    config = {**SNAC_24KHZ, "noise": noise}
    torch.manual_seed(seed)
    model = SNAC(**config)
    (directory / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    torch.save(model.state_dict(), directory / WEIGHTS)
    return directory


def read_config(path: str | Path) -> dict[str, Any]:
    """SNAC's `config.json` in `path`; raises ValueError naming what is missing or malformed."""
    directory, config = read_codec_dir(path, "SNAC", CONFIG, WEIGHTS)
    strides = config.get("vq_strides")
    if not (isinstance(strides, list) and strides and all(isinstance(s, int) and s > 0 for s in strides)):
        raise ValueError(f"{directory / CONFIG}: vq_strides must be a list of positive integers")
    if any(strides[0] % s for s in strides):
        raise ValueError(f"{directory / CONFIG}: every vq_stride must divide the first, got {strides}")
    for key in ("sampling_rate", "encoder_rates"):
        if key not in config:
            raise ValueError(f"{directory / CONFIG}: no {key!r}")
    return dict(config)


def level_counts(config: dict[str, Any]) -> list[int]:
    """Codes of each level in one frame ([1, 2, 4] for SNAC 24 kHz)."""
    strides = config["vq_strides"]
    return [strides[0] // s for s in strides]


def snac_spec(path: str | Path, layout: str, lookback: int, lookahead: int, rows_per_frame: int) -> CodecSpec:
    """The spec of the SNAC in `path` (reads config.json only; no weights, no torch work)."""
    config = read_config(path)
    hop = int(np.prod(config["encoder_rates"]))
    return CodecSpec(
        kind="snac",
        layout=layout,
        sample_rate=int(config["sampling_rate"]),
        samples_per_frame=hop * int(config["vq_strides"][0]),
        rows_per_frame=rows_per_frame,
        lookback=lookback,
        lookahead=lookahead,
    )


def fold_weight_norm(model: _M) -> _M:
    """Replace every weight-norm parametrisation (`torch.nn.utils.parametrizations.weight_norm`, as
    SNAC builds its convolutions) by the weight it computes, in place; returns `model`."""
    from torch.nn.utils import parametrize

    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
    return model


class SnacCodec:
    """`Codec` over a SNAC model on one device; owned by one model instance (not thread-safe)."""

    def __init__(self, path: str | Path, spec: CodecSpec, device: torch.device, fold: bool = True) -> None:
        from snac import SNAC  # the package pulls einops; imported here so D never needs it

        self._config = read_config(path)
        self._spec = spec
        self._counts = level_counts(self._config)
        self._width = sum(self._counts)
        self._codebook = int(self._config.get("codebook_size", 4096))
        self.device = device
        self.noise = bool(self._config.get("noise", True))  # SNAC's own default
        model = SNAC.from_pretrained(str(path))
        self._model = (fold_weight_norm(model) if fold else model).to(device).eval()  # fold=False: benches

    @property
    def spec(self) -> CodecSpec:
        return self._spec

    def levels(self, frames: torch.Tensor) -> list[torch.Tensor]:
        """Frames [B, N, K] (canonical order) -> SNAC's codes, one [B, N * count] tensor per level."""
        b, n, _ = frames.shape
        out, at = [], 0
        for count in self._counts:
            out.append(frames[:, :, at : at + count].reshape(b, n * count))
            at += count
        return out

    def encode(self, pcm: np.ndarray, frame_width: int) -> np.ndarray:
        """`Encoder.encode`: SNAC's own `encode` on the codec's device (it pads the audio to whole
        frames), its per-level codes regrouped into frames [F, 7] in canonical order. Seconds of CPU
        per second of audio (docs/benchmarks); the registrar runs it on its own thread."""
        if frame_width != self._width:
            raise ValueError(f"SNAC frames have {self._width} codes, asked for {frame_width}")
        x = torch.from_numpy(np.ascontiguousarray(pcm, dtype=np.float32)).reshape(1, 1, -1).to(self.device)
        with torch.inference_mode():
            levels = self._model.encode(x)
        frames = levels[0].shape[1]
        parts = [c.reshape(1, frames, count) for c, count in zip(levels, self._counts, strict=True)]
        return torch.cat(parts, dim=2)[0].to(torch.int64).cpu().numpy()

    def warm(self, frame_counts: list[int]) -> None:
        """Decode one window of each length in `frame_counts` (batch 1) and drop the audio."""
        rng = np.random.default_rng(0)
        for n in sorted(set(frame_counts)):
            if n > 0:
                codes = rng.integers(0, self._codebook, size=(n, self._width))
                self.decode([CodecWindow(codes, 0, 0, n)])

    def decode(self, windows: list[CodecWindow]) -> list[np.ndarray]:
        """See `Codec.decode`: one SNAC call per distinct window length (windows emitting nothing
        cost nothing)."""
        out: list[np.ndarray | None] = [None] * len(windows)
        groups: dict[int, list[int]] = defaultdict(list)
        for i, w in enumerate(windows):
            if w.frames.shape[1] != self._width:
                width = w.frames.shape[1]
                raise ValueError(f"SNAC frames have {self._width} codes, got a window of width {width}")
            if w.frames.size and (w.frames.min() < 0 or w.frames.max() >= self._codebook):
                raise ValueError(f"SNAC codes must lie in [0, {self._codebook})")
            if w.emitted == 0:
                out[i] = np.zeros(0, dtype=np.float32)
            else:
                groups[w.frames.shape[0]].append(i)
        spf = self._spec.samples_per_frame
        for members in groups.values():
            stacked = np.stack([windows[i].frames for i in members])
            codes = torch.from_numpy(stacked).to(self.device, non_blocking=True)
            with torch.inference_mode():
                audio = self._model.decode(self.levels(codes))[:, 0].float().cpu().numpy()
            for row, i in enumerate(members):
                w = windows[i]
                lo = (w.emit_from - w.first_frame) * spf
                out[i] = np.ascontiguousarray(audio[row, lo : lo + w.emitted * spf])
        return [a if a is not None else np.zeros(0, dtype=np.float32) for a in out]
