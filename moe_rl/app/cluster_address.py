"""The Ray cluster RAY_ADDRESS names: reached in bounded time, before anything is written.

ray.init(address) to a cluster that is not there does not fail: Ray rewrites a loopback address to
the machine's LAN address (services.resolve_ip_for_localhost) and retries it for minutes inside
C++, where a SIGTERM's Python handler never runs. So `moe-rl train` reaches the address first:

    cluster_address()   RAY_ADDRESS, or None for an embedded Ray (unset, empty, or "local": that
                        one keeps every loopback setting of the embedded Ray)
    reach(address)      its GCS must accept a TCP connection within REACH_TIMEOUT_S (tried every
                        0.5 s: a head that is starting gets the time); ConfigError naming the address
    connect(address)    ray.init within CONNECT_TIMEOUT_S (a port that answers but is no GCS); a
                        loopback address stays loopback; Ctrl-C and SIGTERM end the wait at once

Both run before the run directory is created, so nothing is written for a cluster never reached.
A signal or the timeout during ray.init ends the process from a watcher thread (one line, exit 2,
or 128 + the signal), because the main thread may be inside Ray's C++ then.
"""
from __future__ import annotations

import ipaddress
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Callable, Optional, Tuple

from moe_rl.core.errors import ConfigError
from moe_rl.rllib.ray_private import keep_local_ray_on_loopback

REACH_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 120.0
_SIGNALS = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


def cluster_address() -> Optional[str]:
    address = os.environ.get("RAY_ADDRESS", "").strip()
    return None if address in ("", "local") else address


def host_port(address: str) -> Optional[Tuple[str, int]]:
    """(host, port) of host:port, [v6]:port or scheme://host:port; None for "auto"; ConfigError
    for anything else."""
    if address == "auto":
        return None
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"RAY_ADDRESS: must be host:port (a Ray head's GCS), ray://host:port, auto or local, "
                          f"got {address!r:.200}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class StoppedBySignal(ConfigError):
    """Ctrl-C or SIGTERM while reaching the cluster; exit_code is the shell's 128 + the signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class _Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum, frame):
    raise _Interrupted(signum)


def reach(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """ConfigError naming the address unless its GCS port accepts a TCP connection in time (a
    Ctrl-C or SIGTERM ends the wait with the same kind of line)."""
    target = host_port(address)
    if target is None:
        return
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _interrupt) for s in _SIGNALS} if main else {}
    deadline, last = time.monotonic() + timeout_s, "no answer"
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConfigError(f"RAY_ADDRESS={address}: no Ray cluster answers there ({last}) within "
                                  f"{timeout_s:g}s; start it, or unset RAY_ADDRESS for a local Ray "
                                  "(nothing was written)")
            try:
                with socket.create_connection(target, timeout=min(2.0, left)):
                    return
            except OSError as e:
                last = e.strerror or type(e).__name__
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    except _Interrupted as e:
        raise StoppedBySignal(f"RAY_ADDRESS={address}: stopped by {_SIGNALS[e.signum]} while reaching the cluster "
                              "(nothing was written)", e.signum) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _wake(signum, frame) -> None:
    """The watcher thread acts on the signal (the main thread may be inside C++)."""


def _say_and_exit(message: str, code: int) -> None:
    os.write(2, f"moe-rl: error: {message}\n".encode())
    os._exit(code)


def connect(address: str, init: Callable[[], None], timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """init() (ray.init) bounded: a watcher thread ends the process with one line if it has not
    returned within timeout_s, or at once on Ctrl-C / SIGTERM (seen through the signal wakeup fd,
    which the C-level handler writes even while the main thread is inside Ray's C++)."""
    target = host_port(address)
    if target is not None and is_loopback(target[0]):
        keep_local_ray_on_loopback()   # else Ray maps 127.0.0.1 to the LAN address
    if threading.current_thread() is not threading.main_thread():
        init()
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    done = threading.Event()
    previous = {s: signal.signal(s, _wake) for s in _SIGNALS}   # a Python-level handler: the wakeup fd is written
    old_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def watch():
        deadline = time.monotonic() + timeout_s
        while not done.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                _say_and_exit(f"RAY_ADDRESS={address}: the Ray cluster did not accept this driver within "
                              f"{timeout_s:g}s (is it a Ray head's GCS port?); nothing was written", 2)
            ready, _, _ = select.select([r], [], [], min(left, 0.2))
            if ready and not done.is_set():
                got = os.read(r, 64)
                signum = next((b for b in got if b in _SIGNALS), None)
                if signum is not None:
                    _say_and_exit(f"RAY_ADDRESS={address}: stopped by {_SIGNALS[signum]} while connecting to the "
                                  "cluster (nothing was written)", 128 + signum)

    watcher = threading.Thread(target=watch, name="moe-rl-connect-watch", daemon=True)
    watcher.start()
    try:
        init()
    except Exception as e:   # refused outright (no Ray there, a version or token mismatch): one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ConfigError(f"RAY_ADDRESS={address}: cannot connect to the Ray cluster ({first}); "
                          "nothing was written") from None
    finally:
        done.set()
        watcher.join()
        signal.set_wakeup_fd(old_wakeup)
        for s, handler in previous.items():
            if signal.getsignal(s) is _wake:   # ray.init may have put its own there: that one stays
                signal.signal(s, handler)
        os.close(r)
        os.close(w)
    sys.stderr.flush()
