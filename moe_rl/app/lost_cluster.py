"""The Ray cluster going away under `moe-rl train`: recognise it, say so, mark the run.

No final checkpoint is possible then (the learners' state went with the cluster), so the run
directory's INCOMPLETE and the one console line name the checkpoint `--resume` will use.
Two ways it shows: a Ray call fails and the loop asks `cluster_lost()`; or Ray's core worker ends
the process from C++ before any Python runs — then the guardian (guardian.py) speaks, and
`EmbeddedRayWatch` has told it beforehand whether the embedded Ray's raylet or GCS died first.
"""
from __future__ import annotations

import os
import threading
from typing import Optional

import ray

from moe_rl.app.checkpoint_integrity import latest_good_checkpoint
from moe_rl.rllib.ray_private import embedded_head_node

RAY_DAEMONS = ("raylet", "gcs_server")


def dead_daemons(node) -> Optional[str]:
    """'raylet died' (or gcs_server, or both) for a Ray this process started; None if they live."""
    dead = sorted({kind for kind, _ in node.dead_processes()} & set(RAY_DAEMONS))
    return " and ".join(dead) + " died" if dead else None


def cluster_lost() -> Optional[str]:
    """What went away, if the Ray cluster of this driver did; None while it is there."""
    node = embedded_head_node()
    if node is not None:   # the embedded Ray: its raylet and GCS are our children
        dead = dead_daemons(node)
        if dead:
            return dead
    if not ray.is_initialized():
        return "the connection to it was closed"
    try:
        me = ray.get_runtime_context().get_node_id()
        if not any(n["NodeID"] == me and n["Alive"] for n in ray.nodes()):
            return "this driver's node is no longer alive in it"
    except Exception as e:   # the GCS does not answer
        return f"its GCS does not answer ({type(e).__name__})"
    return None


def mark_lost(run, what: str, iteration: int, error: BaseException) -> str:
    """INCOMPLETE and the console line's text, naming the checkpoint --resume will use."""
    good = latest_good_checkpoint(run.path, log=lambda m: None)
    resume = (f"`moe-rl train --resume {run.location}` will continue from {os.path.basename(good)}" if good
              else "no good checkpoint was written yet: start the run again")
    reason = (f"the Ray cluster went away during iteration {iteration} ({what}; {type(error).__name__}); "
              f"no final checkpoint is possible; {resume}")
    run.mark_incomplete(reason)
    return reason


class EmbeddedRayWatch:
    """Polls the embedded Ray's raylet and GCS (children of this process) twice a second and tells
    the guardian the moment one dies: Ray's core worker may end this process a moment later."""

    def __init__(self, guardian, period_s: float = 0.5):
        self._node, self._guardian, self._period = embedded_head_node(), guardian, period_s
        self._stop = threading.Event()
        self._thread = None
        if self._node is not None:
            # The guardian polls them too, from outside: this process may be ended too soon to say it.
            pids = [f"{kind}={info.process.pid}" for kind in RAY_DAEMONS
                    for info in self._node.all_processes.get(kind, [])]
            guardian.progress("ray " + " ".join(pids))
            self._thread = threading.Thread(target=self._run, name="moe-rl-ray-watch", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            try:
                dead = dead_daemons(self._node)
            except Exception:   # the node object is being torn down (ray.shutdown)
                return
            if dead:
                self._guardian.progress(f"lost {dead}")
                return

    def close(self) -> None:
        """Before ray.shutdown(): stopping Ray on purpose is not losing it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
