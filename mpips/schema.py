"""Checks shared by every TOML file mpips reads (jobs, layouts): unknown keys are named."""

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
