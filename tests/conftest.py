import os

# Keep every Ray that the tests start on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import pytest


@pytest.fixture(scope="module")
def ray_local():
    """A real local Ray for one test module, stopped afterwards."""
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
