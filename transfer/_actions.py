"""Deferred calls: decided under a lock, run after it is released (callbacks, sends)."""

from __future__ import annotations

from collections.abc import Callable

Actions = list[Callable[[], None]]


def run(actions: Actions) -> None:
    """Run each action in order; call with no lock held."""
    for action in actions:
        action()
