"""Ctrl-C and SIGTERM during `moe-rl train`: finish the iteration, keep it, then stop.

The first SIGINT (a terminal's Ctrl-C) or SIGTERM (`kill`, `ray job stop`, a scheduler's
preemption) only records the request: the training loop reads it between iterations, saves and
verifies a checkpoint of the iteration that just finished, writes the report and
RUN_DIR/INCOMPLETE, and exits with 128 + the signal number. A handler that raised instead would
interrupt whatever call was running — a learner update half applied, a checkpoint half written —
and lose everything since the last periodic checkpoint. A second signal means "now": the
`on_second` callback runs (it writes INCOMPLETE) and the process exits at once.

Ray's own processes are not disturbed by the terminal's Ctrl-C: the embedded Ray starts its raylet
and GCS with SIGINT blocked, and its workers in process groups of their own.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Optional

from moe_rl.algo.resources import giving_up
from moe_rl.app import checkpoint as ck

NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal."""
    return 128 + int(signum)


class StopSignals:
    """Context manager around the training loop (main thread only; elsewhere it does nothing)."""

    def __init__(self, on_first: Callable[[int], None], on_second: Callable[[int], None]):
        self.on_first, self.on_second = on_first, on_second
        self.signum: Optional[int] = None
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def reason(self) -> str:
        return NAMES.get(self.signum, f"signal {self.signum}")

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in NAMES:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def take_back(self) -> None:
        """ray.init() installs its own SIGTERM handler in the main thread (sys.exit; an embedded
        Ray's node: kill its processes, then exit): put ours back on top of it."""
        for sig in self._previous:
            signal.signal(sig, self._handle)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and giving_up():   # the wait watch's give-up, not a user's Ctrl-C
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum = signum
            self.on_first(signum)
            return
        try:
            self.on_second(signum)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(exit_code(signum))


def stop_after_iteration(algo, run, stop: StopSignals, keep: int, verify) -> tuple:
    """The iteration that was running when the signal came has finished: keep it in a verified
    checkpoint (`verify(algo, path)` -> the metrics columns; unless nothing was trained yet), and
    mark the run INCOMPLETE with the reason. Returns (exit code, reason)."""
    i = algo.iteration
    if i > 0:
        path = os.path.join(run.checkpoints, ck.checkpoint_name(i))
        fresh = not os.path.isdir(path)
        if fresh:
            path = ck.save_checkpoint(algo, run.checkpoints, i, run.resolved_config)
        last = run.rows[-1] if run.rows else {}
        if fresh or not (last.get("iteration") == i and last.get("checkpoint/verified")):
            run.amend_last(verify(algo, path))
        ck.prune(run.checkpoints, keep)
    good = ck.latest_good_checkpoint(run.path)
    resume = (f"`moe-rl train --resume {run.location}` continues from {os.path.basename(good)}" if good
              else "no checkpoint yet: start the run again")
    reason = f"stopped by {stop.reason} after iteration {i}; {resume}"
    run.mark_incomplete(reason)
    return exit_code(stop.signum), reason
