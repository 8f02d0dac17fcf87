"""The tests that start and stop Ray heads leave everyone else's Ray alone: an unrelated
head and a `moe-rl train` in its own embedded Ray run beside them, survive them, and the run
finishes. `ray stop` (what the head tests once used) would have killed both."""
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest
import ray_processes
from bystander_env import HOLD_FILE_ENV
from helpers import free_port

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
# One test per way a head is started and stopped with `ray start` (local_head; local_head with a
# job; the autoscaler's fake nodes; the Prometheus head). test_waits' give-up test uses the same
# local_head as the first: running it again here would only add minutes to the suite. When this test
# is in a session, the session runs these only here (conftest deselects them outside), and this test
# fails when one of them fails: each runs once, and is judged both on its own and as a neighbour.
HEAD_TESTS = ["test_waits.py::test_a_run_a_fixed_cluster_can_never_hold_fails_at_once_and_says_what_fits",
              "test_cluster.py::test_ray_job_submit_runs_the_quickstart",
              "test_cluster.py::test_autoscaler_adds_a_learner_node_and_removes_it_when_idle",
              "test_prometheus.py::test_a_real_ray_head_serves_the_exported_metrics"]


def _core(sid):
    """The GCS and raylet of session `sid`: {pid: create_time}."""
    return {p.pid: p.create_time() for p in ray_processes.session_processes(sid)
            if p.name().startswith(("gcs_server", "raylet"))}


def _alive(procs):
    """Every process of {pid: create_time} still runs (the same process, not a reused pid)."""
    try:
        return all(psutil.Process(pid).create_time() == t and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid, t in procs.items())
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_head_tests_leave_an_unrelated_head_and_a_training_run_alive(tmp_path):
    # The bystanders are not the suite's: no suite mark, no RAY_ADDRESS.
    user_env = {k: v for k, v in os.environ.items() if k not in (ray_processes.SUITE_MARKER, "RAY_ADDRESS")}
    user_env.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONPATH=os.pathsep.join([TESTS, ROOT]),
                    RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    bindir = os.path.dirname(sys.executable)
    head_dir = tempfile.mkdtemp(prefix="moerl-user-", dir="/tmp")
    port = free_port()
    head = subprocess.Popen([os.path.join(bindir, "ray"), "start", "--head", "--port", str(port), "--num-cpus", "1",
                             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(free_port()),
                             "--dashboard-agent-listen-port", str(free_port()), "--ray-client-server-port",
                             str(free_port()), "--temp-dir", head_dir, "--disable-usage-stats"],
                            env=user_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    head_sid, run = head.pid, None   # the head's processes keep the session of `ray start`
    hold, log_path, t0 = tmp_path / "hold", tmp_path / "run.log", time.monotonic()
    hold.touch()
    log = open(log_path, "w")
    try:
        out, _ = head.communicate(timeout=120)
        assert head.returncode == 0, out[-2000:]
        run = subprocess.Popen([sys.executable, "-m", "moe_rl.app.cli", "train", "--env", "bystander_env:HeldCartPole",
                                "--iterations", "500", "--output", str(tmp_path / "run"), "--set", "stop_return=5",
                                "--set", "training.train_batch_size_per_learner=200",
                                "--set", "training.minibatch_size=100", "--set", "training.num_epochs=1"],
                               env={**user_env, HOLD_FILE_ENV: str(hold)}, cwd=ROOT, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
        while "\niter" not in log_path.read_text():   # its embedded Ray is up and it trains
            assert run.poll() is None and time.monotonic() - t0 < 600, log_path.read_text()[-3000:]
            time.sleep(1)
        run_ray = {p.pid: p.create_time() for p in psutil.Process(run.pid).children(recursive=True)
                   if p.name().startswith(("gcs_server", "raylet"))}
        head_ray = _core(head_sid)
        assert len(run_ray) == 2 and len(head_ray) == 2, (run_ray, head_ray)
        nested = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 "-m", "",   # every named test, whatever setup.cfg's -m (they are slow)
                                 *[os.path.join(TESTS, t) for t in HEAD_TESTS]],
                                cwd=ROOT, capture_output=True, text=True, timeout=1800)
        # First what the head tests do to others; their own checks are judged at the end.
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed)", nested.stdout.splitlines()[-1])}
        assert sum(counts.values()) == len(HEAD_TESTS), nested.stdout[-3000:]
        print("the head tests:", nested.stdout.splitlines()[-1])
        assert run.poll() is None and _alive(run_ray), "the training run died beside the head tests"
        assert _alive(head_ray), "the unrelated head died beside the head tests"
        probe = subprocess.run([sys.executable, "-c", "import ray; ray.init(log_to_driver=False); "
                                "print('CPU', ray.cluster_resources()['CPU'])"],
                               env={**user_env, "RAY_ADDRESS": f"127.0.0.1:{port}"},
                               capture_output=True, text=True, timeout=120)
        assert "CPU 1.0" in probe.stdout, probe.stderr[-2000:]
        hold.unlink()   # rewards flow again: the run reaches stop_return and finishes on its own
        run.wait(600)
        assert run.returncode == 0 and "moe-rl: done" in log_path.read_text(), log_path.read_text()[-3000:]
        # Their own checks, judged last: the neighbours' survival above is this test's own question.
        assert counts.get("passed") == len(HEAD_TESTS), nested.stdout[-6000:]
    finally:
        if run is not None and run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(30)
        ray_processes.kill_session(head_sid)
        log.close()
        subprocess.run(["rm", "-rf", head_dir])
