"""Is a checkpoint complete and unaltered? Names, digests and the manifest check, in the standard
library only: the run's guardian (moe_rl/app/guardian.py) uses it after the trainer has died,
without importing torch or Ray.

    verify_checkpoint(path)          re-hash every file of the manifest; CheckpointError names the file
    latest_good_checkpoint(run_dir)  newest checkpoint that verifies (bad ones are reported, skipped)
    newest_checkpoint(run_dir)       newest iter_* by name, unverified (for a message that must be quick)
    CheckpointTree(path)             the checkpoint opened once: its manifest, its entries, its files'
                                     bytes (moe_rl/app/verified_copy.py loads through it)

Every entry under a checkpoint is accounted for, and none is followed: a symlink, a device, a FIFO,
a socket, a file with a second hard link or a directory on another filesystem is never damage
(a writer never makes one) but someone's doing, so it is CheckpointRefused (the command stops, it
does not fall back to an older checkpoint). Files are opened below the checkpoint's own directory
descriptor with O_NOFOLLOW at every step, and no read goes past the size the manifest lists.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import sys
from typing import Any, Dict, List, Optional, Tuple

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
CORRUPT_PREFIX = "corrupt-"
FORMAT = 2                          # = run_signature.RUN_FORMAT; format 1 manifests still verify here
MAX_MANIFEST_BYTES = 4 << 20
_NAME = re.compile(r"^iter_(\d+)$")
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW


class CheckpointError(RuntimeError):
    """A checkpoint that fails verification; str() is one line naming the checkpoint and file."""


class CheckpointRefused(CheckpointError):
    """A checkpoint holding what no writer makes (a symlink, a device, a FIFO, a hard link, a path
    outside it): refused, never skipped for an older one."""


def checkpoint_name(iteration: int) -> str:
    return f"iter_{int(iteration):06d}"


def checkpoint_iteration(name: str) -> int:
    return int(_NAME.match(name).group(1))


def checkpoint_names(checkpoints_dir: str) -> List[str]:
    """iter_NNNNNN directory names (symlinks too: verification refuses them), oldest first."""
    if not os.path.isdir(checkpoints_dir):
        return []
    names = [n for n in os.listdir(checkpoints_dir) if _NAME.match(n)
             and os.path.isdir(os.path.join(checkpoints_dir, n))]
    return sorted(names, key=checkpoint_iteration)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _rel_parts(rel: str) -> List[str]:
    """A manifest path's components; ValueError for one that leaves the checkpoint."""
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") or "\0" in p for p in parts):
        raise ValueError(rel)
    return parts


