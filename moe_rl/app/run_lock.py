"""One writer per run directory: an OS-level lock that a dead process releases.

Two runs writing one directory (a `--resume` of a run that is still going, or a second `--output`
to it) prune each other's checkpoints and overwrite each other's tables. The writer holds an
exclusive flock(2) on RUN_DIR/.moe-rl.lock for as long as it lives, with its PID in the file; the
kernel drops the lock when the process ends however it ends (a crash, SIGKILL), so a stale lock file
never blocks anyone. A second writer is refused (RunDirBusy: exit 2) naming the live run's PID.
The descriptor is not inherited by children (Ray's processes, the guardian), so the lock lasts
exactly as long as the trainer.
"""
from __future__ import annotations

import fcntl
import os
from typing import Optional

from moe_rl.core.errors import ConfigError

LOCK_NAME = ".moe-rl.lock"


class RunDirBusy(ConfigError):
    """Another live process writes the run directory; str() is one line naming its PID."""


def _busy(path: str, fd: int) -> RunDirBusy:
    try:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    except OSError:
        pid = "unknown"
    return RunDirBusy(f"run directory {path!r} is being written by a live moe-rl run (PID {pid}); wait for it to "
                      f"end, or stop it first (kill -INT {pid})")


def check_not_busy(path: str) -> None:
    """RunDirBusy if a live process holds the lock; creates nothing (an early refusal: the lock
    itself is taken by RunLock when the run starts writing)."""
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return   # no lock file (a new directory, or a run from before the lock): nobody holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(path, fd) from None
    finally:
        os.close(fd)


class RunLock:
    """The exclusive lock on a run directory, held until release() or the process's end."""

    def __init__(self, path: str):
        self.path = path
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            err = _busy(path, fd)
            os.close(fd)
            raise err from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd: Optional[int] = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)   # closing the only descriptor drops the flock
            self.fd = None
