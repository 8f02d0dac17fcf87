"""No silent waits: the run says what it needs and what the cluster has, refuses a run a fixed
cluster can never hold, gives up cleanly when its actors cannot be placed in time, and Tune
reserves exactly what the DeepSpeed learner group asks for. Real local heads (`ray start`)."""
import json
import os
import subprocess
import sys

import pytest
from helpers import free_port, local_head

from moe_rl import MoEPPO, MoEPPOConfig
from moe_rl.rllib.learner_group import learner_bundles

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--set", "stop_return=null", "--set", "training.train_batch_size_per_learner=200",
        "--set", "training.minibatch_size=100", "--set", "moe.num_experts=4", "--set", "moe.d_model=16",
        "--set", "moe.d_ff=16"]
# Every actor the cluster has had, dead ones too, and its placement groups.
ACTORS = ("import ray, json\n"
          "from ray.util.state import list_actors, list_placement_groups\n"
          "ray.init(log_to_driver=False)\n"
          "print(json.dumps({'actors': [(a.class_name, a.state) for a in list_actors()],\n"
          "                  'pgs': [p.state for p in list_placement_groups()]}))\n")


def moe_rl_cli(env, *args, timeout=300):   # a hang guard: what the runs do is asserted, not their time
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "moe-rl"), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def cluster_actors(env):
    out = subprocess.run([sys.executable, "-c", ACTORS], env=env, capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def leftovers(env):
    """What is still alive: actors not dead, placement groups not removed."""
    seen = cluster_actors(env)
    return {"actors": [name for name, state in seen["actors"] if state != "DEAD"],
            "pgs": [state for state in seen["pgs"] if state != "REMOVED"]}


@pytest.mark.slow
def test_a_run_a_fixed_cluster_can_never_hold_fails_at_once_and_says_what_fits(tmp_path):
    """The issue's case: a 2-CPU head, 1 env runner + 2 learners (ep_size 2). "At once": before
    the algorithm is built, so no actor of the run (learner, env runner) was ever started, not a
    time, which depends on the machine (one slower than ours took 65 s)."""
    with local_head("--port", str(free_port()), "--num-cpus", "2") as (_, env, _address):
        out = tmp_path / "run"
        p = moe_rl_cli(env, "train", "--num-learners", "2", "--ep-size", "2", "--output", str(out), *TINY)
        assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
        assert "moe-rl: building the algorithm" not in p.stdout, p.stdout[-2000:]
        assert cluster_actors(env) == {"actors": [], "pgs": []}   # none ever, dead ones included
        assert "this run needs CPU 3: 1 x env runner (CPU 1); 2 x learner (CPU 1)" in p.stdout
        assert "The cluster has CPU 2 in total" in p.stdout
        error = p.stderr.strip().splitlines()[-1]
        assert error.startswith("moe-rl: error: this fixed cluster can never hold the run: it lacks CPU 1")
        assert "learners.num_cpus_per_learner=0.5" in error
        assert (out / "INCOMPLETE").read_text().startswith("this fixed cluster can never hold the run")


@pytest.mark.slow
def test_a_run_that_waits_says_so_and_gives_up_cleanly(tmp_path):
    """The cluster could hold the run, but another job holds the CPUs: progress lines while the
    actors wait, then exit 1 at cluster.wait_timeout_s with nothing of the run left behind."""
    with local_head("--port", str(free_port()), "--num-cpus", "3") as (_, env, _address):
        hog = subprocess.Popen([sys.executable, "-c",
                                "import ray, time\nray.init(log_to_driver=False)\n"
                                "@ray.remote(num_cpus=2)\nclass Hog:\n    def ok(self): return 1\n"
                                "h = Hog.remote(); ray.get(h.ok.remote()); print('HOG', flush=True)\n"
                                "time.sleep(600)\n"],
                               env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert hog.stdout.readline().strip() == "HOG"
            out = tmp_path / "run"
            p = moe_rl_cli(env, "train", "--num-learners", "2", "--ep-size", "2",
                           "--output", str(out), "--set", "cluster.wait_timeout_s=8", *TINY)
            assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
            assert "moe-rl: waiting" in p.stdout and "no autoscaler" in p.stdout and "giving up in" in p.stdout
            error = p.stderr.strip().splitlines()[-1]
            assert error.startswith("moe-rl: error: gave up after 8s waiting for") and "CPU" in error
            assert (out / "INCOMPLETE").is_file()
            left = leftovers(env)
            assert left["actors"] == ["Hog"] and left["pgs"] == []
        finally:
            hog.kill()


def test_tune_reserves_exactly_what_the_deepspeed_group_asks_for():
    config = (MoEPPOConfig().environment("CartPole-v1").env_runners(num_env_runners=1)
              .learners(num_learners=2, custom_resources_per_learner={"moe_learner": 1})
              .moe(num_experts=4, ep_size=2))
    request = MoEPPO.default_resource_request(config)
    assert request.bundles[-2:] == learner_bundles(config) == [{"CPU": 1.0, "moe_learner": 1.0}] * 2


@pytest.mark.slow
def test_a_tune_trial_of_the_ep_group_runs_in_its_own_reservation():
    """Exactly the trial's request in logical CPUs: the learners take the trial's learner bundles
    (a second placement group would wait forever)."""
    import ray
    from ray import tune

    from moe_rl.app.train import start_local_ray
    config = (MoEPPOConfig().environment("CartPole-v1").env_runners(num_env_runners=1, num_envs_per_env_runner=2)
              .training(train_batch_size_per_learner=200, minibatch_size=100, num_epochs=1)
              .learners(num_learners=2).moe(num_experts=4, ep_size=2, d_model=16, d_ff=16))
    cpus = sum(b.get("CPU", 0) for b in MoEPPO.default_resource_request(config).bundles)
    start_local_ray(num_cpus=cpus)
    try:
        results = tune.Tuner(MoEPPO, param_space=config, run_config=tune.RunConfig(
            stop={"training_iteration": 1}, verbose=0, storage_path=os.path.join(ROOT, ".pytest_tune"))).fit()
        assert not results.errors and results[0].metrics["training_iteration"] == 1
    finally:
        ray.shutdown()
        subprocess.run(["rm", "-rf", os.path.join(ROOT, ".pytest_tune")])
