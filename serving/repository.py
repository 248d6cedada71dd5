"""Render a model repository from the checked-in one: same models, other settings or placement.

The checked-in `model_repository/` is the CPU default (tiny preset, host shared-memory handoff).
A deployment or a test derives its own by overriding `tandem.*` parameters per model and, for GPUs,
the `instance_group` of each model — so there is one source of model definitions, not several.
What `tandem-repo`'s options override, model by model, is `serving/repository_rules.py`'s.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

_GROUP = re.compile(r"^instance_group \[.*\]\s*$", re.MULTILINE)

# Which tensors carry rows of the model's width W, and which codec frames of K codes, per model.
# Their config dims are [-1, W] / [-1, K] (`tensor_dims`): one variable dimension only. Triton 2.51
# checks a request's byte size only when every dimension is known, so with two wildcards a shape such
# as [0, -5] reaches the python stub, whose numpy conversion then aborts the whole stub process.
ROW_TENSORS: dict[str, tuple[str, ...]] = {
    "frontend": ("PROMPT", "ROWS"),
    "prefill": ("PROMPT",),
    "decode": ("TOKENS",),
    "vocoder": ("TOKENS", "TOKENS_OUT"),
    "tts": ("PROMPT", "TOKENS"),
    "tts_mono": ("PROMPT", "TOKENS"),
}
FRAME_TENSORS: dict[str, tuple[str, ...]] = {"decode": ("CODES",), "vocoder": ("CODES",)}


# A text-format string: any character but a quote or a backslash, or an escape (a value with quotes,
# such as a JSON object, is written escaped and read back as it was).
_STRING = r'"((?:[^"\\]|\\.)*)"'
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n"}


def _quote(value: str) -> str:
    return "".join(_ESCAPES.get(c, c) for c in value)


def _unquote(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


def _parameter(key: str) -> re.Pattern[str]:
    return re.compile(
        r'parameters \{ key: "' + re.escape(key) + r'" value \{ string_value: ' + _STRING + r" \} \}"
    )


def set_parameter(config: str, key: str, value: str) -> str:
    """Replace (or append) `parameters { key: KEY value { string_value: ... } }` in a config.pbtxt."""
    line = f'parameters {{ key: "{key}" value {{ string_value: "{_quote(value)}" }} }}'
    pattern = _parameter(key)
    if pattern.search(config):
        return pattern.sub(lambda _: line, config)
    return config.rstrip("\n") + "\n" + line + "\n"


def get_parameter(config: str, key: str) -> str | None:
    """The string value of `parameters { key: KEY ... }` in a config.pbtxt, or None if it has none."""
    m = _parameter(key).search(config)
    return _unquote(m.group(1)) if m else None


def model_parameter(repository: Path, model: str, key: str) -> str | None:
    """`get_parameter` of `<repository>/<model>/config.pbtxt`."""
    return get_parameter((repository / model / "config.pbtxt").read_text(), key)


def repository_unit(repository: Path | str) -> str:
    """The unit a repository's server serves when no model names one (`tandem.transfer.unit`):
    8 hex digits of its real path, e.g. `5f1c9a2e` (short: the unit's control sockets must fit
    AF_UNIX's 107 bytes under a deep runtime dir). Two
    repositories on one host get two units; the same one (a restart) the same unit."""
    real = os.path.realpath(repository)
    return hashlib.sha256(real.encode()).hexdigest()[:8]


def set_instance_group(config: str, group: str) -> str:
    """Replace the single-line `instance_group [ ... ]` of a config.pbtxt."""
    if not _GROUP.search(config):
        raise ValueError("config has no single-line instance_group to replace")
    return _GROUP.sub(lambda _: f"instance_group [ {group} ]", config)


def set_dims(config: str, tensor: str, dims: list[int]) -> str:
    """Replace the dims of the one-line input or output `{ name: "TENSOR" ... dims: [ ... ] ... }`."""
    pattern = re.compile(r'(\{ name: "' + re.escape(tensor) + r'" data_type: \w+ dims: \[)[^\]]*(\])')
    if not pattern.search(config):
        raise ValueError(f"config has no one-line tensor {tensor!r} to set dims on")
    return pattern.sub(lambda m: f"{m.group(1)} {', '.join(str(d) for d in dims)} {m.group(2)}", config)


def tensor_dims(row_width: int, frame_width: int) -> dict[str, dict[str, list[int]]]:
    """Per model, the dims of its row and frame tensors for rows of `row_width` ids and codec frames
    of `frame_width` codes."""
    out: dict[str, dict[str, list[int]]] = {}
    for model, names in ROW_TENSORS.items():
        out.setdefault(model, {}).update({n: [-1, row_width] for n in names})
    for model, names in FRAME_TENSORS.items():
        out.setdefault(model, {}).update({n: [-1, frame_width] for n in names})
    return out


def gpu_group(gpus: list[int], count: int = 1) -> str:
    return f"{{ kind: KIND_GPU count: {count} gpus: [ {', '.join(str(g) for g in gpus)} ] }}"


def render(
    source: Path,
    dest: Path,
    parameters: Mapping[str, Mapping[str, str]] | None = None,
    groups: Mapping[str, str] | None = None,
    dims: Mapping[str, Mapping[str, list[int]]] | None = None,
) -> Path:
    """Copy `source` to `dest` applying per-model parameter, instance-group and tensor-dims overrides."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    models = set(parameters or {}) | set(groups or {}) | set(dims or {})
    for model in models:
        cfg = dest / model / "config.pbtxt"
        if not cfg.is_file():
            raise ValueError(f"no model {model!r} in {source}")
        text = cfg.read_text()
        for key, value in (parameters or {}).get(model, {}).items():
            text = set_parameter(text, key, value)
        if groups and model in groups:
            text = set_instance_group(text, groups[model])
        for tensor, shape in (dims or {}).get(model, {}).items():
            text = set_dims(text, tensor, shape)
        cfg.write_text(text)
    return dest
