import os

# Keep every Ray that the tests start on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray workers unpickle functions defined in test modules by module name: let them import tests/.
_tests = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_tests, os.environ.get("PYTHONPATH")) if p)

import pytest


@pytest.fixture(scope="module")
def ray_local():
    """A real local Ray for one test module, stopped afterwards."""
    import ray
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
