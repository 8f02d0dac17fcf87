"""Per-tensor digests, computed where the weights live (pure torch).

The consistency checks compare digests, never whole models gathered in one process: a learner
digests its own shard, a rollout actor its own copy, and only the small digests travel.

A digest is (sum, sum of squares, max |w|, hash of the bytes). Only the hash decides equality;
the sums describe the tensor (fp32 accumulation: torch's pairwise reductions, one pass each and
no fp64 copy of the weights). The hash is exact: the rollout copy must equal the synced weights *cast to
the rollout copy's dtype* bit for bit (a bf16 copy rounds each fp32 weight the same way every
time), so the expected digest is taken of the synced tensor cast to that dtype.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

Digest = Tuple[float, float, float, str]
DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
                              torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def as_tensor(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    return torch.from_numpy(np.ascontiguousarray(value))


def tensor_digest(value, dtype: Optional[torch.dtype] = None) -> Digest:
    """(sum, sum of squares, max |w|, blake2b-128 of the bytes) of `value` cast to `dtype`."""
    t = as_tensor(value)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    t = t.detach().cpu().contiguous().reshape(-1)
    h = hashlib.blake2b(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"", digest_size=16)
    h.update(f"{t.dtype}".encode())
    if not t.numel():
        return 0.0, 0.0, 0.0, h.hexdigest()
    f = t if t.dtype == torch.float32 else t.float()
    lo, hi = torch.aminmax(f)
    return float(f.sum()), float(torch.dot(f, f)), max(-float(lo), float(hi)), h.hexdigest()


Sample = Optional[Tuple[int, int]]   # (K, index): the index-th of K rotating shares of the tensors; None: all


def sample_of(param_sample: float, index: int) -> Sample:
    """consistency.param_sample (1/K) at check `index` -> the share to digest (None: every tensor)."""
    k = max(1, round(1 / param_sample))
    return None if k == 1 else (k, index % k)


def in_sample(name: str, sample: Sample) -> bool:
    """Whether `name` is in the share: a fixed hash of the name, so every process picks the same
    tensors and K consecutive indices cover every tensor once."""
    if sample is None:
        return True
    k, index = sample
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little") % k == index


DIGEST_THREADS = min(8, os.cpu_count() or 1)
# Below this many numbers, handing tensors to threads costs more than it saves. Measured on 2
# cores (two training runs beside it): the quickstart policy (26 tensors, 139 k numbers) took
# 0.66 ms in one thread, 1.3 ms on a kept pool and 5.2 ms on a pool made per call; 16 tensors of
# 256 k numbers 14.9 / 15.6 ms; 16 of 1 M 55 ms in one thread, 33 ms on the pool.
PARALLEL_MIN_NUMEL = 1 << 22
_pool: Optional[ThreadPoolExecutor] = None


def state_digests(state: Mapping[str, object], dtypes: Optional[Mapping[str, str]] = None,
                  sample: Sample = None) -> Dict[str, Digest]:
    """{name: digest} of a state dict (of its share `sample`); `dtypes` (name -> dtype name) casts
    before digesting. A large state is digested on DIGEST_THREADS threads (torch and hashlib
    release the GIL), so a copy is hashed at several times one core's rate."""
    global _pool
    dtypes = dtypes or {}
    names = [k for k in state if in_sample(k, sample)]
    digest = lambda k: tensor_digest(state[k], DTYPES.get(dtypes.get(k, ""), None))   # noqa: E731
    if DIGEST_THREADS < 2 or sum(as_tensor(state[k]).numel() for k in names) < PARALLEL_MIN_NUMEL:
        return {k: digest(k) for k in names}
    if _pool is None:
        _pool = ThreadPoolExecutor(DIGEST_THREADS, thread_name_prefix="moe-rl-digest")
    return dict(zip(names, _pool.map(digest, names)))


def state_dtypes(state: Mapping[str, torch.Tensor]) -> Dict[str, str]:
    return {k: str(v.dtype) for k, v in state.items()}


def differing(expected: Mapping[str, Digest], actual: Mapping[str, Digest]) -> List[str]:
    """Names whose bytes differ, or that exist on one side only (sorted)."""
    names = set(expected) | set(actual)
    return sorted(n for n in names if n not in expected or n not in actual or expected[n][3] != actual[n][3])


def _as_double(value) -> torch.Tensor:
    # A fp64 copy made by numpy: the arrays from Ray's object store (breach lines) are read-only,
    # and torch warns about sharing their memory.
    if isinstance(value, torch.Tensor):
        return value.detach().double()
    return torch.from_numpy(np.array(value, dtype=np.float64))


def max_abs_diff(a, b) -> float:
    """max |a - b| in fp64 (inf for a shape mismatch, nan propagates as inf)."""
    ta, tb = _as_double(a), _as_double(b)
    if ta.shape != tb.shape:
        return float("inf")
    if not ta.numel():
        return 0.0
    return float(torch.nan_to_num((ta - tb).abs(), nan=float("inf")).max())
