"""Checks of what users hand the public entry points, shared by them."""

from __future__ import annotations

from typing import Any


def check_world_size(world_size: Any, where: str) -> int:
    """`world_size` if it is an int >= 1 (bools refused), else ValueError naming `where`."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{where}: world_size must be an int >= 1, got {world_size!r}")
    return world_size
