"""A real Ray cluster of two hosts on one machine (tests/netns.py: network namespaces on a bridge,
198.18.0.0/24; host A the head, host B a worker node, host C an outsider), everything run inside
the hosts with token auth on:
- `ray job submit` of expert-parallel MoE-PPO (2 learners, ep_size 2, one learner per host,
  rollout actors on both, the collective weight sync over gloo): it trains, the check passes, every
  socket moe-rl listens on is on its host's own address, and the final weights are bit for bit
  those of the same run on one host;
- a host without the token cannot join, submit a job or read the KV store; one with it can;
- MoE-APPO (expert-parallel) and MoE-DQN (its learner on host B) across the two hosts;
- host B lost mid-run (link down, every process SIGKILLed): the run rebuilds its learners on host A
  from the newest checkpoint and finishes, having lost only the iteration in flight.
The tests share one cluster (starting it took 18-43 s here); the lost host goes last."""
import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import netns
import pyarrow.parquet as pq
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow

# Host A has room for both learners (and its rollout actor): where the group is rebuilt when host B
# is lost. SPREAD puts one learner on each host while both are there.
# host_b: where MoE-DQN's one learner goes (RLlib's learner group: the DeepSpeed group does not serve DQN).
HOST_A = {"moe_learner": 2, "moe_rollout": 1}
HOST_B = {"moe_learner": 1, "moe_rollout": 1, "host_b": 1}
RUN = ["--iterations", "2", "--seed", "0", "--num-learners", "2", "--ep-size", "2", "--num-env-runners", "2",
       "--set", "stop_return=null", "--set", "training.train_batch_size_per_learner=500",
       "--set", "training.minibatch_size=125", "--set", "moe.num_experts=4", "--set", "checkpoint_every=1",
       "--set", "weight_sync.transport=collective"]
# The head's GCS marks a silent node dead after 3 missed health checks, 2 s apart, 5 s each: about
# 21 s. Ray's defaults (5 of them, 3 s apart, 10 s each) took 65 s here; as short as this, a
# loaded 2-core machine still answers every check in time.
HEALTH_CHECKS = {"RAY_health_check_period_ms": "2000", "RAY_health_check_timeout_ms": "5000",
                 "RAY_health_check_failure_threshold": "3"}
# MoE-APPO's own config (an iteration is at least 10 s of updates), expert-parallel like RUN.
APPO_RUN = ["--config", "configs/appo_cartpole.yaml", "--iterations", "1", "--seed", "0", "--num-learners", "2",
            "--ep-size", "2", "--set", "stop_return=null", "--set", "moe.num_experts=4", "--set", "checkpoint_every=1",
            "--set", "weight_sync.transport=collective"]
# MoE-DQN's own config: its learner on host B, the driver on A, a rollout actor on each.
DQN_RUN = ["--config", "configs/dqn_cartpole.yaml", "--iterations", "2", "--seed", "0", "--num-learners", "1",
           "--num-env-runners", "2", "--set", "stop_return=null", "--set", "checkpoint_every=1",
           "--set", "learners.custom_resources_per_learner={host_b: 1}",
           "--set", "env_runners.custom_resources_per_env_runner={moe_rollout: 1}"]
ACROSS_HOSTS = ["--set", "learners.custom_resources_per_learner={moe_learner: 1}",
                "--set", "env_runners.custom_resources_per_env_runner={moe_rollout: 1}",
                "--set", "deepspeed.placement_strategy=SPREAD"]


def note(text):
    """A figure for the CI log (.ci/run prints these at the end) and this test's output."""
    print(text)
    if os.environ.get("MOE_RL_CI_NOTES"):
        with open(os.environ["MOE_RL_CI_NOTES"], "a") as f:
            f.write(f"tests/test_two_hosts.py: {text}\n")


@pytest.fixture(scope="module")
def hosts():
    reason = netns.unavailable()
    if reason:
        if os.environ.get("MOE_RL_CI_RUN"):
            pytest.fail(f"CI must run the two-host tests, but network namespaces cannot be made: {reason}")
        pytest.skip(f"network namespaces cannot be made here: {reason}")
    t0 = time.monotonic()
    with netns.Hosts(["a", "b", "c"]) as h:
        made = time.monotonic() - t0
        h.start_head("a", "--num-cpus", "3", "--resources", json.dumps(HOST_A), env=HEALTH_CHECKS)
        h.join("b", "--num-cpus", "2", "--resources", json.dumps(HOST_B))
        note(f"two-host cluster: namespaces and links {made:.2f}s, both Rays up in {time.monotonic() - t0:.0f}s")
        yield h


