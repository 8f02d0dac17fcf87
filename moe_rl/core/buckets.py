"""Buckets of a collective weight sync (pure torch: the plan both ends agree on, packing, unpacking).

A source (a learner) and its receivers (the rollout actors) derive the same plan from the same
manifest: the ordered (module id, global name, shape, wire dtype) of every tensor the source
publishes. Tensors travel in the rollout copy's dtype (bf16 on the wire for a bf16 copy), packed
byte for byte into flat uint8 buckets of at most `bucket_bytes` (a larger tensor travels alone),
so one bucket per source is in flight, never a second model. Each tensor starts at a multiple of
its item size (a float32 after an odd number of bf16 values: two padding bytes), so its view of
the buffer is aligned.
"""
from __future__ import annotations

import hashlib
import math
from typing import Iterator, List, Sequence, Tuple

import torch

from moe_rl.core.digests import DTYPES

Entry = Tuple[str, str, Tuple[int, ...], str]   # (module id, global name, shape, wire dtype name)


def entry_bytes(entry: Entry) -> int:
    return math.prod(entry[2]) * DTYPES[entry[3]].itemsize


def _aligned(offset: int, entry: Entry) -> int:
    item = DTYPES[entry[3]].itemsize
    return -(-offset // item) * item


def layout(bucket: Sequence[Entry]) -> List[Tuple[int, int]]:
    """(byte offset, byte count) of every entry of a bucket, each offset aligned to its item size."""
    out, offset = [], 0
    for e in bucket:
        offset = _aligned(offset, e)
        n = entry_bytes(e)
        out.append((offset, n))
        offset += n
    return out


def plan_buckets(entries: Sequence[Entry], bucket_bytes: int) -> List[List[Entry]]:
    """Consecutive entries grouped so that each bucket holds at most `bucket_bytes` (padding included)."""
    buckets: List[List[Entry]] = []
    size = 0
    for e in entries:
        end = _aligned(size, e) + entry_bytes(e)
        if not buckets or end > bucket_bytes:
            buckets.append([])
            end = entry_bytes(e)
        buckets[-1].append(e)
        size = end
    return buckets


def plan_id(entries: Sequence[Entry]) -> int:
    """A 62-bit fingerprint of the manifest: both ends check they hold the same plan."""
    h = hashlib.blake2b(repr([tuple(e[:2]) + (tuple(e[2]), e[3]) for e in entries]).encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") >> 2


def bucket_bytes_of(bucket: Sequence[Entry]) -> int:
    return max((offset + n for offset, n in layout(bucket)), default=0)


def pack(tensors: Sequence[torch.Tensor], bucket: Sequence[Entry], out: torch.Tensor) -> torch.Tensor:
    """The bucket's tensors, each cast to its wire dtype, written into the front of `out` (a flat
    uint8 buffer reused for every bucket); returns that slice."""
    places = layout(bucket)
    out = out[:max((o + n for o, n in places), default=0)]
    for t, e, (offset, n) in zip(tensors, bucket, places):
        out[offset:offset + n].view(DTYPES[e[3]]).view(e[2]).copy_(t.detach())   # the cast happens in the copy
    return out


def unpack(buffer: torch.Tensor, bucket: Sequence[Entry]) -> Iterator[Tuple[Entry, torch.Tensor]]:
    """(entry, tensor view into `buffer`) for every entry of a received bucket."""
    for e, (offset, n) in zip(bucket, layout(bucket)):
        yield e, buffer[offset:offset + n].view(DTYPES[e[3]]).view(e[2])
