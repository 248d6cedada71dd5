"""Render a model repository from the checked-in one: same models, other settings or placement.

The checked-in `model_repository/` is the CPU default (tiny preset, host shared-memory handoff).
A deployment or a test derives its own by overriding `tandem.*` parameters per model and, for GPUs,
the `instance_group` of each model — so there is one source of model definitions, not several. Every
model's `input [...]` and `output [...]` are the wire contract's (`wire/contract.py`), written at the
served model's widths (`io_blocks`); the checked-in files are that rendering at the tiny preset's.
What `tandem-repo`'s options override, model by model, is `serving/repository_rules.py`'s.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

from tandem.wire.contract import MODELS, ModelSpec, Widths

_GROUP = re.compile(r"^instance_group \[.*\]\s*$", re.MULTILINE)


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


def _block(kind: str, lines: list[str]) -> str:
    if len(lines) == 1:
        return f"{kind} [ {lines[0]} ]"
    return f"{kind} [\n" + ",\n".join(f"  {line}" for line in lines) + "\n]"


def io_blocks(model: ModelSpec, widths: Widths) -> tuple[str, str]:
    """`model`'s `input [...]` and `output [...]` as config.pbtxt writes them: one line for one
    tensor, else one tensor per line. Rows are [-1, W] and frames [-1, K]: one variable dimension only
    (Triton 2.51 checks a request's byte size only when every other dimension is known, so with two
    wildcards a shape such as [0, -5] reaches the python stub, whose numpy conversion then aborts the
    whole stub process)."""
    return (
        _block("input", [t.config_line(widths) for t in model.inputs]),
        _block("output", [t.config_line(widths) for t in model.outputs]),
    )


def _replace_block(config: str, kind: str, block: str) -> str:
    """`config` with its top-level `KIND [ ... ]` (one line, or up to a line `]`) replaced by `block`."""
    lines = config.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith(f"{kind} [")), None)
    if start is None:
        raise ValueError(f"config has no {kind} [ ... ] to replace")
    end = start
    if lines[start].rstrip() == f"{kind} [":
        end = next(i for i in range(start + 1, len(lines)) if lines[i].rstrip() == "]")
    return "\n".join([*lines[:start], block, *lines[end + 1 :]])


def set_io(config: str, model: ModelSpec, widths: Widths) -> str:
    """`config` (a config.pbtxt of `model`) with its inputs and outputs written from the contract."""
    inputs, outputs = io_blocks(model, widths)
    return _replace_block(_replace_block(config, "input", inputs), "output", outputs)


def tensor_dims(row_width: int, frame_width: int) -> Widths:
    """The widths every model's row tensors (`row_width` ids) and frame tensors (`frame_width`
    codes) are rendered at."""
    return Widths(row_width, frame_width)


def gpu_group(gpus: list[int], count: int = 1) -> str:
    return f"{{ kind: KIND_GPU count: {count} gpus: [ {', '.join(str(g) for g in gpus)} ] }}"


def render(
    source: Path,
    dest: Path,
    parameters: Mapping[str, Mapping[str, str]] | None = None,
    groups: Mapping[str, str] | None = None,
    dims: Widths | None = None,
) -> Path:
    """Copy `source` to `dest` applying per-model parameter and instance-group overrides; with `dims`,
    every model of the contract gets its inputs and outputs written at those widths (`set_io`)."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    contract = set() if dims is None else {p.parent.name for p in dest.glob("*/config.pbtxt")} & set(MODELS)
    models = set(parameters or {}) | set(groups or {}) | contract
    for model in models:
        cfg = dest / model / "config.pbtxt"
        if not cfg.is_file():
            raise ValueError(f"no model {model!r} in {source}")
        text = cfg.read_text()
        for key, value in (parameters or {}).get(model, {}).items():
            text = set_parameter(text, key, value)
        if groups and model in groups:
            text = set_instance_group(text, groups[model])
        if dims is not None and model in MODELS:
            text = set_io(text, MODELS[model], dims)
        cfg.write_text(text)
    return dest
