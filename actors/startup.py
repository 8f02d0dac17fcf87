"""What a starting learner is doing, where the driver's wait watch can read it.

A learner actor is placed (its resources granted, its process running) well before it can train:
it joins the process group and builds its DeepSpeed engines, and a torch C++ extension build (a
DeepSpeed op JIT-compiled the first time on a machine) can take minutes on a busy host. A wait
for that is not a wait for resources, so each learner writes its current step into Ray's
internal KV, under its job's prefix; the driver's wait watch (moe_rl.algo.resources) reads them.

DeepSpeed's CPU shared-memory comm op (`deepspeed_shm_comm`) is switched off here: DeepSpeed's
TorchBackend JIT-compiles it whenever a CPU process group starts, yet it serves only
`inference_all_reduce` (DeepSpeed's tensor-parallel layers), which moe-rl never calls.
"""
from __future__ import annotations

import glob
import json
import os
import sys
import threading
import time
from typing import Dict, Tuple

import deepspeed.ops
import torch
from torch.utils.cpp_extension import get_default_build_root

from moe_rl.rllib.ray_private import kv_del, kv_get, kv_list, kv_put

PREFIX = "moe_rl/startup/"
SHM_COMM_OP = "deepspeed_shm_comm"
# Set to "build" to keep DeepSpeed's default (compile and initialise the op): for measuring it.
SHM_COMM_ENV = "MOE_RL_DEEPSPEED_SHM_COMM"
# A step that outlasts this beside an older build lock may be waiting on it (torch waits forever).
STALE_LOCK_NOTE_S = 60.0


def skip_unused_shm_comm_op() -> bool:
    """Before deepspeed.init_distributed on CPU: mark the shm comm op incompatible in DeepSpeed's
    compatible-ops table (a dict that deepspeed.ops caches so that edits to it persist), so its
    TorchBackend neither compiles nor initialises it; every collective goes through torch.distributed
    (gloo), as it does anyway for everything but inference_all_reduce. Returns whether it was skipped."""
    if os.environ.get(SHM_COMM_ENV) == "build":
        return False
    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
    return True


def extensions_root() -> str:
    """Where torch's JIT builds C++ extensions (torch.utils.cpp_extension._get_build_directory
    without creating anything)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return root
    accel = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None else
             f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
    return os.path.join(get_default_build_root(),
                        f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accel}")


def extension_builds() -> Dict[str, float]:
    """{extension: seconds since its build lock appeared} for every torch extension being built
    (or whose build was killed: torch leaves the lock, and the next build waits on it forever)."""
    out = {}
    for lock in glob.glob(os.path.join(extensions_root(), "*", "lock")):
        try:
            out[os.path.basename(os.path.dirname(lock))] = time.time() - os.stat(lock).st_mtime
        except FileNotFoundError:
            pass
    return out


class StartupReport:
    """`with StartupReport(job_id, "learner 0") as report: report.step("...")`: the current step,
    readable by the driver until the block ends; a watcher thread turns a torch extension build
    that starts meanwhile into the step."""

    def __init__(self, job_id: str, who: str, poll_s: float = 1.0):
        self.key = f"{PREFIX}{job_id}/{who}".encode()
        self.poll_s, self._done = poll_s, threading.Event()
        self.doing, self.step_t0, self.step_since = "", time.monotonic(), time.time()

    def step(self, doing: str) -> None:
        self.doing, self.step_t0, self.step_since = doing, time.monotonic(), time.time()
        self._put(doing, self.step_since)

    def _put(self, doing: str, since: float) -> None:
        try:
            kv_put(self.key, json.dumps({"doing": doing, "since": since}))
        except Exception:   # a progress note is never worth failing a learner's start
            pass

    def _watch(self) -> None:
        before = set(extension_builds())   # locks older than this start are someone else's (or stale)
        shown, first_seen = None, {}
        while not self._done.wait(self.poll_s):
            builds = extension_builds()
            building = sorted(k for k in builds if k not in before)
            waiting = {k: v for k, v in builds.items() if k in before}
            note, since = None, self.step_since
            if building:
                name = building[0]
                since = first_seen.setdefault(name, time.time())
                note = (f"compiling the C++ extension {name} (torch JIT build, once per install, "
                        f"in {extensions_root()})")
            elif waiting and self.doing and time.monotonic() - self.step_t0 > STALE_LOCK_NOTE_S:
                name, age = sorted(waiting.items())[0]
                note = (f"{self.doing}; an older build lock of {name} exists since {age:.0f}s "
                        f"({os.path.join(extensions_root(), name, 'lock')}: a build of {name} waits while "
                        "it exists; if no compiler runs, it is stale: delete it)")
            if note and note != shown:
                shown = note
                self._put(note, since)
            elif not note and shown and self.doing:   # the build ended: back to the step itself
                shown = None
                self._put(self.doing, self.step_since)

    def __enter__(self) -> "StartupReport":
        threading.Thread(target=self._watch, daemon=True, name="moe-rl-startup-report").start()
        return self

    def __exit__(self, *exc) -> bool:
        self._done.set()
        try:
            kv_del(self.key)
        except Exception:
            pass
        return False


def read_steps(job_id: str) -> Dict[str, Tuple[str, float]]:
    """{who: (what it is doing, for how many seconds)} of this job's starting learners."""
    out = {}
    try:
        for key in kv_list(f"{PREFIX}{job_id}/"):
            raw = kv_get(key)
            if raw:
                note = json.loads(raw)
                out[key.decode()[len(PREFIX) + len(job_id) + 1:]] = (note["doing"], time.time() - note["since"])
    except Exception:   # no KV (not connected): nothing known
        pass
    return out
