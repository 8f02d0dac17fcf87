"""The run directory: config.yaml, metrics.parquet (columns: moe_rl.algo.results), drift.parquet,
alerts.parquet, checkpoints/, tb/ (TensorBoard events), mirrored to a storage URI if asked.

A run writes only where nothing of anyone else's can be lost: a new or empty directory, or one
that holds moe-rl's marker (.moe-rl-run: a run directory of its own), never a system path or the
home directory (check_output; UnusableOutput names what is there, and nothing is touched). While
it writes, it holds the directory's lock (run_lock: a second writer exits 2 naming the PID)."""
from __future__ import annotations

import math
import os
import tempfile
from typing import Any, Dict, List, Optional

import yaml
from pyarrow import fs
from tensorboardX import SummaryWriter

from moe_rl.algo.results import atomic_write_bytes, read_rows, write_table
from moe_rl.app.run_lock import LOCK_NAME, RunLock, check_not_busy
from moe_rl.app.run_signature import is_signed_file, sign_bytes, signature_path
from moe_rl.core.errors import ConfigError

INCOMPLETE = "INCOMPLETE"
MARKER = ".moe-rl-run"
# Never a run directory: the root, the home directory, the top of the system's own trees, and
# anything inside the trees the system itself lives in.
SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/media", "/mnt", "/opt",
               "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var", "/var/tmp")
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/sbin", "/sys", "/usr")


class UnusableOutput(ConfigError):
    """An output directory a run may not write; str() is one line naming what is there."""


def check_output(path: str, resume: bool = False, flag: str = "--output", check_busy: bool = True) -> None:
    """Refuse a run directory that is a system path or the home directory, that a live run writes,
    or (unless resumed: --resume checks its own config.yaml and signature) that holds anything but
    moe-rl's own run: it must be new, empty, or carry the MARKER. Reads only."""
    if is_uri(path):
        return
    real = os.path.realpath(path)
    home = os.path.realpath(os.path.expanduser("~"))
    if real in SYSTEM_DIRS or real == home or any(real.startswith(t + "/") for t in SYSTEM_TREES):
        what = "your home directory" if real == home else "a system directory"
        raise UnusableOutput(f"{flag}: {path!r} is {what}; a run needs a directory of its own (e.g. runs/NAME)")
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise UnusableOutput(f"{flag}: {path!r} exists and is not a directory; choose a new or empty directory")
    if check_busy:
        check_not_busy(path)
    if resume:
        return
    try:
        entries = sorted(set(os.listdir(path)) - {LOCK_NAME})
    except OSError as e:
        raise UnusableOutput(f"{flag}: {path!r} cannot be read ({e.strerror})") from None
    own = os.path.isfile(os.path.join(path, MARKER)) or is_signed_file(os.path.join(path, "config.yaml"))
    if entries and not own:   # (a signed config.yaml: the user's run from before the marker)
        more = f" and {len(entries) - 3} more" if len(entries) > 3 else ""
        shown = ", ".join(repr(e[:60]) for e in entries[:3]) + more
        raise UnusableOutput(f"{flag}: {path!r} is not empty and not a moe-rl run directory (it holds {shown}); "
                             "choose a new or empty directory (nothing was written)")


def is_uri(path: str) -> bool:
    return "://" in path


class Mirror:
    """Copies a local run directory to a pyarrow filesystem URI (s3://, gs://, hdfs://, file://...)
    incrementally: files whose size or mtime changed go up, files deleted locally (pruned
    checkpoints) are deleted there. The run writes locally (atomic renames, Parquet, DeepSpeed) and
    the storage path is a copy that trails it by at most one iteration."""

    def __init__(self, uri: str):
        try:
            self.fs, self.root = fs.FileSystem.from_uri(uri)
            self.fs.create_dir(self.root, recursive=True)
        except (OSError, ValueError) as e:  # pyarrow.ArrowInvalid is a ValueError
            raise OSError(f"output: cannot use the storage URI {uri!r}: {str(e).splitlines()[0]}") from None
        self.uri = uri
        self._sent: Dict[str, tuple] = {}

    def sync(self, local_root: str) -> None:
        seen = set()
        for dirpath, dirnames, filenames in os.walk(local_root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".tmp-")]   # unfinished checkpoints
            for name in filenames:
                if name.startswith(".tmp-") or name == LOCK_NAME:   # the lock is this host's, not the run's
                    continue
                local = os.path.join(dirpath, name)
                rel = os.path.relpath(local, local_root).replace(os.sep, "/")
                st = os.stat(local)
                seen.add(rel)
                if self._sent.get(rel) == (st.st_size, st.st_mtime_ns):
                    continue
                target = f"{self.root}/{rel}"
                self.fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
                fs.copy_files(local, target, destination_filesystem=self.fs)
                self._sent[rel] = (st.st_size, st.st_mtime_ns)
        gone = sorted(set(self._sent) - seen)
        for rel in gone:
            self.fs.delete_file(f"{self.root}/{rel}")
            del self._sent[rel]
        # A pruned (or quarantined) checkpoint goes as a whole directory, not as empty folders.
        for top in sorted({"/".join(rel.split("/")[:2]) for rel in gone if rel.startswith("checkpoints/")}):
            if not os.path.exists(os.path.join(local_root, top)):
                self.fs.delete_dir(f"{self.root}/{top}")