# --- a job and what it opened ------------------------------------------------------------------------
def submit(hosts, args, on_line=None, timeout=900):
    """`ray job submit` from host A of `moe-rl train ARGS`; on_line(line) sees each line as it
    comes. Returns (exit code, output)."""
    for _ in range(24):   # the head's job agent may still be starting on a loaded machine
        job = hosts.popen("a", ["ray", "job", "submit", "--address", hosts.dashboard, "--working-dir", ROOT,
                                "--", "moe-rl", "train", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        timer = threading.Timer(timeout, job.kill)
        timer.start()
        lines = []
        try:
            for line in job.stdout:
                lines.append(line)
                if on_line is not None:
                    on_line(line)
            job.wait()
        finally:
            timer.cancel()
        output = "".join(lines)
        if "No available agent to submit job" not in output:
            return job.returncode, output
        time.sleep(5)
    return job.returncode, output


class SocketWatch:
    """`ss -ltnp` on hosts A and B twice a second while a run goes: every listening TCP socket seen,
    with the title its process had then (ray::LearnerActor..., ray::SingleAgentEnvRunner...)."""

    def __init__(self, hosts):
        self.hosts, self.seen = hosts, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.5):
            for host in ("a", "b"):
                for row in self.hosts.listening(host):
                    for pid in row["pids"]:
                        try:
                            with open(f"/proc/{pid}/cmdline") as f:
                                title = f.read().split("\0")[0]
                        except OSError:
                            continue
                        self.seen.add((host, row["address"], row["port"], pid, title))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)

    def moe_rl_sockets(self, role):
        """{host: {pid: {(address, port)}}} of the learners ("LearnerActor") or rollout actors
        ("EnvRunner"), without Ray's own worker port (each worker's gRPC server, Ray's range)."""
        out = {}
        for host, address, port, pid, title in self.seen:
            if title.startswith("ray::") and role in title and not netns.is_ray_worker_port(port):
                out.setdefault(host, {}).setdefault(pid, set()).add((address, port))
        return out


def final_weights(run, iteration):
    """{(module id, global name): tensor} of every learner's published part of checkpoint `iteration`."""
    parts = {}
    folder = run / "checkpoints" / f"iter_{iteration:06d}" / "learner_group"
    for path in sorted(folder.glob("module_shard_rank*.pt")):
        for mid, state in torch.load(path, weights_only=True).items():
            parts.update({(mid, name): t for name, t in state.items()})
    return parts


def rows(path):
    return pq.read_table(path).to_pylist()


# --- an outsider -------------------------------------------------------------------------------------
KV_READ = ("import ray\nfrom ray.experimental import internal_kv\n"
           "ray.init(address='{gcs}', log_to_driver=False)\n"
           "print('KEYS', len(internal_kv._internal_kv_list('')))\n")
HTTP_SUBMIT = ("import json, urllib.request, urllib.error\n"
               "r = urllib.request.Request('{url}', data=json.dumps({{'entrypoint': 'echo outsider'}}).encode(),\n"
               "                           headers={{'Content-Type': 'application/json'}}, method='POST')\n"
               "try:\n    print('HTTP', urllib.request.urlopen(r, timeout=30).status)\n"
               "except urllib.error.HTTPError as e:\n    print('HTTP', e.code)\n")


