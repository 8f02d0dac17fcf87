"""A console with moe-rl's own lines and real warnings only.

Our own causes are fixed where they arise (a read-only NumPy array handed to torch is copied
first). What dependencies print on every healthy run is dropped here, message by message: each
entry of NOISE names the logger (or, for Ray's C++ core worker, the raw stderr line) and the
message, so anything else — a new warning, a real error — still shows. `moe-rl -v` shows all.

Standard library only: the run's guardian process (moe_rl/app/guardian.py) filters the trainer's
stderr with RAW_NOISE without importing torch or Ray.
"""
from __future__ import annotations

import logging
import re
from typing import Dict, List, Pattern

# Python loggers: {logger name: [message patterns]}; a record matches from the message's start.
NOISE: Dict[str, List[str]] = {
    # DeepSpeed on a machine without GPUs, at import (so on every command, `moe-rl --help` too)
    "DeepSpeed": [r"Setting accelerator to CPU\."],
    # RLlib: MoEPPO runs on the new API stack by design
    "ray.rllib.algorithms.algorithm_config": [r"You are running \w+ on the new API stack!"],
    # RLlib's RLModule.__init__ builds the deprecated RLModuleConfig itself (we pass keywords)
    "ray._common.deprecation": [r"DeprecationWarning: `RLModule\(config=\[RLModuleConfig object\]\)`"],
    # Tune's system monitor on a CPU-only machine; Trainable's slow-setup hint (about Tune's actor reuse)
    "ray.tune.utils.util": [r"Install gputil for GPU system monitoring\."],
    "ray.tune.trainable.trainable": [r"Trainable\.setup took [\d.]+ seconds\."],
}

# Raw stderr lines (Ray's C++ core worker logs straight to the driver's stderr).
RAW_NOISE: List[str] = [
    # RLlib creates its EnvRunners with max_restarts > 0 and a config too large to pass inline
    r"\[[^\]]*\] core_worker\.cc:\d+: Actor with class name: '\w+' and ID: '\w+' has constructor arguments "
    r"in the object store and max_restarts > 0\.",
]

_RAW = [re.compile(p) for p in RAW_NOISE]


def is_raw_noise(line: str) -> bool:
    return any(p.match(line) for p in _RAW)


class NamedNoise(logging.Filter):
    """Drops a logger's records whose message starts with one of the named patterns."""

    def __init__(self, patterns: List[str]):
        super().__init__()
        self.patterns: List[Pattern] = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to hide
            return True
        return not any(p.match(message) for p in self.patterns)


_installed: Dict[str, NamedNoise] = {}


def quiet() -> None:
    """Attach the filters (idempotent). Call before DeepSpeed and Ray are imported: their
    loggers may speak at import time. A logger's filter sees the records logged on that logger,
    whatever handler Ray or DeepSpeed give it later."""
    for name, patterns in NOISE.items():
        if name not in _installed:
            _installed[name] = NamedNoise(patterns)
            logging.getLogger(name).addFilter(_installed[name])


def also_drop(table: Dict[str, List[str]]) -> None:
    """More named loggers' notices (moe_rl.rllib.ray_private names Ray's private ones), if quiet."""
    if is_quiet():
        NOISE.update({k: v for k, v in table.items() if k not in NOISE})
        quiet()


def is_quiet() -> bool:
    return bool(_installed)


def verbose() -> None:
    """`-v`: show everything again."""
    for name, f in _installed.items():
        logging.getLogger(name).removeFilter(f)
    _installed.clear()


def quiet_worker() -> None:
    """Ray's worker_process_setup_hook: the same filters in every actor, whose output reaches the
    driver's console when it is connected to a cluster (log_to_driver)."""
    quiet()
