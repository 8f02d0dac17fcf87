"""Quickstart throughput of two checkouts of moe-rl, one after the other in fresh processes:
what a change costs the training loop.

    git worktree add /tmp/base <REV>
    .venv/bin/python bench/bench_revisions.py /tmp/base .   [--iterations 5]

Each checkout trains the quickstart policy (CartPole-v1, 8 experts top-2, 1 runner x 8 envs, batch
4000, minibatch 256, 6 epochs) for one warm-up iteration plus N timed ones, with Ray workers
importing that checkout (runtime_env PYTHONPATH). Prints env steps/s and learner-update seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r'''
import json, os, sys, time
root, iterations = sys.argv[1], int(sys.argv[2])
sys.path.insert(0, root)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray
ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": {"PYTHONPATH": root}})
import moe_rl
assert os.path.realpath(moe_rl.__file__).startswith(os.path.realpath(root)), moe_rl.__file__
from moe_rl import MoEPPOConfig
algo = (MoEPPOConfig().environment("CartPole-v1").env_runners(num_env_runners=1, num_envs_per_env_runner=8)
        .training(lr=3e-4, train_batch_size_per_learner=4000, minibatch_size=256, num_epochs=6,
                  vf_loss_coeff=0.5, vf_clip_param=1000.0)
        .moe(num_experts=8, top_k=2).debugging(seed=0)).build_algo()
# The learner update timed around the call (RLlib's timers are EMAs weighted to the warm-up).
group, spent = algo.learner_group, [0.0]
def timed_update(*args, _update=group.update, **kwargs):
    t = time.perf_counter()
    try:
        return _update(*args, **kwargs)
    finally:
        spent[0] += time.perf_counter() - t
group.update = timed_update
algo.train()
t0, steps, update = time.perf_counter(), 0, []
for _ in range(iterations):
    spent[0] = 0.0
    r = algo.train()
    steps += r["env_runners"]["num_env_steps_sampled"]
    update.append(spent[0])
print(json.dumps({"env_steps_per_s": steps / (time.perf_counter() - t0),
                  "learner_update_s": sum(update) / len(update)}))
algo.stop()
ray.shutdown()
'''


def main():
    p = argparse.ArgumentParser()
    p.add_argument("base")
    p.add_argument("head")
    p.add_argument("--iterations", type=int, default=5)
    args = p.parse_args()
    out = {}
    for name, root in (("base", args.base), ("head", args.head)):
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(root), str(args.iterations)],
                              capture_output=True, text=True, check=True)
        out[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name} ({root}): {out[name]['env_steps_per_s']:.0f} env steps/s, learner update "
              f"{out[name]['learner_update_s']:.3f} s/iter  ({time.time() - t0:.0f}s)", flush=True)
    print(f"head/base: env steps/s {out['head']['env_steps_per_s'] / out['base']['env_steps_per_s']:.3f}, "
          f"learner update {out['head']['learner_update_s'] / out['base']['learner_update_s']:.3f}")


if __name__ == "__main__":
    main()
