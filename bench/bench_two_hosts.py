"""Two hosts against one, on the test suite's two-host harness (tests/netns.py: network namespaces
on a bridge, one machine): the DeepSpeed expert-parallel step (its MoE all-to-all and gradient
all-reduce) and the collective weight sync, with the learners (and rollout actors) on one host or
one on each; and which ports the hosts opened to each other while a run went.

    sudo .venv/bin/python bench/bench_two_hosts.py [--experts 16] [--tokens 1024] [--steps 5] [--json OUT]

Host A (the head, 4 CPUs) and host B (2 CPUs). Layout "one host": both learners and both rollout
actors on A (resource host_a); "two hosts": one of each per host (resources moe_learner and
moe_rollout, one of each per host). Per layout:
- the learner step (bench/bench_learner.py's timed_steps: PPO-shaped fwd + bwd, the all-reduce
  timed apart, Adam; the share of the step in DeepSpeed's all-to-all timers);
- `moe-rl train` of 3 iterations of a model of --experts experts (d_model 256, d_ff 1024, 2 layers)
  with `weight_sync.transport=collective`, checks off: the iterations' sync_s and learn_s
  (metrics.parquet), the median of iterations 2-3.
The "hosts" share one machine's cores and memory: the cross-host figures add the veth/bridge path
and a second raylet, not a real network's bandwidth or latency.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

HOST_A = {"host_a": 10, "moe_learner": 1, "moe_rollout": 1}
HOST_B = {"moe_learner": 1, "moe_rollout": 1}
LAYOUTS = {"one host": ("host_a", "host_a"), "two hosts": ("moe_learner", "moe_rollout")}


def learner_steps(resource, experts, tokens, steps):
    """In a driver on host A: two expert-parallel learners asking for `resource`, timed_steps on each."""
    import gymnasium as gym
    import numpy as np
    import ray
    import torch
    from bench_learner import timed_steps

    from moe_rl import MoEPPOConfig
    ray.init(log_to_driver=False)
    cfg = (MoEPPOConfig().environment("CartPole-v1")
           .training(lr=1e-4, minibatch_size=tokens, train_batch_size_per_learner=tokens)
           .learners(num_learners=2, num_cpus_per_learner=1, custom_resources_per_learner={resource: 1})
           .moe(num_experts=experts, top_k=2, ep_size=2, num_layers=1, d_model=256, d_ff=1024, activation="gelu")
           .deepspeed(enabled=True, num_threads=1, placement_strategy="SPREAD"))
    group = cfg.build_learner_group(env=gym.make("CartPole-v1"))
    try:
        nodes = group.foreach_learner(lambda l: ray.util.get_node_ip_address())
        rng = np.random.default_rng(0)
        obs = torch.as_tensor(rng.uniform(-1, 1, (tokens, 4)), dtype=torch.float32)
        actions = torch.as_tensor(rng.integers(0, 2, tokens))
        times = group.foreach_learner(timed_steps, obs=obs, actions=actions, steps=steps)
    finally:
        group.shutdown()
    step = max(t["step"] for t in times) / steps
    print("RESULT " + json.dumps({"nodes": nodes, "step_s": step,
                                  "alltoall_s": max(t["alltoall"] for t in times) / steps,
                                  "allreduce_s": max(t["allreduce"] for t in times) / steps}), flush=True)


def _address(field):
    """ss's "198.18.0.1:6379" or "[::ffff:198.18.0.1]:6379" -> ("198.18.0.1", "6379")."""
    ip, port = field.rsplit(":", 1)
    ip = ip.strip("[]")
    return (ip[7:] if ip.startswith("::ffff:") else ip), port


