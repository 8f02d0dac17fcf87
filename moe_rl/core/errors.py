"""One error form for invalid settings, shared by every layer (pure python)."""
from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """An invalid setting; str() is one line naming the field and what is allowed."""


def need(cond: bool, field: str, allowed: str, got: Any) -> None:
    """Raise ConfigError("<field>: must be <allowed>, got <got>") unless cond."""
    if not cond:
        raise ConfigError(f"{field}: must be {allowed}, got {got!r}")
