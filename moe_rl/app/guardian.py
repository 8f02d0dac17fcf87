"""The run's guardian: a small process beside `moe-rl train` that outlives a trainer that dies.

When the Ray cluster goes away (the raylet or the GCS killed, the connection to a remote head
lost), Ray's core worker ends the trainer process from C++: no Python handler, `finally` or
atexit runs, so the trainer cannot say what happened or mark its run directory. The guardian can.
The trainer writes progress lines into a pipe only it holds ("running N", "finished N",
"lost raylet died", "done"); the pipe
closing without "done" means the trainer died. The guardian then writes RUN_DIR/INCOMPLETE and
prints one line: what happened, and which checkpoint `moe-rl train --resume RUN_DIR` will use.

The trainer's stderr passes through the guardian too, for two reasons: Ray's dying words arrive
in order before that line, and the named C++ noise lines (console.RAW_NOISE) are dropped. The
guardian runs in a session of its own (a terminal's Ctrl-C is the trainer's to handle) and
imports only the standard library and two stdlib-only moe-rl modules, so it starts in a blink.

    python -m moe_rl.app.guardian RUN_DIR LOCATION CONTROL_FD STDERR_FD
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from moe_rl.app.checkpoint_integrity import latest_good_checkpoint
from moe_rl.app.console import is_raw_noise

DRAIN_S = 2.0   # after the trainer ends: how long the guardian waits for the last stderr lines
RAY_DIED = ("Raylet is terminated", "raylet died", "Failed to connect to GCS", "GCS has been dead",
            "Failed to get the address of the GCS", "RpcError", "connection to the Ray cluster")


class Guardian:
    """Trainer side: start the guardian, route fd 2 through it, report progress, finish."""

    def __init__(self, run_dir: str, location: str):
        ctl_r, self._ctl = os.pipe()
        err_r, err_w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_rl.app.guardian", run_dir, location, str(ctl_r), str(err_r)],
            pass_fds=(ctl_r, err_r), stdin=subprocess.DEVNULL, start_new_session=True)
        os.close(ctl_r)
        os.close(err_r)
        self.original_stderr = os.dup(2)
        os.dup2(err_w, 2)
        os.close(err_w)

    def progress(self, line: str) -> None:
        try:
            os.write(self._ctl, (line.rstrip("\n") + "\n").encode())
        except OSError:
            pass   # the guardian is gone: the run goes on without it

    def finish(self) -> None:
        """The trainer ends on its own terms (it wrote INCOMPLETE itself where needed)."""
        if self._ctl is None:
            return
        sys.stderr.flush()
        self.progress("done")
        os.close(self._ctl)
        self._ctl = None
        os.dup2(self.original_stderr, 2)
        os.close(self.original_stderr)
        try:
            self.proc.wait(timeout=DRAIN_S + 3)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _pump(fd: int, out, seen: list) -> None:
    buf = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for raw in lines:
            text = raw.decode(errors="replace")
            if any(s in text for s in RAY_DIED):
                seen.append(text)
            if not is_raw_noise(text):
                _write(out, raw + b"\n")
    if buf:
        _write(out, buf)


def _write(out, data: bytes) -> None:
    try:
        out.write(data)
        out.flush()
    except OSError:   # our stderr is gone: keep draining, or the trainer would block on a full pipe
        pass


def _proc_state(pid: int) -> str:
    """Linux /proc state letter; 'X' for a process that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _watch_daemons(daemons: dict, trainer: int, lost: list, stop: threading.Event) -> None:
    """A Ray daemon (raylet, GCS) found dead while the trainer is still our parent died first:
    the cluster went away. Daemons killed by the trainer's own death (they share its fate) die
    only after the kernel has given us a new parent, so they never count."""
    while not stop.wait(0.01):   # the trainer may follow its raylet within a fraction of a second
        for name, pid in daemons.items():
            if _proc_state(pid) in "ZX" and os.getppid() == trainer:
                lost.append(f"{name} died")
                return


def _mark(run_dir: str, reason: str) -> None:
    path = os.path.join(run_dir, "INCOMPLETE")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(reason.rstrip() + "\n")
    os.replace(tmp, path)


def guard(run_dir: str, location: str, ctl_fd: int, err_fd: int) -> int:
    # `ray job stop` signals the entrypoint's children too: the guardian must outlive the
    # trainer's clean stop (a reader gone would turn the trainer's stderr into a broken pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    seen: list = []
    pump = threading.Thread(target=_pump, args=(err_fd, sys.stderr.buffer, seen), daemon=True)
    pump.start()
    where, lost, polled, stop = "", None, [], threading.Event()
    trainer = os.getppid()
    with os.fdopen(ctl_fd, "rb") as ctl:
        for raw in ctl:
            word, _, rest = raw.decode().strip().partition(" ")
            if word == "done":
                stop.set()
                pump.join(DRAIN_S)
                return 0
            if word == "ray":   # the embedded Ray's daemons: "ray raylet=PID gcs_server=PID"
                daemons = {k: int(v) for k, v in (item.split("=") for item in rest.split())}
                threading.Thread(target=_watch_daemons, args=(daemons, trainer, polled, stop), daemon=True).start()
            elif word == "running":
                where = f" during iteration {rest}"
            elif word == "finished":
                where = f" after iteration {rest}"
            elif word == "lost":
                lost = rest
    # The trainer died without finishing. Let Ray's last words through first.
    stop.set()
    lost = lost or (polled[0] if polled else None)
    deadline = time.monotonic() + DRAIN_S
    while pump.is_alive() and time.monotonic() < deadline:
        pump.join(0.1)
    what = (f"the Ray cluster went away ({lost})" if lost else
            "the Ray cluster went away (" + seen[0].strip()[:120] + ")" if seen else
            "the trainer process ended abruptly (killed, or its Ray cluster went away)")
    good = latest_good_checkpoint(run_dir, log=lambda m: None)
    resume = (f"`moe-rl train --resume {location}` will continue from {os.path.basename(good)}" if good else
              "no good checkpoint was written yet: start the run again")
    if lost or seen:   # the same words as the trainer's own line (lost_cluster.mark_lost)
        what, where = what.replace(" (", where + " (", 1), ""
    reason = f"{what}{where}; no final checkpoint is possible; {resume}"
    try:
        _mark(run_dir, reason)
    except OSError as e:
        reason += f" (could not write INCOMPLETE: {e.strerror})"
    try:
        sys.stderr.write(f"moe-rl: error: {reason}\n")
        sys.stderr.flush()
    except OSError:   # the terminal is gone (SIGHUP ended the trainer): INCOMPLETE says it
        pass
    return 1


def main(argv=None) -> int:
    run_dir, location, ctl_fd, err_fd = (argv or sys.argv[1:])[:4]
    return guard(run_dir, location, int(ctl_fd), int(err_fd))


if __name__ == "__main__":
    sys.exit(main())
