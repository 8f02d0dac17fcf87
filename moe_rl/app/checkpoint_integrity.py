"""Is a checkpoint complete and unaltered? Names, digests and the manifest check, in the standard
library only: the run's watchdog (moe_rl/app/watchdog.py) uses it after the trainer has died,
without importing torch or Ray.

    verify_checkpoint(path)          re-hash every file of the manifest; CheckpointError names the file
    latest_good_checkpoint(run_dir)  newest checkpoint that verifies (bad ones are reported, skipped)
    newest_checkpoint(run_dir)       newest iter_* by name, unverified (for a message that must be quick)
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from typing import Any, Dict, List, Optional, Tuple

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
CORRUPT_PREFIX = "corrupt-"
FORMAT = 1
_NAME = re.compile(r"^iter_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that fails verification; str() is one line naming the checkpoint and file."""


def checkpoint_name(iteration: int) -> str:
    return f"iter_{int(iteration):06d}"


def checkpoint_iteration(name: str) -> int:
    return int(_NAME.match(name).group(1))


def checkpoint_names(checkpoints_dir: str) -> List[str]:
    """iter_NNNNNN directory names, oldest first."""
    if not os.path.isdir(checkpoints_dir):
        return []
    names = [n for n in os.listdir(checkpoints_dir) if _NAME.match(n)
             and os.path.isdir(os.path.join(checkpoints_dir, n))]
    return sorted(names, key=checkpoint_iteration)


def files_of(root: str) -> List[str]:
    out = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            out.append(os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/"))
    return sorted(out)


def digest(path: str) -> Tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def verify_checkpoint(path: str) -> Dict[str, Any]:
    """Re-hash every file the manifest lists; a missing, truncated, altered or unlisted file is a
    CheckpointError naming it. Returns the manifest."""
    name = os.path.basename(os.path.normpath(path))

    def bad(what: str):
        raise CheckpointError(f"checkpoint {name} is corrupt: {what}")

    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        files = manifest["files"]
        int(manifest["iteration"])
        if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
            raise TypeError
    except FileNotFoundError:
        bad(f"{MANIFEST} missing (an incomplete or pre-manifest checkpoint)")
    except (OSError, ValueError, KeyError, TypeError):
        bad(f"{MANIFEST} unreadable")
    present = set(files_of(path)) - {MANIFEST}
    for rel in sorted(files):
        if rel not in present:
            bad(f"{rel} missing")
        sha, size = digest(os.path.join(path, rel))
        if size != files[rel].get("size"):
            bad(f"{rel} is {size} bytes, the manifest says {files[rel].get('size')} (truncated or altered)")
        if sha != files[rel].get("sha256"):
            bad(f"{rel} sha256 mismatch")
    extra = sorted(present - set(files))
    if extra:
        bad(f"{extra[0]} is not in the manifest")
    return manifest


def latest_good_checkpoint(run_dir: str, log=None) -> Optional[str]:
    """The newest RUN_DIR/checkpoints/iter_* that verifies; each bad one is reported and skipped."""
    root = os.path.join(run_dir, "checkpoints")
    for name in reversed(checkpoint_names(root)):
        path = os.path.join(root, name)
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            (log or (lambda m: print(m, file=sys.stderr, flush=True)))(f"moe-rl: {e}; skipping it")
    return None


def newest_checkpoint(run_dir: str) -> Optional[str]:
    names = checkpoint_names(os.path.join(run_dir, "checkpoints"))
    return os.path.join(run_dir, "checkpoints", names[-1]) if names else None
