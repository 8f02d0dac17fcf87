"""What a run directory's config.yaml may name when its code is not trusted.

A config.yaml may come from anyone (a colleague, a download, a shared disk someone else can
write). Naming code in it is running it: `module:attribute` is imported by whatever reads it (the
env, multi_agent.mapping_fn, anything else RLlib resolves), so without --trust-env-code none is
(moe_rl/app/run_config.py refuses it before anything is imported). A file path it names is read:
`deepspeed.config` as a JSON path is refused for a run directory (a resolved config.yaml always
holds the dict itself), so a FIFO or /dev/zero there cannot hang `evaluate`.
"""
from __future__ import annotations

import re
from typing import Any, Dict, Optional, Tuple

from moe_rl.core.errors import ConfigError

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def import_path_in(value: Any, where: str = "") -> Optional[Tuple[str, str]]:
    """(dotted key, value) of the first string shaped `module:attribute` anywhere in a config (the
    top-level env aside: run_config checks it on its own), or None."""
    if isinstance(value, dict):
        for k, v in value.items():
            key = f"{where}.{k}" if where else str(k)
            found = None if key == "env" else import_path_in(v, key)
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = import_path_in(v, f"{where}[{i}]")
            if found:
                return found
    elif isinstance(value, str) and _IMPORT_PATH.match(value) and not value.startswith("moe_rl/"):
        return where, value
    return None


def refuse_import_paths(cfg: Dict[str, Any]) -> None:
    """ConfigError naming the first `module:attribute` string in a config (the env aside)."""
    where = import_path_in(cfg)
    if where:
        raise ConfigError(f"{where[0]}: {where[1]!r:.200} names code to import (module:attribute); a run "
                          "directory's config.yaml may come from anyone: pass --trust-env-code to import it")


def refuse_file_references(cfg: Dict[str, Any], flag: str) -> None:
    """A run directory's config names no file to read (ConfigError naming the field)."""
    ds = cfg.get("deepspeed")
    if isinstance(ds, dict) and isinstance(ds.get("config"), str):
        raise ConfigError(f"{flag}: deepspeed.config: {ds['config']!r:.200} names a file to read; a run "
                          "directory's config.yaml holds the DeepSpeed config itself (a mapping)")