class CheckpointTree:
    """A checkpoint directory opened once (O_NOFOLLOW); every later open goes below that descriptor,
    so a directory swapped for a symlink after the check leads nowhere. Use as a context manager."""

    def __init__(self, path: str):
        self.path, self.name = path, os.path.basename(os.path.normpath(path))
        try:
            self.fd = os.open(path, _DIR)
        except OSError as e:
            if os.path.islink(path):
                raise CheckpointRefused(f"checkpoint {self.name} is a symlink: refused") from None
            raise CheckpointError(f"checkpoint {self.name} cannot be opened ({e.strerror})") from None
        self.dev = os.fstat(self.fd).st_dev

    def __enter__(self) -> "CheckpointTree":
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def bad(self, what: str, refused: bool = False):
        raise (CheckpointRefused if refused else CheckpointError)(f"checkpoint {self.name} is corrupt: {what}")

    # --- what is there ------------------------------------------------------------------------
    def entries(self) -> Tuple[List[str], List[str]]:
        """(files, directories), relative and '/'-separated, sorted; CheckpointRefused for any
        entry that is not a directory or a regular file with one link on this filesystem."""
        files: List[str] = []
        dirs: List[str] = []
        self._walk(self.fd, "", files, dirs)
        return sorted(files), sorted(dirs)

    def _walk(self, dir_fd: int, prefix: str, files: List[str], dirs: List[str]) -> None:
        with os.scandir(dir_fd) as it:
            listing = [(e.name, e.stat(follow_symlinks=False)) for e in it]
        for name, st in listing:
            rel = prefix + name
            if st.st_dev != self.dev:
                self.bad(f"{rel} is on another filesystem (a mount inside the checkpoint): refused", True)
            if stat.S_ISDIR(st.st_mode):
                fd = self._open(dir_fd, name, _DIR, rel)
                try:
                    if os.fstat(fd).st_ino != st.st_ino:
                        self.bad(f"{rel} changed while it was read: refused", True)
                    dirs.append(rel)
                    self._walk(fd, rel + "/", files, dirs)
                finally:
                    os.close(fd)
            elif stat.S_ISREG(st.st_mode):
                if st.st_nlink != 1:
                    self.bad(f"{rel} has {st.st_nlink} hard links (a file shared with another place): refused", True)
                files.append(rel)
            else:
                self.bad(f"{rel} is {_kind(st.st_mode)}: refused (a checkpoint holds regular files and "
                         "directories only, and none is followed)", True)

    def _open(self, dir_fd: int, name: str, flags: int, rel: str) -> int:
        try:
            return os.open(name, flags, dir_fd=dir_fd)
        except FileNotFoundError:
            self.bad(f"{rel} missing")
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                self.bad(f"{rel} is a symlink or not what it was: refused", True)
            self.bad(f"{rel} cannot be opened ({e.strerror})")

    def open_file(self, rel: str) -> Tuple[int, os.stat_result]:
        """(fd, stat) of a regular file below the checkpoint, every component opened with O_NOFOLLOW."""
        try:
            parts = _rel_parts(rel)
        except ValueError:
            self.bad(f"{MANIFEST} lists {rel!r}, a path outside the checkpoint: refused", True)
        dir_fd = self.fd
        opened = []
        try:
            for i, part in enumerate(parts[:-1]):
                dir_fd = self._open(dir_fd, part, _DIR, "/".join(parts[:i + 1]))
                opened.append(dir_fd)
            fd = self._open(dir_fd, parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, rel)
        finally:
            for d in opened:
                os.close(d)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_dev != self.dev:
            os.close(fd)
            self.bad(f"{rel} is {_kind(st.st_mode) if not stat.S_ISREG(st.st_mode) else 'linked elsewhere'}: "
                     "refused", True)
        return fd, st

    # --- the manifest and the files it lists ----------------------------------------------------
    def manifest_bytes(self) -> bytes:
        try:
            fd, st = self.open_file(MANIFEST)
        except CheckpointRefused:
            raise
        except CheckpointError:
            self.bad(f"{MANIFEST} missing (an incomplete or pre-manifest checkpoint)")
        try:
            if st.st_size > MAX_MANIFEST_BYTES:
                self.bad(f"{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes (the limit)")
            return _read_exactly(fd, st.st_size)
        finally:
            os.close(fd)

    def manifest(self, data: Optional[bytes] = None) -> Dict[str, Any]:
        """The manifest parsed from `data` (its bytes as read once) and checked for shape."""
        try:
            manifest = json.loads(self.manifest_bytes() if data is None else data)
            files = manifest["files"]
            int(manifest["iteration"])
            if not isinstance(files, dict) or not all(
                    isinstance(v, dict) and isinstance(v.get("size"), int) and v["size"] >= 0
                    and isinstance(v.get("sha256"), str) for v in files.values()):
                raise TypeError
        except (ValueError, KeyError, TypeError, RecursionError):
            self.bad(f"{MANIFEST} unreadable")
        for rel in files:
            try:
                _rel_parts(rel)
            except ValueError:
                self.bad(f"{MANIFEST} lists {rel!r}, a path outside the checkpoint: refused", True)
        if _NAME.match(self.name) and int(manifest["iteration"]) != checkpoint_iteration(self.name):
            self.bad(f"{MANIFEST} is iteration {manifest['iteration']}'s, not {checkpoint_iteration(self.name)}'s")
        return manifest

    def check_listing(self, manifest: Dict[str, Any]) -> None:
        """Every entry is the manifest, a listed file or a directory some listed file is in, and
        every listed file is there."""
        files, dirs = self.entries()
        listed = manifest["files"]
        present = set(files) - {MANIFEST}
        for rel in sorted(listed):
            if rel not in present:
                self.bad(f"{rel} missing")
        extra = sorted(present - set(listed))
        if extra:
            self.bad(f"{extra[0]} is not in the manifest")
        holding = {"/".join(rel.split("/")[:i]) for rel in listed for i in range(1, rel.count("/") + 1)}
        empty = sorted(set(dirs) - holding)
        if empty:
            self.bad(f"{empty[0]}/ is not in the manifest (a directory no listed file is in)")

    def read_listed(self, rel: str, entry: Dict[str, Any], sink=None) -> str:
        """Hash a listed file (and hand each chunk to `sink`), reading no more than its listed size;
        CheckpointError when its size or digest differs. Returns the digest."""
        fd, st = self.open_file(rel)
        try:
            if st.st_size != entry["size"]:
                self.bad(f"{rel} is {st.st_size} bytes, the manifest says {entry['size']} (truncated or altered)")
            h, left = hashlib.sha256(), entry["size"]
            while left:
                chunk = os.read(fd, min(1 << 20, left))
                if not chunk:
                    self.bad(f"{rel} ended before the {entry['size']} bytes the manifest lists (truncated)")
                h.update(chunk)
                if sink is not None:
                    sink(chunk)
                left -= len(chunk)
            if os.read(fd, 1):
                self.bad(f"{rel} grew while it was read (altered)")
        finally:
            os.close(fd)
        if h.hexdigest() != entry["sha256"]:
            self.bad(f"{rel} sha256 mismatch")
        return h.hexdigest()


