"""`moe-rl train --resume` and `evaluate`: a saved config.yaml as a run config again, and what a
resume may not change (the model and the checkpoint's learner layout)."""
from __future__ import annotations

import copy
import logging
from typing import Any, Dict, List, Tuple

import yaml

from moe_rl.app.run_config import ALGOS, BUILDER_SECTIONS, RUN_DEFAULTS
from moe_rl.core.settings import MOE_DEFAULTS

MODEL_FIELDS = ("algo", "env", "env_config", "moe", "deepspeed.enabled", "deepspeed.config", "learners.num_learners")


def _plain_yaml(v):
    return yaml.safe_load(yaml.safe_dump(v))


def _flat(value, prefix: str) -> Dict[str, Any]:
    if isinstance(value, dict) and value:
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}"))
        return out
    return {prefix: value}


def model_fields(resolved_config: Dict[str, Any]) -> Dict[str, Any]:
    """The fields of a resolved run config that define the model and the checkpoint layout."""
    out = {}
    for field in MODEL_FIELDS:
        node = resolved_config
        for part in field.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out.update(_flat(_plain_yaml(node), field))
    return out


def model_conflicts(saved: Dict[str, Any], new: Dict[str, Any]) -> List[Tuple[str, Any, Any]]:
    """(field, saved value, new value) for every model field that differs. A `moe` key the saved
    config lacks (a run from before the key existed, e.g. moe.positions) counts as its default
    (where such runs ran with something else, reading config.yaml filled it in: saved_run_config)."""
    if isinstance(saved.get("moe"), dict):
        saved = {**saved, "moe": {**MOE_DEFAULTS, **saved["moe"]}}
    saved, new = ({"algo": RUN_DEFAULTS["algo"], **c} for c in (saved, new))   # runs from before `algo:`
    a, b = model_fields(saved), model_fields(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


class _DeprecationLog(logging.Handler):
    """Catches (and keeps off the console) RLlib's deprecation notices while a key is tried."""

    def __init__(self):
        super().__init__()
        self.deprecated = False
        self._logger = logging.getLogger("ray._common.deprecation")   # RLlib's deprecation_warning

    def emit(self, record) -> None:
        self.deprecated |= "DeprecationWarning" in record.getMessage()

    def __enter__(self):
        self._propagate, self._logger.propagate = self._logger.propagate, False
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self)
        self._logger.propagate = self._propagate


def resume_config(saved: Dict[str, Any]) -> Dict[str, Any]:
    """RUN_DIR/config.yaml as a run config again. It lists every resolved builder key, some of
    which RLlib refuses to be given (deprecated aliases, whatever their value): those are dropped."""
    cfg = copy.deepcopy(saved)
    cfg.pop("ray_address", None)
    # A bad one: validate_run_config names it.
    config_class = ALGOS.get(cfg.get("algo", RUN_DEFAULTS["algo"]), ALGOS[RUN_DEFAULTS["algo"]])
    for section in BUILDER_SECTIONS:
        if not isinstance(cfg.get(section) or {}, dict):
            continue   # validate_run_config names it
        kept = {}
        for k, v in (cfg.get(section) or {}).items():
            with _DeprecationLog() as log:
                try:
                    getattr(config_class(), section)(**{k: v})
                except (ValueError, TypeError, DeprecationWarning):
                    continue
            if not log.deprecated:   # an alias RLlib accepts with a warning: it lives in another section
                kept[k] = v
        cfg[section] = kept
    ds, moe = cfg.get("deepspeed") or {}, cfg.get("moe") or {}
    sections = isinstance(ds, dict) and isinstance(moe, dict)
    if sections and ds.get("enabled") == (moe.get("ep_size", 1) > 1 or bool(ds.get("config"))):
        ds["enabled"] = None  # resolved from the default (auto): a changed layout is reported as such
    return cfg
