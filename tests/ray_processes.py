"""The Ray processes the test suite starts, found and stopped without touching anyone else's Ray.

`ray stop` kills every Ray process of the user on the host (a developer's training run, another CI
job). The suite instead starts each head in a session of its own (`start_new_session`): the head's
GCS, raylet, dashboard, autoscaler and every worker it spawns stay in that session (workers take a
process group of their own, but not a session), so the session id names exactly that head's
processes. In-process Rays stop with `ray.shutdown()`.

Every process the suite starts inherits SUITE_MARKER in its environment; conftest.py records the
Ray processes it sees and asserts at session end that none is left."""
import os
import signal
import time

import psutil

SUITE_MARKER = "MOE_RL_TEST_SUITE"
# (pid, create_time) of every Ray process recorded during this session: a pid alone could be reused.
RECORDED: set = set()


def is_ray_process(proc: psutil.Process) -> bool:
    try:
        name, cmdline = proc.name(), " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return (name.startswith(("ray::", "ray-dashboard-", "raylet", "gcs_server"))
            or cmdline.startswith(("ray::", "ray-dashboard-")) or f"{os.sep}site-packages{os.sep}ray{os.sep}" in cmdline
            or "-m ray.util.client.server" in cmdline)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def session_processes(sid: int) -> list:
    """The live processes of session `sid` (a head started with `start_new_session`)."""
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and _alive(proc):
                out.append(proc)
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass
    return out


def record(procs) -> None:
    for proc in procs:
        try:
            RECORDED.add((proc.pid, proc.create_time()))
        except psutil.NoSuchProcess:
            pass


def kill_session(sid: int, timeout: float = 30.0) -> list:
    """SIGKILL every process of session `sid` (as `ray stop --force` would, but only these; a SIGTERM
    makes a head drain for 30 s) until none is left. Returns the pids it killed."""
    killed, deadline = [], time.monotonic() + timeout
    while True:
        procs = session_processes(sid)
        if not procs:
            return killed
        record(procs)
        for proc in procs:
            try:
                proc.send_signal(signal.SIGKILL)
                killed.append(proc.pid)
            except psutil.NoSuchProcess:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"session {sid}: processes survive SIGKILL: {[p.pid for p in procs]}")
        time.sleep(0.2)


def marked_ray_processes(marker: str) -> list:
    """Live Ray processes whose environment carries SUITE_MARKER=marker (the suite started them)."""
    out = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid() or not is_ray_process(proc):
            continue
        try:
            if proc.environ().get(SUITE_MARKER) == marker and _alive(proc):
                out.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def recorded_alive() -> list:
    """The recorded Ray processes still running (same pid and start time)."""
    out = []
    for pid, created in RECORDED:
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created and _alive(proc):
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


def describe(procs) -> str:
    rows = []
    for proc in procs:
        try:
            rows.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return "; ".join(rows)
