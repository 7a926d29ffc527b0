"""Checks shared by every TOML file mpips reads (jobs, layouts): unknown keys are named, and
values wrong in any run (a layout's ps) are refused by every run."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from .errors import ConfigError


def check_keys(table: dict[str, Any], allowed: Iterable[str], where: str) -> None:
    """Reject keys not in ``allowed``, naming the key and the closest allowed one."""
    allowed = list(allowed)
    for key in table:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = (
                f" (did you mean '{close[0]}'?)" if close else f" (allowed: {', '.join(allowed)})"
            )
            raise ConfigError(f"{where}: unknown key '{key}'{hint}")


def is_int(value: Any) -> bool:
    """An integer, not a bool (TOML's ``true`` is a Python int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_ps(ps: Any, where: str) -> None:
    """ConfigError naming ``where`` unless ``ps`` is None, a count >= 0, "per_node" or a
    list of distinct ranks >= 0: what is wrong whatever the world size, refused in every
    run (a one-process run, which drops the layout, included)."""
    if ps is None or ps == "per_node":
        return
    if not (is_int(ps) or (isinstance(ps, list) and all(map(is_int, ps)))):
        raise ConfigError(f'{where}: expected a count, a list of ranks or "per_node", got {ps!r}')
    if is_int(ps) and ps < 0:
        raise ConfigError(f"{where}: a count of PS tasks must be >= 0, got {ps}")
    if isinstance(ps, list):
        negative = [r for r in ps if r < 0]
        if negative:
            raise ConfigError(f"{where}: ps rank {negative[0]} is negative (ranks count from 0)")
        dups = sorted({r for r in ps if ps.count(r) > 1})
        if dups:
            raise ConfigError(f"{where}: ps rank {dups[0]} is listed more than once")
