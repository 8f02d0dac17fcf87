"""Is this run the user's own? An HMAC over a checkpoint's manifest, under a key only the user reads.

The sha256 manifest catches damage, not tampering: whoever edits a file can rewrite its line. The
manifest (every file's digest, and the run's config.yaml digest) is signed with HMAC-SHA256 under a
key kept in the user's config directory, so a run written by this user, with this key, verifies,
and a run from elsewhere, or one whose files or config.yaml were edited, does not. `moe-rl train
--resume` unpickles RLlib's state and DeepSpeed's files only from a private copy whose bytes were
checked against a manifest signed this way (moe_rl/app/verified_copy.py).

The key is refused unless it is at least 32 bytes, a regular file (not a symlink), owned by the
user and readable by no one else: a short key (an empty one above all) lets anyone forge a
signature, and a key others can read or replace signs for them too.

Every signature is over a tagged message (RUN_FORMAT), so a manifest's signature never passes for
a config.yaml's, and runs signed before the tags existed (format 1) are named as such.

Standard library only (the guardian and checkpoint_integrity use no torch or Ray).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from typing import Any, Dict, Optional, Tuple

from moe_rl.core.errors import ConfigError

KEY_NAME = "run_key"
KEY_BYTES = 32
FIELD = "hmac_sha256"
RUN_FORMAT = 2                       # format 1: untagged messages (moe-rl before the fault suite of issue 62)
_MANIFEST_TAG = b"moe-rl checkpoint manifest v2\n"
_FILE_TAG = b"moe-rl signed file v2\n"
_FILE_PREFIX = b"v2:"                # in PATH.hmac, before the hex digest
MAX_SIGNED_FILE_BYTES = 1 << 20      # config.yaml (run_config.MAX_CONFIG_BYTES)


class RunKeyError(ConfigError):
    """The user's run key cannot be trusted; str() is one line saying how to fix it."""


def key_path() -> str:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "moe-rl", KEY_NAME)


def _read_key(path: str) -> Optional[bytes]:
    """The key's bytes, or None if there is no key yet; RunKeyError if it is not safe to use."""
    fix = f"run key {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if os.path.islink(path):
            raise RunKeyError(f"{fix} is a symlink: replace it with the key file itself (mode 0600)") from None
        raise RunKeyError(f"{fix} cannot be read ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RunKeyError(f"{fix} is not a regular file: remove it and moe-rl makes a new key")
        if st.st_uid != os.getuid():
            raise RunKeyError(f"{fix} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}): remove it "
                              "and moe-rl makes a new key")
        if st.st_mode & 0o077:
            raise RunKeyError(f"{fix} has mode {stat.S_IMODE(st.st_mode):04o}, others may read it: "
                              f"chmod 600 {path} (and make a new key if someone may have read it)")
        key = os.read(fd, 4096)
    finally:
        os.close(fd)
    if len(key) < KEY_BYTES:
        raise RunKeyError(f"{fix} is {len(key)} bytes, at least {KEY_BYTES} are needed (a short key lets anyone "
                          "forge a signature): remove it and moe-rl makes a new one")
    return key


def check_user_key() -> None:
    """RunKeyError if the key is there and unsafe; makes nothing (a --dry-run asks too)."""
    _read_key(key_path())


def user_key() -> bytes:
    """The user's key, made on first use: written whole under a temporary name, then linked into
    place (so two processes racing to make it agree on one key, and nobody reads half a key)."""
    path = key_path()
    key = _read_key(path)
    if key is not None:
        return key
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(KEY_BYTES))
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    key = _read_key(path)
    if key is None:
        raise RunKeyError(f"run key {path} vanished while it was made")
    return key


def _canonical(manifest: Dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != FIELD}
    return _MANIFEST_TAG + json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


def sign(manifest: Dict[str, Any]) -> str:
    return hmac.new(user_key(), _canonical(manifest), hashlib.sha256).hexdigest()