class Connections:
    """`ss -tnp` on host B twice a second: every TCP connection between the hosts, with the title of
    the process at each end on this machine (the hosts share one process table)."""

    def __init__(self, hosts):
        self.hosts, self.seen = hosts, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _title(pid):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                words = f.read().split("\0")
        except OSError:
            return "?"
        title = words[0] if words[0].startswith("ray::") else " ".join(os.path.basename(w) for w in words[:3])
        return title.split(".")[0] if title.startswith("ray::") else title[:60]

    def _run(self):
        listening = {}
        while not self._stop.wait(0.5):
            for host in ("a", "b"):
                for row in self.hosts.listening(host):
                    for pid in row["pids"]:
                        listening[(self.hosts.ip[host], row["port"])] = self._title(pid)
            out = subprocess.run(self.hosts.argv("b", ["ss", "-tnpH", "state", "established"]),
                                 capture_output=True, text=True).stdout
            for line in out.splitlines():
                fields = line.split()
                if len(fields) < 4:
                    continue
                local, peer = (_address(f) for f in fields[2:4])
                if peer[0] != self.hosts.ip["a"]:
                    continue
                # The server end is the one listening on its port.
                for (ip, port), other in (((peer[0], int(peer[1])), "b"), ((local[0], int(local[1])), "a")):
                    if (ip, port) in listening:
                        host = "a" if ip == self.hosts.ip["a"] else "b"
                        self.seen.add((host, listening[(ip, port)], port))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def train(hosts, layout, experts, out):
    learner_res, rollout_res = LAYOUTS[layout]
    env = {**hosts.env("a"), "RAY_ADDRESS": hosts.gcs}
    args = ["moe-rl", "train", "--iterations", "3", "--seed", "0", "--num-learners", "2", "--ep-size", "2",
            "--num-env-runners", "2", "--output", out, "--set", "stop_return=null",
            "--set", "training.train_batch_size_per_learner=500", "--set", "training.minibatch_size=125",
            "--set", f"moe.num_experts={experts}", "--set", "moe.d_model=256", "--set", "moe.d_ff=1024",
            "--set", "consistency.enabled=false", "--set", "weight_sync.transport=collective",
            "--set", f"learners.custom_resources_per_learner={{{learner_res}: 1}}",
            "--set", f"env_runners.custom_resources_per_env_runner={{{rollout_res}: 1}}",
            "--set", "deepspeed.placement_strategy=SPREAD"]
    p = hosts.run("a", args, env=env, cwd=ROOT, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{layout}: moe-rl train failed: {(p.stdout + p.stderr)[-3000:]}")
    import pyarrow.parquet as pq
    rows = pq.read_table(os.path.join(out, "metrics.parquet")).to_pylist()[1:]
    return {"sync_s": statistics.median(r["sync_s"] for r in rows),
            "learn_s": statistics.median(r["learn_s"] for r in rows),
            "fallbacks": max(r["sync/collective_fallbacks"] for r in rows),
            "expert_param_bytes": rows[-1]["learner/expert_param_bytes/rank0"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per learner per step")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--learner-steps", help=argparse.SUPPRESS)   # the driver on host A (internal)
    args = ap.parse_args()
    if args.learner_steps:
        return learner_steps(args.learner_steps, args.experts, args.tokens, args.steps)
    import netns
    reason = netns.unavailable()
    if reason:
        sys.exit(f"bench_two_hosts: {reason}")
    t0 = time.monotonic()
    rows = []
    with netns.Hosts(["a", "b"]) as hosts:
        made = time.monotonic() - t0
        hosts.start_head("a", "--num-cpus", "4", "--resources", json.dumps(HOST_A))
        hosts.join("b", "--num-cpus", "2", "--resources", json.dumps(HOST_B))
        print(f"harness: namespaces and links {made:.2f}s; both Rays up {time.monotonic() - t0:.1f}s", flush=True)
        ports = set()
        for layout, (learner_res, _) in LAYOUTS.items():
            p = hosts.run("a", [sys.executable, __file__, "--learner-steps", learner_res, "--experts",
                                str(args.experts), "--tokens", str(args.tokens), "--steps", str(args.steps)],
                          env={**hosts.env("a"), "RAY_ADDRESS": hosts.gcs}, cwd=ROOT, timeout=1800)
            result = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
            if not result:
                raise RuntimeError(f"{layout}: learner steps failed: {(p.stdout + p.stderr)[-3000:]}")
            row = {"layout": layout, **json.loads(result[-1][7:])}
            with tempfile.TemporaryDirectory(dir="/tmp") as out, Connections(hosts) as conns:
                row.update(train(hosts, layout, args.experts, os.path.join(out, "run")))
            ports |= conns.seen
            rows.append(row)
            print(f"{layout:9s}: learners on {row['nodes']}: step {row['step_s']:.3f}s, all-to-all "
                  f"{row['alltoall_s']:.3f}s, all-reduce {row['allreduce_s']:.3f}s; moe-rl train: sync "
                  f"{row['sync_s']:.3f}s (collective fallbacks {row['fallbacks']:.0f}), learn {row['learn_s']:.2f}s, "
                  f"{row['expert_param_bytes'] / 2**20:.1f} MiB of experts per learner", flush=True)
        print("connections between the hosts (server host, process, port):")
        for host, title, port in sorted(ports):
            print(f"  {host} {title} {port}")
    one, two = rows
    print(f"two hosts / one host: step {two['step_s'] / one['step_s']:.2f}x, all-to-all "
          f"{two['alltoall_s'] / one['alltoall_s']:.2f}x, all-reduce {two['allreduce_s'] / one['allreduce_s']:.2f}x, "
          f"sync {two['sync_s'] / one['sync_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "connections": sorted(ports)}, f, indent=1)


if __name__ == "__main__":
    main()
