"""The seam a fault drill plugs into P: a copy hook loaded from a file the settings name.

With `tandem.faults.hook` unset (the default) P's sender gets no hook. A drill names a Python file
whose `make_copy_hook(options)` builds the hook (the tests': tests/support/fault_hooks.py); it is
loaded by path, once, when P starts.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable

import torch

from tandem.backend.settings import FaultSettings

log = logging.getLogger("tandem")

CopyHook = Callable[[str, torch.Tensor], None]


def copy_hook(faults: FaultSettings) -> CopyHook | None:
    """The hook `faults` names, or None. Raises ValueError naming the parameter when it cannot load."""
    if not faults.hook:
        return None
    try:
        options = json.loads(faults.options)
    except ValueError as exc:
        raise ValueError(f"parameter 'faults.options': not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise ValueError("parameter 'faults.options': must be a JSON object")
    spec = importlib.util.spec_from_file_location("tandem_fault_hook", faults.hook)
    if spec is None or spec.loader is None:
        raise ValueError(f"parameter 'faults.hook': cannot load {faults.hook!r}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        hook: CopyHook = module.make_copy_hook(options)
    except (OSError, AttributeError) as exc:
        raise ValueError(f"parameter 'faults.hook': {faults.hook!r}: {exc}") from None
    log.warning("fault injection: P's copies go through %s (%s)", faults.hook, options)
    return hook
