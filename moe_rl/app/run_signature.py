"""Is this run the user's own? An HMAC over a checkpoint's manifest, under a key only the user reads.

The sha256 manifest catches damage, not tampering: whoever edits a file can rewrite its line. The
manifest (every file's digest, and the run's config.yaml digest) is signed with HMAC-SHA256 under a
key kept in the user's config directory (mode 0600), so a run written by this user, with this key,
verifies, and a run from elsewhere, or one whose files or config.yaml were edited, does not.
`moe-rl train --resume` unpickles RLlib's state and DeepSpeed's files only after that check.

Standard library only (the guardian and checkpoint_integrity use no torch or Ray).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from typing import Any, Dict, Optional

KEY_NAME = "run_key"
FIELD = "hmac_sha256"


def key_path() -> str:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "moe-rl", KEY_NAME)


def user_key() -> bytes:
    """The user's key, made on first use: written whole under a temporary name, then linked into
    place (so two processes racing to make it agree on one key, and nobody reads half a key)."""
    path = key_path()
    try:
        with open(path, "rb") as f:
            key = f.read()
        if len(key) >= 32:
            return key
    except FileNotFoundError:
        pass
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    with open(path, "rb") as f:
        return f.read()


def _canonical(manifest: Dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


def sign(manifest: Dict[str, Any]) -> str:
    return hmac.new(user_key(), _canonical(manifest), hashlib.sha256).hexdigest()


def is_signed_by_user(manifest: Dict[str, Any]) -> bool:
    given = manifest.get(FIELD)
    return isinstance(given, str) and hmac.compare_digest(given, sign(manifest))


def signature_path(path: str) -> str:
    return path + ".hmac"


def sign_bytes(data: bytes) -> bytes:
    """The HMAC of a file's bytes, for its PATH.hmac beside it (config.yaml: rewritten on every resume)."""
    return hmac.new(user_key(), data, hashlib.sha256).hexdigest().encode()


def is_signed_file(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            data = f.read()
        with open(signature_path(path), "rb") as f:
            given = f.read().strip()
    except OSError:
        return False
    return hmac.compare_digest(given, sign_bytes(data))


def _checkpoint_manifests(run_dir: str):
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "manifest.json")
        if name.startswith("iter_") and os.path.isfile(path):
            yield name, path


def not_users_own(run_dir: str) -> Optional[str]:
    """Why RUN_DIR is not provably this user's own run (its config.yaml, or a checkpoint's manifest,
    not signed with the user's key), or None if it is. Reads JSON and bytes only."""
    config_yaml = os.path.join(run_dir, "config.yaml")
    if os.path.isfile(config_yaml) and not is_signed_file(config_yaml):
        return f"its config.yaml is not signed with your key ({key_path()})"
    for name, path in _checkpoint_manifests(run_dir):
        try:
            with open(path) as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            continue   # unreadable: verify_checkpoint reports it and skips the checkpoint
        if not isinstance(manifest, dict) or not is_signed_by_user(manifest):
            return f"checkpoint {name} is not signed with your key ({key_path()})"
    return None
