import os
import secrets
import sys
import time

# Keep every Ray that the tests start on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray workers unpickle functions defined in test modules by module name: let them import tests/.
_tests = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_tests, os.environ.get("PYTHONPATH")) if p)

import pytest
import ray_processes

# Every process the suite starts (Ray heads, embedded Rays of CLI runs, workers) inherits this mark:
# at session end, none of them may be left (and none of anyone else's is touched).
SUITE_MARK = f"{os.getpid()}-{secrets.token_hex(4)}"
os.environ[ray_processes.SUITE_MARKER] = SUITE_MARK


@pytest.fixture(scope="module")
def ray_local():
    """A real local Ray for one test module, stopped afterwards."""
    import ray

    from moe_rl.app.train import start_local_ray
    # The product's own start: loopback, a Ray of the test's own (never another head on the host),
    # worker niceness 0 (beside the other pytest worker's drivers, niced actors starve, and a
    # test's time then measures the scheduler, not the code).
    start_local_ray(num_cpus=8)
    yield ray
    ray.shutdown()


@pytest.hookimpl(trylast=True)   # after -m/-k have chosen: the isolation test must really be in the run
def pytest_collection_modifyitems(config, items):
    """Files with slow tests first: the suite runs two files at a time (pytest-xdist, --dist loadfile),
    and a long file that starts last leaves one worker alone at the end. Stable within each group."""
    # Why the four head tests (test_ray_isolation.HEAD_TESTS) run in a nested pytest, and why they are
    # deselected here. test_ray_isolation checks that the way they start and stop Ray heads (`ray
    # start` in a process session of its own, stopped by killing that session; never `ray stop`)
    # leaves everyone else's Ray alone: an unrelated head and a `moe-rl train` in its own embedded Ray
    # must be running before the first head test starts, must survive the last one, and the held run
    # must then finish. That needs code before and after a set of tests in three files, and pytest
    # has no place for it: under xdist (--dist loadfile) the files go to different workers, in any
    # order, and a fixture lives in one worker. So the isolation test runs them itself, as a nested
    # pytest between starting its bystanders and checking them. Running them in this session as well
    # would start every head twice (minutes), so a session that has the isolation test drops them
    # here; the isolation test fails when one of them fails (their own assertions are judged last,
    # after the bystanders'). trylast: this runs after -k/-m have chosen, so they are dropped only when
    # the isolation test is really in the run; without it (one file, -k, -m pure) they run as usual.
    # The isolation test is the suite's longest (about 4 minutes here, 204-256 s): its file goes first
    # (setup.cfg keeps xdist from reordering), so no worker ends alone on it.
    isolation = [item for item in items
                 if item.name == "test_head_tests_leave_an_unrelated_head_and_a_training_run_alive"]
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    first = {item.path for item in isolation}
    items.sort(key=lambda item: (item.path not in first, item.path not in slow_files))
    if isolation:
        nested = set(isolation[0].module.HEAD_TESTS)
        deselected = [item for item in items if item.nodeid.rsplit("/", 1)[-1] in nested]
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = [item for item in items if item not in deselected]


def pytest_runtest_teardown(item):
    # Before the test's fixtures are torn down: an in-process Ray of a module fixture is still up.
    ray_processes.record(ray_processes.marked_ray_processes(SUITE_MARK))


def pytest_sessionfinish(session, exitstatus):
    """No Ray process the suite started is left running: checked by the recorded pids (with their
    start times) and by the suite's environment mark; any left are killed and the session fails."""
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()   # what Ray's atexit hook would do a moment later
    deadline = time.monotonic() + 30    # workers exit shortly after their raylet
    while True:
        left = {p.pid: p for p in ray_processes.recorded_alive() + ray_processes.marked_ray_processes(SUITE_MARK)}
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if left:
        sys.stderr.write(f"\nconftest: the suite left {len(left)} Ray process(es) running (now killed): "
                         f"{ray_processes.describe(left.values())}\n")
        for proc in left.values():
            try:
                proc.kill()
            except Exception:
                pass
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
