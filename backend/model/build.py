"""Builds an engine's decoder from settings: a preset with deterministic random weights, or a real
checkpoint directory (config.json + safetensors). The same code path serves CPU and GPU instances."""

from __future__ import annotations

import logging

import torch

from tandem.backend.model.checkpoint import load_checkpoint
from tandem.backend.model.config import preset
from tandem.backend.model.decoder import Decoder
from tandem.backend.settings import EngineSettings

log = logging.getLogger("tandem")


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


def build_decoder(settings: EngineSettings, device: torch.device) -> Decoder:
    src = settings.model
    if src.checkpoint:
        decoder = load_checkpoint(src.checkpoint, device=device, dtype=src.dtype or None)
        log.info("loaded checkpoint %s on %s", src.checkpoint, device)
    else:
        cfg = preset(src.preset)
        if src.dtype:
            cfg = cfg.with_dtype(src.dtype)
        decoder = Decoder.random(cfg, device=device, seed=src.seed)
        log.info("built preset %s (random weights, seed %d) on %s", src.preset, src.seed, device)
    if settings.torch_threads > 0:
        torch.set_num_threads(settings.torch_threads)
    return decoder.eval()
