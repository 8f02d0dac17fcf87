"""The collective weight sync's two ends, over Ray's collective groups (ray.util.collective).

Each publishing learner (its expert shard; rank 0 also the dense part) is rank 0 of a group of
its own whose other members are the rollout actors, so every source broadcasts its part in
parallel with the others. Per sync and source: a header [version, number of buckets, plan id],
then the buckets (moe_rl.core.buckets), in the rollout copy's dtype. A rollout actor receives each
bucket straight into its module's own tensors (canonical views of the stacked experts): one bucket
per source in flight, never a second model. It refuses a header whose version or plan is not the
one the driver announced, and only a complete load sets the copy's weights version.

Backends: "nccl" is Ray's own NCCL group (every member holds a GPU). "gloo" is a Ray collective
backend registered here whose group is a gloo process group of its own: Ray's built-in torch-gloo
group joins torch.distributed's *default* group, which in a learner process is DeepSpeed's.
"""
from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Dict, List, Sequence

import ray
import ray.util.collective as col
import torch
from ray.util.collective.backend_registry import register_collective_backend
from ray.util.collective.collective_group.base_collective_group import BaseGroup

from moe_rl.actors.rendezvous import listening_socket, tcp_store
from moe_rl.core.buckets import Entry, bucket_bytes_of, pack, plan_buckets, plan_id, unpack
from moe_rl.core.digests import DTYPES
from moe_rl.rllib import ray_private
from moe_rl.rllib.ray_private import kv_del, kv_get, kv_put
from moe_rl.rllib.runner import runner_modules, synced_state

GLOO_BACKEND = "MOE_RL_GLOO"


class GlooSyncGroup(BaseGroup):
    """A Ray collective group on a gloo process group of its own (rendezvous through Ray's
    internal KV store: rank 0 publishes its TCP store's address)."""

    timeout_s = 60.0   # set by join() before the group is made (Ray passes no timeout to custom backends)

    def __init__(self, world_size: int, rank: int, group_name: str):
        super().__init__(world_size, rank, group_name)
        timeout = datetime.timedelta(seconds=self.timeout_s)
        key = f"moe_rl_sync_store_{group_name}"
        addr = ray.util.get_node_ip_address()   # loopback under the embedded Ray
        if rank == 0:
            listen = listening_socket(addr)
            host, port = addr, listen.getsockname()[1]
            self._store = tcp_store(host, port, world_size, 0, self.timeout_s, listen=listen)
            kv_put(key, f"{addr}:{port}")
        else:
            deadline = time.monotonic() + self.timeout_s
            while (meta := kv_get(key)) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"weight sync group {group_name!r}: no rendezvous from rank 0 "
                                       f"in {self.timeout_s:.0f}s")
                time.sleep(0.02)
            host, port = meta.decode().rsplit(":", 1)
            self._store = tcp_store(host, int(port), world_size, rank, self.timeout_s)
        opts = torch.distributed.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [torch.distributed.ProcessGroupGloo.create_device(hostname=addr)]
        self._pg = torch.distributed.ProcessGroupGloo(self._store, rank, world_size, opts)
        if rank == 0:   # every rank has connected (the constructor is a rendezvous)
            kv_del(key)

    @classmethod
    def backend(cls):
        return GLOO_BACKEND

    @classmethod
    def check_backend_availability(cls) -> bool:
        return torch.distributed.is_available()

    def destroy_group(self):
        self._pg = self._store = None

    def broadcast(self, tensor, broadcast_options=None):
        self._pg.broadcast(tensor[0], broadcast_options.root_rank).wait()

    def barrier(self, barrier_options=None):
        self._pg.barrier().wait()

    def allreduce(self, tensor, allreduce_options=None):
        self._pg.allreduce(tensor).wait()

    def _unused(self, *args, **kwargs):
        raise NotImplementedError("the weight sync group only broadcasts")

    reduce = allgather = reducescatter = send = recv = _unused


def _backend(name: str) -> str:
    if name == "gloo":
        try:
            register_collective_backend(GLOO_BACKEND, GlooSyncGroup)
        except ValueError:   # "already registered" in this process: Ray's public API has no query
            pass
        return GLOO_BACKEND
    return "NCCL"