def test_a_host_without_the_token_cannot_join_submit_or_read_the_kv_store(hosts):
    """Host C reaches the cluster's network. Without the token (none at all, as a stranger's machine,
    or a wrong one) every door is shut: `ray start --address`, `ray job submit`, a raw POST to the
    head's job API and to the dashboard agent's, ray.init + the KV store. With the token, it joins.
    The refused attempts run at once: each refused connection to the GCS retries for about 20 s."""
    t0 = time.monotonic()
    agent = f"http://{hosts.ip['a']}:52365/api/job_agent/jobs/"
    outsiders = {"no token": hosts.env("c", token=None), "a wrong token": hosts.env("c", token=secrets.token_hex(32))}
    attempts = {}
    for label, env in outsiders.items():
        attempts[label, "join"] = lambda env=env, label=label: hosts.join(
            "c", "--num-cpus", "1", env=env, check=False, timeout=180, temp_name=f"c-{label.split()[-2]}")
        attempts[label, "submit"] = lambda env=env: hosts.run(
            "c", ["ray", "job", "submit", "--address", hosts.dashboard, "--", "echo", "outsider"], env=env, timeout=180)
        for door, url in (("POST to the head", f"{hosts.dashboard}/api/jobs/"), ("POST to the agent", agent)):
            attempts[label, door] = lambda env=env, url=url: hosts.run(
                "c", [sys.executable, "-c", HTTP_SUBMIT.format(url=url)], env=env, timeout=120)
        attempts[label, "KV"] = lambda env=env: hosts.run(
            "c", [sys.executable, "-c", KV_READ.format(gcs=hosts.gcs)], env=env, timeout=180)
    with ThreadPoolExecutor(len(attempts)) as pool:
        results = dict(zip(attempts, pool.map(lambda attempt: attempt(), attempts.values())))
    hosts.stop_ray("c")   # whatever a refused `ray start` left
    for (label, door), p in results.items():
        said = p.stdout + p.stderr
        if door.startswith("POST"):
            assert re.search(r"^HTTP 40[13]$", p.stdout, re.M), (label, door, said[-2000:])
        else:
            refused = p.returncode != 0 and "Authentication" in said and "KEYS" not in p.stdout
            assert refused, (label, door, said[-2000:])
    assert hosts.alive_nodes() == [hosts.ip["a"], hosts.ip["b"]]   # nobody joined
    # The same host with the token: everything the outsider was refused works.
    p = hosts.run("c", [sys.executable, "-c", KV_READ.format(gcs=hosts.gcs)], timeout=180)
    assert p.returncode == 0 and re.search(r"^KEYS [1-9]", p.stdout, re.M), p.stderr[-2000:]
    p = hosts.run("c", ["ray", "job", "submit", "--address", hosts.dashboard, "--", "echo", "insider"], timeout=180)
    assert p.returncode == 0 and "insider" in p.stdout, p.stdout[-2000:]
    hosts.join("c", "--num-cpus", "1")
    try:
        assert hosts.alive_nodes() == [hosts.ip["a"], hosts.ip["b"], hosts.ip["c"]]
    finally:
        hosts.stop_ray("c")
    note(f"outsider test: {time.monotonic() - t0:.0f}s")


