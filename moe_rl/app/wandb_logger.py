"""Weights & Biases logging of the iteration rows (optional: `pip install wandb`).

Run config:  wandb: {project: moe-rl, entity: null, group: null, tags: [], mode: online|offline}
Each metrics.parquet row goes to `wandb.log(row, step=iteration)`, the resolved run config to
`wandb.config`, and alerts as W&B alerts' text in the run summary. Without the section nothing is
imported; with it but without the package, the run fails fast (ConfigError) before Ray starts.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

from moe_rl.core.settings import ConfigError

WANDB_KEYS = {"project", "entity", "group", "tags", "mode", "name"}


def validate_wandb(section: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError(f"wandb: must be a mapping (project, entity, group, tags, mode, name), got {section!r}")
    unknown = sorted(set(section) - WANDB_KEYS)
    if unknown:
        raise ConfigError(f"wandb.{unknown[0]}: unknown key, allowed: {', '.join(sorted(WANDB_KEYS))}")
    if section.get("mode", "online") not in ("online", "offline", "disabled"):
        raise ConfigError(f"wandb.mode: must be online, offline or disabled, got {section['mode']!r}")
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("wandb: the wandb package is not installed (pip install wandb), "
                          "or remove the wandb section") from None
    return section


class WandbLogger:
    def __init__(self, options: Dict[str, Any], run_config: Dict[str, Any], run_dir: str, name: str):
        import wandb
        self.run = wandb.init(project=options.get("project", "moe-rl"), entity=options.get("entity"),
                              group=options.get("group"), tags=options.get("tags"),
                              mode=options.get("mode", "online"), name=options.get("name", name),
                              dir=run_dir, config=run_config, reinit="finish_previous")

    def log(self, row: Dict[str, Any], alerts=()) -> None:
        data = {k: v for k, v in row.items() if k != "iteration" and (
            isinstance(v, str) or (isinstance(v, (int, float)) and math.isfinite(v)))}
        self.run.log(data, step=int(row["iteration"]))
        for a in alerts:
            self.run.summary[f"alert/{a['iteration']}/{a['metric']}"] = a["message"]

    def close(self) -> None:
        self.run.finish()