def _device(backend: str) -> torch.device:
    """Where the buckets live: gloo moves host memory (a GPU learner packs into it), NCCL GPU memory."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _buffer(buckets, device) -> torch.Tensor:
    """One flat buffer, reused for every bucket of a source: one bucket in flight per source."""
    return torch.empty(max((bucket_bytes_of(b) for b in buckets), default=0), dtype=torch.uint8, device=device)


# --- membership ----------------------------------------------------------------------------------
def join(_actor, groups: Dict[str, int], world_size: int, backend: str, timeout_s: float) -> None:
    """Join the named groups ({group name: rank}); every member calls this concurrently."""
    GlooSyncGroup.timeout_s = float(timeout_s)
    name = _backend(backend)
    errors: List[str] = []

    def init(group, rank):
        try:
            col.init_collective_group(world_size, rank, name, group)
        except Exception as e:  # noqa: BLE001 - named below
            errors.append(f"{group}: {type(e).__name__}: {e}")

    # One rendezvous per group, concurrently: a rollout actor is in every source's group.
    threads = [threading.Thread(target=init, args=item, daemon=True) for item in groups.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError("could not join the weight sync group(s): " + "; ".join(errors))


def leave(_actor, groups: Sequence[str]) -> None:
    for group in groups:
        if col.is_group_initialized(group):
            col.destroy_collective_group(group)


# --- the source: a learner -----------------------------------------------------------------------
def source_manifest(learner, wire_dtypes: Dict[str, Dict[str, str]]) -> List[Entry]:
    """(module id, global name, shape, wire dtype) of every tensor this learner publishes, in
    order; the wire dtype is the rollout copy's."""
    return [(mid, name, tuple(t.shape), wire_dtypes.get(mid, {}).get(name, str(t.dtype)))
            for mid, part in sorted(learner.published().items()) for name, t in sorted(part.items())]


def send(learner, group: str, version: int, entries: List[Entry], bucket_bytes: int, backend: str) -> None:
    """Broadcast this learner's part as version `version`."""
    device = _device(backend)
    live = learner.published()
    buckets = plan_buckets(entries, bucket_bytes)
    col.broadcast(torch.tensor([version, len(buckets), plan_id(entries)], dtype=torch.int64, device=device),
                  0, group)
    buffer = _buffer(buckets, device)
    with torch.no_grad():
        for bucket in buckets:
            col.broadcast(pack([live[m][n] for m, n, _, _ in bucket], bucket, buffer), 0, group)


# --- the receiver: a rollout actor ---------------------------------------------------------------
def receive(runner, sources: Dict[str, List[Entry]], version: int, bucket_bytes: int,
            backend: str) -> Dict[str, Any]:
    """Receive every source's part (one thread per source group) into this runner's copy.
    -> {"ok": bool, "error": str}. The copy takes `version` only when every bucket of every source
    landed under the announced version and plan (a failed load keeps the old version number, so
    the object store's load that follows replaces the whole copy)."""
    device = _device(backend)
    views = {mid: synced_state(m) for mid, m in runner_modules(runner).items()}
    offered = sorted((e[0], e[1]) for entries in sources.values() for e in entries)
    errors: List[str] = []
    if offered != sorted((mid, n) for mid, v in views.items() for n in v):   # strict, as the object store's load
        errors.append(f"the plan does not match this copy: {len(offered)} tensors offered for "
                      f"{sum(map(len, views.values()))} held")
    elif any(DTYPES[e[3]] != views[e[0]][e[1]].dtype for entries in sources.values() for e in entries):
        errors.append("the plan's wire dtypes are not this copy's")

    def one_source(group: str, entries: List[Entry]) -> None:
        buckets = plan_buckets(entries, bucket_bytes)
        header = torch.zeros(3, dtype=torch.int64, device=device)
        col.broadcast(header, 0, group)
        got_version, n_buckets, got_plan = (int(v) for v in header.tolist())
        if got_plan != plan_id(entries) or n_buckets != len(buckets):
            # Bucket sizes unknown: nothing can be drained; the source times out and the driver
            # falls back to the object store.
            raise RuntimeError("refused: the source's plan is not the announced one")
        if got_version != version:
            errors.append(f"{group}: refused version {got_version} (announced {version})")
        apply = not errors
        buffer = _buffer(buckets, device)
        with torch.no_grad():
            for bucket in buckets:     # received even when refused: the source is not left hanging
                buf = buffer[:bucket_bytes_of(bucket)]
                col.broadcast(buf, 0, group)
                if apply:
                    for (mid, name, _, _), value in unpack(buf, bucket):
                        views[mid][name].copy_(value)

    def run(group, entries):
        try:
            one_source(group, entries)
        except Exception as e:   # noqa: BLE001 - reported to the driver, which falls back
            errors.append(f"{group}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(g, e), daemon=True) for g, e in sources.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if not errors:
        ray_private.set_runner_weights_seq_no(runner, version)
    return {"ok": not errors, "error": "; ".join(errors)}