# --- expert parallelism across the hosts -------------------------------------------------------------
def test_moe_ppo_trains_across_two_hosts_with_the_weights_of_one(hosts, tmp_path):
    t0 = time.monotonic()
    cross, single = tmp_path / "cross", tmp_path / "single"
    with SocketWatch(hosts) as watch:
        rc, out = submit(hosts, [*RUN, *ACROSS_HOSTS, "--output", str(cross)])
    assert rc == 0 and "succeeded" in out.lower(), out[-4000:]
    assert "Ray listens on 198.18.0.1, 198.18.0.2" in out and "iter    2" in out, out[-4000:]
    metrics = rows(cross / "metrics.parquet")
    assert [r["iteration"] for r in metrics] == [1, 2]
    # The weights went over the collective groups across the hosts, never the object store's fallback.
    assert all(r["sync/collective_fallbacks"] == 0 for r in metrics), [r["sync/collective_fallbacks"] for r in metrics]
    checks = rows(cross / "drift.parquet")
    assert checks and all(c["decision"] == "sync" for c in checks), [(c["decision"], c["reason"]) for c in checks]
    assert max(abs(c["k3"]) for c in checks) < 1e-9 and max(c["max_abs_logp_diff"] for c in checks) < 1e-5

    # One learner per host, rollout actors on both; every socket they listen on (the learners'
    # TCPStore and gloo pairs, the sync groups' store and pairs) is on the host's own address.
    learners, rollouts = watch.moe_rl_sockets("LearnerActor"), watch.moe_rl_sockets("EnvRunner")
    for role, found in (("learner", learners), ("rollout actor", rollouts)):
        assert sorted(found) == ["a", "b"] and all(len(pids) == 1 for pids in found.values()), (role, found)
        for host, pids in found.items():
            for pid, sockets in pids.items():
                assert sockets and {address for address, _ in sockets} == {hosts.ip[host]}, (role, host, sockets)
    note("sockets moe-rl listened on: " + "; ".join(
        f"{role} on {host}: {len(socks)}" for role, found in (("learner", learners), ("rollout", rollouts))
        for host, pids in sorted(found.items()) for socks in pids.values()))

    # The same run on one host (the embedded Ray on host A's loopback), then the final weights.
    env = {**hosts.env("a"), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    p = hosts.run("a", ["moe-rl", "train", *RUN, "--output", str(single)], env=env, cwd=ROOT, timeout=900)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    a, b = final_weights(cross, 2), final_weights(single, 2)
    assert a.keys() == b.keys() and len(a) > 0
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, {k: float((a[k] - b[k]).abs().max()) for k in differ}
    cross_rows, single_rows = rows(cross / "metrics.parquet"), rows(single / "metrics.parquet")
    note("two hosts vs one, per iteration: " + "; ".join(
        f"learn {c['learn_s']:.2f}s vs {s['learn_s']:.2f}s, sync {c['sync_s']:.3f}s vs {s['sync_s']:.3f}s"
        for c, s in zip(cross_rows, single_rows)))
    note(f"MoE-PPO across two hosts, then on one, final weights equal: {time.monotonic() - t0:.0f}s")


def test_moe_appo_trains_across_two_hosts(hosts, tmp_path):
    t0 = time.monotonic()
    run = tmp_path / "appo"
    with SocketWatch(hosts) as watch:
        rc, out = submit(hosts, [*APPO_RUN, *ACROSS_HOSTS, "--output", str(run)])
    assert rc == 0 and "succeeded" in out.lower(), out[-4000:]
    metrics = rows(run / "metrics.parquet")
    assert [r["iteration"] for r in metrics] == [1] and metrics[-1]["env_steps_total"] > 0
    assert all(r["sync/collective_fallbacks"] == 0 for r in metrics)
    learners = watch.moe_rl_sockets("LearnerActor")
    assert sorted(learners) == ["a", "b"], learners
    note(f"MoE-APPO across two hosts: {time.monotonic() - t0:.0f}s")


def test_moe_dqn_trains_across_two_hosts(hosts, tmp_path):
    t0 = time.monotonic()
    run = tmp_path / "dqn"
    rc, out = submit(hosts, [*DQN_RUN, "--output", str(run)])
    assert rc == 0 and "succeeded" in out.lower(), out[-4000:]
    metrics = rows(run / "metrics.parquet")
    assert [r["iteration"] for r in metrics] == [1, 2] and metrics[-1]["env_steps_total"] > 0
    assert (run / "checkpoints" / "iter_000002").is_dir()
    note(f"MoE-DQN across two hosts: {time.monotonic() - t0:.0f}s")


# --- a host lost ------------------------------------------------------------------------------------
def test_a_lost_host_costs_the_iteration_in_flight_and_the_run_finishes(hosts, tmp_path):
    """Host B (a learner, a rollout actor) lost after iteration 2: its link down, then its processes
    SIGKILLed, so nothing on A hears a reset. The learner on A waits in its collective until Ray
    marks B's node dead (its health checks); the learner update then fails naming B's learner, the
    run rebuilds the whole group on host A (room for both) and restores iteration 2's checkpoint,
    and the remaining rollout actor fills the batches. Runs last: the cluster keeps one host."""
    t0 = time.monotonic()
    run = tmp_path / "lost"
    state = {"lost_at": None, "printed": []}

    def on_line(line):
        m = re.match(r"iter +(\d+) ", line)
        if m:
            state["printed"].append(int(m[1]))
            if int(m[1]) == 2 and state["lost_at"] is None:
                hosts.lose("b")
                state["lost_at"] = time.monotonic()
        for event, said in (("marked dead", "has been marked dead"), ("rebuilt", "rebuilt the learner group")):
            if said in line and state["lost_at"] is not None:
                state.setdefault(event, time.monotonic() - state["lost_at"])

    args = [*RUN, *ACROSS_HOSTS, "--output", str(run)]
    args[args.index("--iterations") + 1] = "4"
    rc, out = submit(hosts, args, on_line=on_line)
    assert state["lost_at"] is not None, out[-4000:]
    assert rc == 0 and "succeeded" in out.lower(), out[-4000:]
    restored = re.search(r"moe-rl: learner (\d) died; rebuilt the learner group and restored \S+iter_(\d+) "
                         r"\(iteration (\d+)\)", out)
    assert restored and int(restored[2]) == int(restored[3]) == 2, out[-4000:]   # the newest checkpoint
    metrics = rows(run / "metrics.parquet")
    assert [r["iteration"] for r in metrics] == [1, 2, 3, 4]       # no row twice, none missing
    assert metrics[-1]["faults/learner_restarts"] == 1
    assert metrics[-1]["faults/env_runner_failures"] == 1   # B's rollout actor, lost outside a sample too
    assert [c["iteration"] for c in rows(run / "drift.parquet")] == [1, 2, 3, 4]
    assert not (run / "INCOMPLETE").exists()
    assert state["printed"] == [1, 2, 3, 4]   # iteration 3 ran once to its end: only its first try was lost
    assert hosts.alive_nodes() == [hosts.ip["a"]]
    note(f"lost host: learner {restored[1]} lost; node marked dead after {state.get('marked dead', -1):.0f}s, "
         f"group rebuilt and restored after {state.get('rebuilt', -1):.0f}s, run finished after "
         f"{time.monotonic() - state['lost_at']:.0f}s; test {time.monotonic() - t0:.0f}s")
