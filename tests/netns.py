"""Hosts of a real Ray cluster on one machine: Linux network namespaces joined by a bridge.

Each host is a network namespace of its own (its own interfaces, addresses, routes, ports and
loopback) holding one end of a veth pair; the other ends hang on a bridge that sits in a namespace
of its own, the switch. Addresses come from 198.18.0.0/15 (RFC 2544's range for network tests).
The machine's own network stack is never touched: every link is made inside the switch's namespace
with its peer put straight into the host's, no address or route is added outside our namespaces,
and every command a test runs on a host (`ray start`, `ray job submit`, `ss`, the run itself) runs
inside that host's namespace, where the machine's LAN address does not exist: nothing can leave
the machine. Everything made here is removed on exit, a failed test included: the processes in our
namespaces (only ours: a process is found by the namespace it lives in), then the namespaces, which
take their links with them, then the hosts' temp dirs.

    with Hosts(["a", "b"]) as hosts:
        hosts.start_head("a", "--num-cpus", "2")
        hosts.join("b", "--num-cpus", "2")
        hosts.run("a", ["ray", "job", "submit", "--address", hosts.dashboard, "--", ...])
        hosts.lose("b")                       # its link down, then its processes SIGKILLed

Every `ray start` runs with the cluster's token (RAY_AUTH_TOKEN; token auth on), its own
--temp-dir (the hosts share one /tmp), and --node-ip-address (Ray picks loopback otherwise, as
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 asks of the suite's own Rays; here it is 1: a real cluster).
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

import psutil
import ray_processes

SUBNET_PREFIX = "198.18.0."     # 198.18.0.0/24, inside 198.18.0.0/15
GCS_PORT, DASHBOARD_PORT = 6379, 8265    # each host has a port space of its own: the defaults are free
# Ray's range for its workers' gRPC servers (its defaults, said here so that a test can tell a
# worker's own Ray port from the sockets moe-rl opens in the same process).
WORKER_PORTS = (10002, 19999)
BINDIR = os.path.dirname(sys.executable)
NAME_PREFIX = "moerl-"   # every namespace made here: moerl-<CI run or "dev">-<pid>-<random>-<host>
# Under load (the suite runs two files at a time on 2 cores) the dashboard agent took 19 s to
# import; the raylet's default wait for its port file is shorter and the raylet then aborts.
RAY_START_ENV = {"RAY_agent_register_timeout_ms": "120000"}


def unavailable() -> Optional[str]:
    """Why network namespaces cannot be made here, or None when they can (tried, then removed)."""
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`); this run is not root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    if shutil.which("ss") is None:
        return "iproute2's `ss` is not installed (apt-get install iproute2)"
    probe = f"moerlprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()[:200]}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def is_ray_worker_port(port: int) -> bool:
    return WORKER_PORTS[0] <= port <= WORKER_PORTS[1]


def _ip(*args: str) -> None:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")


def _netns_inode(name: str) -> int:
    return os.stat(f"/run/netns/{name}").st_ino


def processes_in(namespace: str) -> List[psutil.Process]:
    """The live processes whose network namespace is `namespace` (no other process is ever touched);
    none once the namespace is deleted."""
    try:
        inode, out = _netns_inode(namespace), []
    except FileNotFoundError:
        return []
    for proc in psutil.process_iter():
        try:
            if os.stat(f"/proc/{proc.pid}/ns/net").st_ino == inode and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except (OSError, psutil.NoSuchProcess):
            pass
    return out


def listening(namespace_argv: List[str]) -> List[Dict]:
    """`ss -ltnp` inside a namespace: [{"address", "port", "pids"}] per listening TCP socket."""
    out = subprocess.run([*namespace_argv, "ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        address, _, port = fields[3].rpartition(":")
        rows.append({"address": address.strip("[]"), "port": int(port),
                     "pids": [int(p) for p in re.findall(r"pid=(\d+)", line)]})
    return rows


class Hosts:
    """Hosts `names` on one switch; host i (from 0) has address 198.18.0.(i+1)."""

    def __init__(self, names: Sequence[str]):
        # CI's run id in the names: its cleanup deletes what a killed test session left (.ci/run).
        self.tag = f"{NAME_PREFIX}{os.environ.get('MOE_RL_CI_RUN', 'dev')}-{os.getpid()}-{secrets.token_hex(2)}-"
        self.names = list(names)
        self.switch = f"{self.tag}sw"
        self.ns = {h: f"{self.tag}{h}" for h in self.names}
        self.ip = {h: f"{SUBNET_PREFIX}{i + 1}" for i, h in enumerate(self.names)}
        self.token = secrets.token_hex(32)
        self.temp = tempfile.mkdtemp(prefix="mr", dir="/tmp")   # short: Ray's unix socket paths
        self.head: Optional[str] = None
        self._made: List[str] = []

    # --- the network ------------------------------------------------------------------------------
    def __enter__(self) -> "Hosts":
        try:
            self._add_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for h in self.names:
                self._add_namespace(self.ns[h])
                # Made inside the switch, the peer put straight into the host: no end ever exists
                # in the machine's own namespace.
                _ip("-n", self.switch, "link", "add", f"to-{h}", "type", "veth", "peer", "name", "eth0",
                    "netns", self.ns[h])
                _ip("-n", self.switch, "link", "set", f"to-{h}", "master", "br0")
                _ip("-n", self.switch, "link", "set", f"to-{h}", "up")
                _ip("-n", self.ns[h], "link", "set", "lo", "up")
                _ip("-n", self.ns[h], "addr", "add", f"{self.ip[h]}/24", "dev", "eth0")
                _ip("-n", self.ns[h], "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Every process in our namespaces killed, the namespaces (and their links) deleted, the
        temp dirs removed. Safe to call twice."""
        for name in self._made:
            self._kill_namespace(name)
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
        self._made = []
        shutil.rmtree(self.temp, ignore_errors=True)

    def _kill_namespace(self, name: str, timeout_s: float = 30.0) -> List[int]:
        killed, deadline = [], time.monotonic() + timeout_s
        while procs := processes_in(name):
            ray_processes.record(procs)
            for proc in procs:
                try:
                    proc.send_signal(signal.SIGKILL)
                    killed.append(proc.pid)
                except psutil.NoSuchProcess:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"namespace {name}: processes survive SIGKILL: {[p.pid for p in procs]}")
            time.sleep(0.2)
        return killed

    def cut(self, host: str) -> None:
        """The host's link down at both ends: packets to and from it are dropped, no reset is sent."""
        _ip("-n", self.switch, "link", "set", f"to-{host}", "down")
        _ip("-n", self.ns[host], "link", "set", "eth0", "down")

    def lose(self, host: str) -> List[int]:
        """The host is lost as a machine is: its link down first (its peers hear nothing, not even
        a reset), then every process on it SIGKILLed. Returns the pids killed."""
        self.cut(host)
        return self._kill_namespace(self.ns[host])

    # --- commands on a host -----------------------------------------------------------------------
    def argv(self, host: str, argv: Sequence[str]) -> List[str]:
        return ["ip", "netns", "exec", self.ns[host], *argv]

    def env(self, host: str, token: Optional[str] = "cluster") -> Dict[str, str]:
        """A command's environment on `host`: Ray's CLI on PATH, cluster mode, and the cluster's
        token (token="cluster", token auth on), another token (a string, token auth on), or none
        (None: a stranger's machine: no token anywhere Ray looks, RAY_AUTH_MODE unset, HOME an
        empty directory, so not even the machine's own ~/.ray/auth_token)."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")}
        env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", PATH=BINDIR + os.pathsep + os.environ["PATH"])
        if token is None:
            env["HOME"] = tempfile.mkdtemp(prefix="home", dir=self.temp)
        else:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token if token == "cluster" else token)
        return env

    def run(self, host: str, argv: Sequence[str], timeout: float = 600, token: Optional[str] = "cluster",
            **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(host, argv), env=kwargs.pop("env", None) or self.env(host, token),
                              capture_output=True, text=True, timeout=timeout, **kwargs)

    def popen(self, host: str, argv: Sequence[str], token: Optional[str] = "cluster", **kwargs) -> subprocess.Popen:
        return subprocess.Popen(self.argv(host, argv), env=kwargs.pop("env", None) or self.env(host, token),
                                **kwargs)

    def listening(self, host: str) -> List[Dict]:
        return listening(self.argv(host, []))

    # --- Ray on the hosts -------------------------------------------------------------------------
    @property
    def gcs(self) -> str:
        return f"{self.ip[self.head]}:{GCS_PORT}"

    @property
    def dashboard(self) -> str:
        return f"http://{self.ip[self.head]}:{DASHBOARD_PORT}"

    def _ray_start(self, host: str, args: Sequence[str], env: Dict[str, str], timeout: float,
                   temp_name: Optional[str] = None):
        temp_dir = os.path.join(self.temp, temp_name or host)
        os.makedirs(temp_dir, exist_ok=True)
        p = self.run(host, ["ray", "start", "--node-ip-address", self.ip[host], "--temp-dir", temp_dir,
                            "--min-worker-port", str(WORKER_PORTS[0]), "--max-worker-port", str(WORKER_PORTS[1]),
                            "--disable-usage-stats", *args], env={**env, **RAY_START_ENV}, timeout=timeout)
        ray_processes.record(processes_in(self.ns[host]))
        return p

    def start_head(self, host: str, *args: str, env: Optional[Dict[str, str]] = None, timeout: float = 240) -> None:
        """`ray start --head` on `host` (env: more variables for it, e.g. Ray's health checks)."""
        p = self._ray_start(host, ["--head", "--port", str(GCS_PORT), "--dashboard-host", self.ip[host],
                                   "--dashboard-port", str(DASHBOARD_PORT), *args], {**self.env(host), **(env or {})},
                            timeout)
        if p.returncode != 0:
            raise RuntimeError(f"ray start --head on host {host} failed: {(p.stdout + p.stderr)[-3000:]}")
        self.head = host

    def join(self, host: str, *args: str, env: Optional[Dict[str, str]] = None, timeout: float = 240,
             check: bool = True, temp_name: Optional[str] = None) -> subprocess.CompletedProcess:
        """`ray start --address HEAD` on `host`, with the cluster's token unless `env` says otherwise
        (temp_name: a temp dir of its own, for two attempts at once)."""
        p = self._ray_start(host, ["--address", self.gcs, *args], env or self.env(host), timeout, temp_name)
        if check and p.returncode != 0:
            raise RuntimeError(f"ray start --address on host {host} failed: {(p.stdout + p.stderr)[-3000:]}")
        return p

    def stop_ray(self, host: str) -> List[int]:
        """Every process on the host SIGKILLed (its Ray and whatever ran there); the link stays up."""
        return self._kill_namespace(self.ns[host])

    def alive_nodes(self, host: Optional[str] = None, timeout: float = 120) -> List[str]:
        """The node IPs the head's GCS lists as alive (asked from `host`, the head by default)."""
        probe = ("import ray, json\n"
                 "ray.init(log_to_driver=False)\n"
                 "print('NODES', json.dumps(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])))\n")
        p = self.run(host or self.head, [sys.executable, "-c", probe], timeout=timeout,
                     env={**self.env(host or self.head), "RAY_ADDRESS": self.gcs})
        line = [line for line in p.stdout.splitlines() if line.startswith("NODES ")]
        if not line:
            raise RuntimeError(f"could not list the cluster's nodes: {(p.stdout + p.stderr)[-2000:]}")
        return json.loads(line[-1][6:])
