"""A wait says what it waits for: resources that cannot be placed (the only wait that
cluster.wait_timeout_s ends), actors placed and still starting, and a learner's own step (a
compile says so). A real in-process Ray with 2 CPUs; actors stand in for the run's."""
import os
import signal
import subprocess
import sys
import time

import pytest
import ray
from helpers import free_port

from moe_rl.actors.startup import StartupReport, extension_builds, skip_unused_shm_comm_op
from moe_rl.algo.resources import Demand, ResourceWait, WaitWatch, startup_state
from moe_rl.app.train import start_local_ray


@pytest.fixture(scope="module")
def ray_2cpus():
    start_local_ray(num_cpus=2)
    yield
    ray.shutdown()


@ray.remote(num_cpus=1)
class SlowToStart:
    def __init__(self, seconds):
        time.sleep(seconds)

    def ping(self):
        return 1


@ray.remote(num_cpus=1)
class Learnerish:
    """Reports its steps as a learner does; a build lock appears meanwhile (the lock torch's
    extension builder holds while it compiles)."""

    def build(self, ext_dir, seconds):
        os.environ["TORCH_EXTENSIONS_DIR"] = ext_dir
        with StartupReport(ray.get_runtime_context().get_job_id(), "learner 0", poll_s=0.2) as report:
            report.step("building its DeepSpeed engines")
            time.sleep(1)
            os.makedirs(os.path.join(ext_dir, "some_op"))
            open(os.path.join(ext_dir, "some_op", "lock"), "w").close()
            time.sleep(seconds)
        return 1


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMAND = Demand([("actor", 1, {"CPU": 1.0})])


def test_a_slow_start_is_not_a_missing_resource(ray_2cpus):
    """Placed at once, 12 s in its constructor: the watch says so and never gives up (timeout 3 s)."""
    lines = []
    with WaitWatch(DEMAND, timeout_s=3, every_s=4, printer=lambda s, **_: lines.append(s), poll_s=0.5) as watch:
        actor = SlowToStart.remote(12)
        assert ray.get(actor.ping.remote()) == 1
    assert watch.unplaced_s < 3, lines
    assert any("placed, still starting: SlowToStart (its process and constructor)" in line for line in lines), lines
    assert not any("waiting" in line and "for resources" in line for line in lines), lines
    ray.kill(actor)


def test_a_learner_step_and_a_compile_are_named(ray_2cpus, tmp_path):
    lines = []
    with WaitWatch(DEMAND, timeout_s=2, every_s=2.5, printer=lambda s, **_: lines.append(s), poll_s=0.5):
        actor = Learnerish.remote()
        assert ray.get(actor.build.remote(str(tmp_path), 6)) == 1
    text = "\n".join(lines)
    assert "learner 0: compiling the C++ extension some_op (torch JIT build, once per install" in text, text
    assert "cluster.wait_timeout_s counts only resources that cannot be placed" in text
    assert startup_state(ray.get_runtime_context().get_job_id()).starting == []   # the report is gone
    ray.kill(actor)


@pytest.mark.parametrize("sigint", ["handled", "ignored"])
def test_resources_that_cannot_be_placed_end_the_wait(ray_2cpus, sigint):
    """Also with SIGINT ignored, as in a script's background job or a pytest-xdist worker (the
    give-up interrupts the main thread; it waited forever there)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler if sigint == "handled" else signal.SIG_IGN)
    try:
        _give_up()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert signal.getsignal(signal.SIGINT) is previous


def _give_up():
    lines = []
    t0 = time.monotonic()
    with pytest.raises(ResourceWait):
        with WaitWatch(Demand([("actor", 1, {"CPU": 4.0})]), timeout_s=4, every_s=2,
                       printer=lambda s, **_: lines.append(s), poll_s=0.5):
            big = SlowToStart.options(num_cpus=4).remote(0)
            ray.get(big.ping.remote())
    assert time.monotonic() - t0 < 120   # a hang guard: the give-up itself is pytest.raises above
    assert any("for resources: not placed yet: 1 x SlowToStart" in line and "giving up in" in line
               for line in lines), lines
    ray.kill(big)


def test_the_shm_comm_op_is_switched_off_unless_asked_for(monkeypatch):
    import deepspeed.ops
    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm", True)
    monkeypatch.setenv("MOE_RL_DEEPSPEED_SHM_COMM", "build")
    assert not skip_unused_shm_comm_op() and deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"]
    monkeypatch.delenv("MOE_RL_DEEPSPEED_SHM_COMM")
    assert skip_unused_shm_comm_op() and not deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"]


def test_extension_builds_reads_torchs_build_locks(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extension_builds() == {}
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "lock").touch()
    assert list(extension_builds()) == ["deepspeed_shm_comm"]


JOIN = """
import os, sys
from moe_rl.actors.startup import skip_unused_shm_comm_op
skip_unused_shm_comm_op()
import deepspeed
deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False, rank=0, world_size=1)
print("JOINED", flush=True)
"""


def test_a_process_group_starts_beside_a_killed_builds_lock(tmp_path):
    """What a learner does first, in a fresh process: with the shm comm op skipped, DeepSpeed's
    process group starts at once though a killed build left its lock (torch's builder would wait on
    it forever: run with MOE_RL_DEEPSPEED_SHM_COMM=build to see it hang), and nothing is compiled."""
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "lock").touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    env.pop("MOE_RL_DEEPSPEED_SHM_COMM", None)
    p = subprocess.run([sys.executable, "-c", JOIN], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "JOINED" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert sorted(str(f.relative_to(tmp_path)) for f in tmp_path.rglob("*")) == [
        "deepspeed_shm_comm", "deepspeed_shm_comm/lock"]