def _read_exactly(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(1 << 20, left))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def files_of(root: str) -> List[str]:
    """Every regular file under a checkpoint (relative, '/'-separated); CheckpointRefused for a
    symlink, a device, a FIFO or a hard link (checkpoint.write_manifest lists what it wrote)."""
    with CheckpointTree(root) as tree:
        return tree.entries()[0]


def digest(path: str) -> Tuple[str, int]:
    """sha256 and size of a regular file, opened without following a symlink."""
    h, size = hashlib.sha256(), 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path!r} is not a regular file")
        for chunk in iter(lambda: os.read(fd, 1 << 20), b""):
            h.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return h.hexdigest(), size


def verify_checkpoint(path: str) -> Dict[str, Any]:
    """Re-hash every file the manifest lists; a missing, truncated, altered or unlisted file is a
    CheckpointError naming it, anything that is not a regular file or directory CheckpointRefused.
    Returns the manifest. (Loading goes through verified_copy: these bytes may change afterwards.)"""
    with CheckpointTree(path) as tree:
        manifest = tree.manifest()
        tree.check_listing(manifest)
        for rel in sorted(manifest["files"]):
            tree.read_listed(rel, manifest["files"][rel])
    return manifest


def latest_good_checkpoint(run_dir: str, log=None, refuse: bool = False) -> Optional[str]:
    """The newest RUN_DIR/checkpoints/iter_* that verifies; each bad one is reported and skipped.
    refuse: a CheckpointRefused (someone's doing, not damage) is raised rather than skipped."""
    root = os.path.join(run_dir, "checkpoints")
    for name in reversed(checkpoint_names(root)):
        path = os.path.join(root, name)
        try:
            verify_checkpoint(path)
            return path
        except CheckpointRefused:
            if refuse:
                raise
            (log or (lambda m: print(m, file=sys.stderr, flush=True)))(f"moe-rl: {sys.exc_info()[1]}; skipping it")
        except CheckpointError as e:
            (log or (lambda m: print(m, file=sys.stderr, flush=True)))(f"moe-rl: {e}; skipping it")
    return None


def newest_checkpoint(run_dir: str) -> Optional[str]:
    names = checkpoint_names(os.path.join(run_dir, "checkpoints"))
    return os.path.join(run_dir, "checkpoints", names[-1]) if names else None
