"""A model's generation defaults: what a request that names no sampling input gets.

From the checkpoint, as vLLM reads them: `generation_config.json`'s `temperature`, `top_p`, `top_k`,
`repetition_penalty` (`do_sample` not consulted); the stop ids are its and config.json's
`eos_token_id` plus the grammar's end-of-speech. The audio-token grammar is on by default for an
Orpheus model (`tandem.frontend.grammar`: auto, off, orpheus).

Built once per model instance by `serving/triton_io.py` (P and `tts_mono`); D gets the result in each
request's `SamplingParams`. A malformed file or a grammar that does not fit is a load-time ValueError.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tandem.backend.generation.grammar import GRAMMAR_NAMES, Grammar, check_vocab, stop_ids
from tandem.backend.model.config import ModelConfig
from tandem.backend.prompt import (
    DEFAULT_REPETITION_PENALTY,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    GenerationDefaults,
)
from tandem.backend.settings import EngineSettings
from tandem.backend.text.frontend import Family, TextFrontend


def _ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in items):
        raise ValueError(f"{where}: eos_token_id must be an id or a list of ids, got {value!r}")
    return list(items)


def _number(gen: dict[str, Any], key: str, default: float, ok: Any, where: str) -> float:
    value = gen.get(key)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not ok(value)
    ):
        raise ValueError(f"{where}: {key} = {value!r} is out of range")
    return float(value)


def resolve_grammar(settings: EngineSettings, frontend: TextFrontend | None) -> Grammar:
    """`tandem.frontend.grammar`: auto (Orpheus' grammar on an Orpheus model: detected by the text
    front end, or `tandem.frontend.family` = orpheus), off, or orpheus."""
    name = settings.frontend.grammar
    if name == "auto":
        orpheus = (
            frontend is not None and frontend.family == Family.ORPHEUS
        ) or settings.frontend.family == "orpheus"
        return Grammar.ORPHEUS if orpheus else Grammar.NONE
    try:
        return GRAMMAR_NAMES[name]
    except KeyError:
        raise ValueError(
            f"unknown tandem.frontend.grammar {name!r}; expected auto, {', '.join(GRAMMAR_NAMES)}"
        ) from None


def load_generation_defaults(
    settings: EngineSettings, cfg: ModelConfig, frontend: TextFrontend | None
) -> GenerationDefaults:
    """The defaults for `cfg` served with `settings` (the checkpoint's generation_config.json when
    it has one). Raises ValueError for a malformed file or a grammar the vocabulary cannot hold."""
    grammar = resolve_grammar(settings, frontend)
    check_vocab(grammar, cfg.vocab_size)
    stops = _ids(cfg.eos_token_id, "config.json")
    gen: dict[str, Any] = {}
    root = Path(settings.model.checkpoint) if settings.model.checkpoint else None
    if root is not None:
        stops += _ids(json.loads((root / "config.json").read_text()).get("eos_token_id"), "config.json")
        file = root / "generation_config.json"
        if file.is_file():
            gen = json.loads(file.read_text())
            if not isinstance(gen, dict):
                raise ValueError(f"{file}: not a JSON object")
            stops += _ids(gen.get("eos_token_id"), str(file))
    where = f"{root}/generation_config.json"
    stops += stop_ids(grammar)
    unique = tuple(dict.fromkeys(s for s in stops if s < cfg.vocab_size))
    return GenerationDefaults(
        temperature=_number(gen, "temperature", DEFAULT_TEMPERATURE, lambda v: 0 <= v <= 10, where),
        top_p=_number(gen, "top_p", DEFAULT_TOP_P, lambda v: 0 < v <= 1, where),
        top_k=int(_number(gen, "top_k", DEFAULT_TOP_K, lambda v: v >= 0 and v == int(v), where)),
        repetition_penalty=_number(
            gen, "repetition_penalty", DEFAULT_REPETITION_PENALTY, lambda v: 0 < v <= 10, where
        ),
        grammar=grammar,
        stop_token_ids=unique,
    )
