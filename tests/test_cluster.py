"""Cluster files validated with Ray's own validator, and `ray job submit` against a real local head."""
import json
import os
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import yaml
from helpers import free_port, local_head
from ray.autoscaler._private.util import validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(path):
    with open(os.path.join(ROOT, path)) as f:
        return yaml.safe_load(f)


RUN = load("configs/cluster.yaml")
WANTED = {"rollout": set(RUN["env_runners"]["custom_resources_per_env_runner"]),
          "learner": set(RUN["learners"]["custom_resources_per_learner"])}


@pytest.mark.parametrize("path", ["cluster/aws.yaml", "cluster/gcp.yaml"])
def test_launcher_yaml_passes_rays_validator_and_matches_the_run_config(path):
    cfg = load(path)
    validate_config(cfg)  # raises on any schema violation
    types = cfg["available_node_types"]
    assert cfg["idle_timeout_minutes"] > 0 and cfg["max_workers"] >= sum(t["max_workers"] for t in types.values())
    rollout = [t for t in types.values() if WANTED["rollout"] <= set(t["resources"])]
    learner = [t for t in types.values() if WANTED["learner"] <= set(t["resources"])]
    assert rollout and all("GPU" not in t["resources"] for t in rollout)
    assert learner and all(t["resources"].get("GPU", 0) >= 1 for t in learner)
    assert any("pip install" in c for c in cfg["setup_commands"])


def test_kuberay_cluster_autoscales_with_the_same_node_types():
    cfg = load("cluster/kuberay.yaml")
    assert cfg["apiVersion"] == "ray.io/v1" and cfg["kind"] == "RayCluster"
    assert cfg["spec"]["enableInTreeAutoscaling"] is True
    groups = {g["groupName"]: g for g in cfg["spec"]["workerGroupSpecs"]}
    for name, wanted in (("rollout-cpu", WANTED["rollout"]), ("learner-gpu", WANTED["learner"])):
        g = groups[name]
        assert 0 <= g["minReplicas"] <= g["maxReplicas"]
        resources = json.loads(json.loads(g["rayStartParams"]["resources"]))
        assert wanted <= set(resources)
    gpu = groups["learner-gpu"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(gpu["nvidia.com/gpu"]) >= 1


def test_cluster_run_config_is_valid():
    from moe_rl.app.run_config import validate_run_config
    config = validate_run_config(RUN)
    assert config.uses_deepspeed and config.custom_resources_per_learner == {"moe_learner": 1}


@pytest.mark.slow
def test_ray_job_submit_runs_the_quickstart(tmp_path):
    """A real local head (loopback only), `ray job submit` of two quickstart iterations, then
    `ray stop`. The job must SUCCEED and leave a complete run directory."""
    with local_head("--port", str(free_port()), "--num-cpus", "4") as (ray_cli, env, address):
        out = tmp_path / "run"
        for _ in range(24):   # the head's job agent may still be starting on a loaded machine (up to 2 min)
            p = subprocess.run(
                [ray_cli, "job", "submit", "--address", address, "--working-dir", ROOT, "--",
                 "moe-rl", "train", "--iterations", "2", "--output", str(out), "--set", "stop_return=null",
                 "--set", "training.train_batch_size_per_learner=500", "--set", "training.minibatch_size=125"],
                env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
            if "No available agent to submit job" not in p.stdout + p.stderr:
                break
            time.sleep(5)
        assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
        assert "succeeded" in (p.stdout + p.stderr).lower()  # "Job 'raysubmit_…' succeeded"
        assert "iter    2" in p.stdout  # logs streamed back
        assert pq.read_table(out / "metrics.parquet").num_rows == 2
        assert (out / "config.yaml").is_file() and (out / "drift.parquet").is_file()
        assert os.listdir(out / "checkpoints") == ["iter_000002"]


@pytest.mark.slow
def test_autoscaler_adds_a_learner_node_and_removes_it_when_idle(tmp_path):
    """cluster/local.yaml (Ray's fake_multinode provider): the head has no `moe_learner`, so the
    learner group's placement group makes the autoscaler add a `learner` node; the job completes
    and the idle node goes away. (fake_multinode nodes join the head at the default port 6379.)"""
    with local_head("--port", "6379", "--num-cpus", "3",
                    f"--autoscaling-config={os.path.join(ROOT, 'cluster/local.yaml')}",
                    start_env={"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}) as (ray_cli, env,
                                                                                             address):
        out = tmp_path / "run"
        p = subprocess.run(
            [ray_cli, "job", "submit", "--address", address, "--working-dir", ROOT, "--",
             "moe-rl", "train", "--iterations", "2", "--output", str(out), "--num-learners", "2", "--ep-size", "2",
             "--set", "stop_return=null", "--set", "training.train_batch_size_per_learner=300",
             "--set", "training.minibatch_size=100", "--set", "moe.num_experts=4",
             "--set", "learners.custom_resources_per_learner={moe_learner: 1}"],
            env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert p.returncode == 0 and "succeeded" in (p.stdout + p.stderr).lower(), p.stdout[-3000:]
        assert pq.read_table(out / "metrics.parquet").num_rows == 2
        probe = ("import ray, time\n"
                 "ray.init(address='127.0.0.1:6379', log_to_driver=False)\n"
                 # A node beside the head, alive or already gone (a dead node lists no resources): the
                 # head has no moe_learner, so the job's learners ran on the node the autoscaler added.
                 "added = len(ray.nodes()) > 1\n"
                 "t = time.time()\n"
                 # idle_timeout_minutes 0.1: the wait is a hang guard, generous for a busy machine
                 "while time.time() - t < 240 and sum(n['Alive'] for n in ray.nodes()) > 1:\n"
                 "    time.sleep(1)\n"
                 "print('ADDED', added, 'ALIVE', sum(n['Alive'] for n in ray.nodes()))\n")
        q = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
        assert "ADDED True ALIVE 1" in q.stdout, (q.stdout, q.stderr[-2000:])