def is_signed_by_user(manifest: Dict[str, Any]) -> bool:
    given = manifest.get(FIELD)
    return (isinstance(given, str) and manifest.get("format") == RUN_FORMAT
            and hmac.compare_digest(given.encode(), sign(manifest).encode()))


def unsigned_reason(manifest: Any, name: str) -> str:
    """Why a checkpoint's manifest is not the user's own, in words (for the one-line refusal)."""
    if isinstance(manifest, dict) and manifest.get(FIELD) and manifest.get("format") != RUN_FORMAT:
        return (f"checkpoint {name} was signed by an older moe-rl (run format {manifest.get('format')!r}, "
                f"now {RUN_FORMAT})")
    return f"checkpoint {name} is not signed with your key ({key_path()})"


def signature_path(path: str) -> str:
    return path + ".hmac"


def sign_bytes(data: bytes) -> bytes:
    """The HMAC of a file's bytes, for its PATH.hmac beside it (config.yaml: rewritten on every resume)."""
    return _FILE_PREFIX + hmac.new(user_key(), _FILE_TAG + data, hashlib.sha256).hexdigest().encode()


def read_bounded(path: str, limit: int, what: str) -> bytes:
    """A regular file's bytes, at most `limit` (OSError naming `what` and the limit otherwise): a
    FIFO, a device or a file that grows without end is refused, never waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{what} {path!r} is not a regular file")
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise OSError(f"{what} {path!r} is larger than {limit} bytes (the limit)")
    finally:
        os.close(fd)
    return b"".join(chunks)


def read_signed_file(path: str) -> Tuple[bytes, Optional[str]]:
    """A signed file's bytes, read once, and why they are not signed with the user's key (None
    when they are). Parse the bytes returned, never the file again: what was checked is what is used."""
    data = read_bounded(path, MAX_SIGNED_FILE_BYTES, os.path.basename(path))
    try:
        given = read_bounded(signature_path(path), 256, os.path.basename(signature_path(path))).strip()
    except OSError:
        return data, f"its {os.path.basename(path)} is not signed with your key ({key_path()})"
    if not given.startswith(_FILE_PREFIX):
        return data, (f"its {os.path.basename(path)} was signed by an older moe-rl (run format 1, now "
                      f"{RUN_FORMAT})")
    if not hmac.compare_digest(given, sign_bytes(data)):
        return data, f"its {os.path.basename(path)} is not signed with your key ({key_path()})"
    return data, None


def is_signed_file(path: str) -> bool:
    try:
        return read_signed_file(path)[1] is None
    except OSError:
        return False


def _checkpoint_manifests(run_dir: str):
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "manifest.json")
        if name.startswith("iter_") and os.path.isfile(path):
            yield name, path


MAX_MANIFEST_BYTES = 4 << 20


def read_manifest_bytes(path: str) -> Dict[str, Any]:
    """A manifest.json, bounded (MAX_MANIFEST_BYTES) and parsed; OSError or ValueError otherwise."""
    try:
        manifest = json.loads(read_bounded(path, MAX_MANIFEST_BYTES, "manifest.json"))
    except RecursionError:
        raise ValueError("manifest.json nests too deeply") from None
    if not isinstance(manifest, dict):
        raise ValueError("manifest.json is not a mapping")
    return manifest


def not_users_own(run_dir: str) -> Optional[str]:
    """Why RUN_DIR is not provably this user's own run (its config.yaml, or a checkpoint's manifest,
    not signed with the user's key), or None if it is. Reads JSON and bytes only."""
    config_yaml = os.path.join(run_dir, "config.yaml")
    if os.path.lexists(config_yaml):
        try:
            reason = read_signed_file(config_yaml)[1]
        except OSError as e:
            reason = f"its config.yaml cannot be read ({e.strerror or e})"
        if reason:
            return reason
    for name, path in _checkpoint_manifests(run_dir):
        try:
            manifest = read_manifest_bytes(path)
        except (OSError, ValueError):
            continue   # unreadable: verify_checkpoint reports it and skips the checkpoint
        if not is_signed_by_user(manifest):
            return unsigned_reason(manifest, name)
    return None