class RunDir:
    """Owns one run directory. Created up front so an unwritable output fails before training.

    `path` may be a pyarrow filesystem URI: the run then writes to a local staging directory
    (`staging`, default a new temporary directory) and `sync()` mirrors it to the URI."""

    def __init__(self, path: str, resolved_config: Dict[str, Any], staging: Optional[str] = None,
                 resume: bool = False):
        self.mirror = None
        if is_uri(path):
            self.mirror = Mirror(path)
            path = staging or tempfile.mkdtemp(prefix="moe-rl-run-")
        self.path = os.path.abspath(path)
        check_output(self.path, resume)
        try:
            os.makedirs(self.path, exist_ok=True)
            self.lock = RunLock(self.path)
        except OSError as e:
            raise OSError(f"output: cannot write the run directory {self.path!r}: {e.strerror or e}") from None
        try:
            check_output(self.path, resume, check_busy=False)   # again, under the lock: the first look may be stale
            marker = os.path.join(self.path, MARKER)
            if not os.path.isfile(marker):
                atomic_write_bytes(marker, b"moe-rl run directory: moe-rl train writes here (--output, --resume)\n")
            os.makedirs(os.path.join(self.path, "checkpoints"), exist_ok=True)
            config_yaml = os.path.join(self.path, "config.yaml")
            text = yaml.safe_dump(resolved_config, sort_keys=False).encode()
            atomic_write_bytes(config_yaml, text)
            atomic_write_bytes(signature_path(config_yaml), sign_bytes(text))
        except OSError as e:
            self.lock.release()
            raise OSError(f"output: cannot write the run directory {self.path!r}: {e.strerror or e}") from None
        except BaseException:
            self.lock.release()
            raise
        self.rows: List[Dict[str, Any]] = []        # metrics.parquet
        self.drift: List[Dict[str, Any]] = []       # drift.parquet: the sync gate's ledger
        self.alerts: List[Dict[str, Any]] = []      # alerts.parquet
        self.resolved_config = resolved_config
        self._tb = None

    @property
    def checkpoints(self) -> str:
        return os.path.join(self.path, "checkpoints")

    @property
    def location(self) -> str:
        """Where the run lands: the storage URI, or the local directory."""
        return self.mirror.uri if self.mirror else self.path

    def sync(self) -> None:
        if self.mirror is not None:
            self.mirror.sync(self.path)

    def log(self, row: Dict[str, Any], drift=(), alerts=()) -> None:
        """One iteration: its metrics row, and the ledger rows and alerts it produced."""
        self.rows.append(row)
        write_table(os.path.join(self.path, "metrics.parquet"), self.rows)
        for name, table, new in (("drift.parquet", self.drift, drift), ("alerts.parquet", self.alerts, alerts)):
            path = os.path.join(self.path, name)
            if new or (name == "alerts.parquet" and not os.path.exists(path)):   # "no alerts", not "none recorded"
                table.extend(new)
                write_table(path, table)
        self._tensorboard(row)

    def amend_last(self, extra: Dict[str, Any]) -> None:
        """Add figures known only after the row was logged (checkpoint verification)."""
        if extra and self.rows:
            self.rows[-1].update(extra)
            write_table(os.path.join(self.path, "metrics.parquet"), self.rows)
            self._tensorboard({"iteration": self.rows[-1]["iteration"], **extra})

    def continue_from(self, iteration: int) -> None:
        """Continue every table from a checkpoint: rows after `iteration` are dropped (they are
        trained again), so no table ever holds an iteration twice."""
        self.rows = truncate_table(os.path.join(self.path, "metrics.parquet"), iteration, self.rows or None)
        self.drift = truncate_table(os.path.join(self.path, "drift.parquet"), iteration, self.drift or None)
        self.alerts = truncate_table(os.path.join(self.path, "alerts.parquet"), iteration, self.alerts or None)

    def _tensorboard(self, row: Dict[str, Any]) -> None:
        if self._tb is None:
            self._tb = SummaryWriter(os.path.join(self.path, "tb"))
        step = row["iteration"]
        for k, v in row.items():
            if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                self._tb.add_scalar(k, v, step)
        self._tb.flush()

    def mark_incomplete(self, reason: str) -> None:
        """The run stopped before its end (never started, Ctrl-C, SIGTERM, a lost cluster, an
        error): RUN_DIR/INCOMPLETE says why, and which checkpoint --resume continues from."""
        atomic_write_bytes(os.path.join(self.path, INCOMPLETE), (reason.rstrip() + "\n").encode())
        self.sync()

    def clear_incomplete(self) -> None:
        """A resumed run that reached its end is no longer incomplete."""
        if os.path.exists(os.path.join(self.path, INCOMPLETE)):
            os.remove(os.path.join(self.path, INCOMPLETE))
            self.sync()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()

    def release(self) -> None:
        """Another run may write the directory now (the process's end releases it too)."""
        self.lock.release()


def truncate_table(path: str, iteration: int, rows: Optional[List[Dict[str, Any]]] = None) -> List[Dict[str, Any]]:
    """The rows of a per-iteration table (`rows`, or read from `path`) up to `iteration`, rewritten."""
    if rows is None:
        rows = read_rows(path) if os.path.isfile(path) else []
    rows = [r for r in rows if r.get("iteration") is not None and r["iteration"] <= iteration]
    if rows or os.path.isfile(path):
        write_table(path, rows)
    return rows
