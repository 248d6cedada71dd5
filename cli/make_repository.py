"""`tandem-repo`: render a model repository for a deployment from the checked-in CPU default.

    # PD on two GPUs (P on GPU0, D on GPU1) and the monolithic baseline on both, 4B-shape decoder:
    tandem-repo --out /srv/repo --preset qwen3-4b-shape --dtype bfloat16 \\
        --prefill-gpus 0 --decode-gpus 1 --mono-gpus 0,1 --pool-pages 8192
    # a real checkpoint (HF config.json + safetensors):
    tandem-repo --out /srv/repo --checkpoint /models/orpheus-3b --dtype bfloat16 \\
        --prefill-gpus 0 --decode-gpus 1

    # text in, audio out, offline on a CPU: a small random Orpheus-format checkpoint and SNAC:
    tandem-repo --out /tmp/trial-repo --trial-orpheus /tmp/trial-models

    # Orpheus (family detected from the checkpoint, or --family orpheus) with its SNAC 24 kHz codec;
    # its streams sample under Orpheus' audio-token grammar, tokenizer or none:
    tandem-repo --out /srv/repo --checkpoint /models/orpheus-3b --codec /models/snac_24khz \
        --dtype bfloat16 --prefill-gpus 0 --decode-gpus 1 --vocoder-gpus 1

`--codec DIR` puts the family's codec behind D, the vocoder and `tts_mono` (SNAC: config.json +
pytorch_model.bin, for Orpheus and a model of no family; Mimi: config.json + model.safetensors, for
CSM). What each option means for each model (published rates and dims, chunk sizes, the family's
defaults) is the repository's rules (serving/repository_rules.py); this is argparse and that call.

    # Sesame CSM (detected from its config.json) with Mimi; rendered, not yet served by the engines
    # (docs/codecs.md, "CSM"):
    tandem-repo --out /srv/repo --checkpoint /models/csm-1b --codec /models/mimi
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.backend.text.families import FAMILIES
from tandem.serving.repository_rules import (
    SOURCE,
    RepositoryError,
    RepositoryRequest,
    Setting,
    parse_setting,
    write_repository,
)


def _setting(item: str) -> Setting:
    try:
        return parse_setting(item)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tandem-repo", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--source", type=Path, default=SOURCE)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None)
    src.add_argument("--checkpoint", default=None)
    src.add_argument(
        "--trial-orpheus",
        type=Path,
        metavar="DIR",
        help="write a small random Orpheus-format checkpoint (with a tokenizer.json built by `tokenizers`) "
        "and random SNAC 24 kHz into DIR and serve them: text in, audio (noise) out, offline, on a CPU",
    )
    ap.add_argument(
        "--codec",
        help="the family's codec directory for the vocoder seam: SNAC (config.json + pytorch_model.bin), "
        "or Mimi (config.json + model.safetensors) for CSM",
    )
    ap.add_argument(
        "--family",
        choices=sorted(FAMILIES),
        help="the model family; default: detected from --checkpoint (orpheus, csm), or the preset's "
        "(orpheus-3b-shape: orpheus)",
    )
    ap.add_argument("--vocoder-gpus", help="one vocoder instance per listed GPU (the codec decodes there)")
    ap.add_argument(
        "--voices",
        help="built-in voices, comma-separated ('*': any name); default: the family's (Orpheus: tara, "
        "leah, jess, leo, dan, mia, zac, zoe), else the checkpoint's tandem_voices, else none",
    )
    ap.add_argument(
        "--voices-dir",
        help="where registered voices are kept (absolute); default: $XDG_STATE_HOME/tandem/voices",
    )
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prefill-gpus")
    ap.add_argument("--decode-gpus")
    ap.add_argument("--mono-gpus", help="one tts_mono instance per listed GPU")
    ap.add_argument("--pool-pages", type=int)
    ap.add_argument("--max-batch", type=int)
    ap.add_argument("--unit", help="transfer unit name (socket dir, lock names)")
    ap.add_argument(
        "--path",
        help="KV transfer path P and D require (host_shm, cuda_ipc, cuda_vmm, proxy, tcp); "
        "default: cuda_ipc when P or D is placed on a GPU, else the repository's (host_shm)",
    )
    ap.add_argument(
        "--set",
        dest="sets",
        action="append",
        type=_setting,
        default=[],
        metavar="MODEL:KEY=VALUE",
        help="any other tandem.* parameter, e.g. decode:tandem.transfer.deadline_s=2",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        write_repository(RepositoryRequest(**{**vars(args), "sets": tuple(args.sets)}))
    except RepositoryError as exc:
        raise SystemExit(f"tandem-repo: {exc}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
