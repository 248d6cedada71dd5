"""Render a model repository from the checked-in one: same models, other settings or placement.

The checked-in `model_repository/` is the CPU default (tiny preset, host shared-memory handoff).
A deployment or a test derives its own by overriding `tandem.*` parameters per model and, for GPUs,
the `instance_group` of each model — so there is one source of model definitions, not several.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from pathlib import Path

_GROUP = re.compile(r"^instance_group \[.*\]\s*$", re.MULTILINE)


def set_parameter(config: str, key: str, value: str) -> str:
    """Replace (or append) `parameters { key: KEY value { string_value: ... } }` in a config.pbtxt."""
    line = f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}'
    pattern = re.compile(r'parameters \{ key: "' + re.escape(key) + r'" value \{ string_value: "[^"]*" \} \}')
    if pattern.search(config):
        return pattern.sub(lambda _: line, config)
    return config.rstrip("\n") + "\n" + line + "\n"


def get_parameter(config: str, key: str) -> str | None:
    """The string value of `parameters { key: KEY ... }` in a config.pbtxt, or None if it has none."""
    m = re.search(
        r'parameters \{ key: "' + re.escape(key) + r'" value \{ string_value: "([^"]*)" \} \}', config
    )
    return m.group(1) if m else None


def model_parameter(repository: Path, model: str, key: str) -> str | None:
    """`get_parameter` of `<repository>/<model>/config.pbtxt`."""
    return get_parameter((repository / model / "config.pbtxt").read_text(), key)


def set_instance_group(config: str, group: str) -> str:
    """Replace the single-line `instance_group [ ... ]` of a config.pbtxt."""
    if not _GROUP.search(config):
        raise ValueError("config has no single-line instance_group to replace")
    return _GROUP.sub(lambda _: f"instance_group [ {group} ]", config)


def gpu_group(gpus: list[int], count: int = 1) -> str:
    return f"{{ kind: KIND_GPU count: {count} gpus: [ {', '.join(str(g) for g in gpus)} ] }}"


def render(
    source: Path,
    dest: Path,
    parameters: Mapping[str, Mapping[str, str]] | None = None,
    groups: Mapping[str, str] | None = None,
) -> Path:
    """Copy `source` to `dest` applying per-model parameter and instance-group overrides."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    models = set(parameters or {}) | set(groups or {})
    for model in models:
        cfg = dest / model / "config.pbtxt"
        if not cfg.is_file():
            raise ValueError(f"no model {model!r} in {source}")
        text = cfg.read_text()
        for key, value in (parameters or {}).get(model, {}).items():
            text = set_parameter(text, key, value)
        if groups and model in groups:
            text = set_instance_group(text, groups[model])
        cfg.write_text(text)
    return dest
