"""Rendezvous for the learners' process group and the weight-sync groups, bound to one address.

torch's TCPStore listens on every interface whatever host it is given, and Ray's token does not
cover its port; gloo's pairs listen on whatever the host name resolves to. Both are bound here to
the node's own IP as Ray knows it: 127.0.0.1 under the embedded Ray (moe_rl.app.ray_launch keeps
it on loopback), the node's cluster address on a cluster (docs/cluster.md names the ports).

    sock = listening_socket(ip)                    # rank 0, before it publishes (ip, port)
    store = tcp_store(ip, port, world, rank, timeout, listen=sock)
    bind_collectives_to(ip)                        # gloo / NCCL pairs on that address too
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Optional

import psutil
import torch.distributed as dist


def listening_socket(ip: str) -> socket.socket:
    """A socket bound to ip on a free port and listening: the store's server takes it over, so no
    other process can take the port between choosing it and listening on it."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((ip, 0))
    sock.listen(128)
    return sock


def tcp_store(ip: str, port: int, world_size: int, rank: int, timeout_s: float,
              listen: Optional[socket.socket] = None) -> dist.TCPStore:
    """Rank 0 serves on `listen` (bound to ip); the others connect to ip:port."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0:
        assert listen is not None, "rank 0 serves the store on its own bound socket"
        return dist.TCPStore(ip, port, world_size, True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=listen.fileno())
    return dist.TCPStore(ip, port, world_size, False, timeout=timeout)


def interface_of(ip: str) -> Optional[str]:
    """The network interface that holds ip (lo for 127.0.0.1), or None if none does."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == ip for a in addresses):
            return name
    return None


def bind_collectives_to(ip: str) -> None:
    """gloo and NCCL open their pairs' sockets on this interface (set before the group is made)."""
    name = interface_of(ip)
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
        os.environ["NCCL_SOCKET_IFNAME"] = name
