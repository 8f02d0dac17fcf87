"""DeepSpeed learner group: ep_size 1 (one learner, all experts) vs ep_size 2 (two learners, half
the experts each) at equal total experts, on an expert-heavy policy. Same process, same run.

    .venv/bin/python bench/bench_learner.py [--experts 64] [--tokens 1024] [--steps 5] [--json OUT]

Per layout: learner samples/s (fwd + bwd + reduction + Adam step, all learners together), expert
parameter bytes and peak RSS per learner, and the share of step time spent in the MoE all-to-all
(forward dispatch+combine, DeepSpeed's own timers) and in the gradient all-reduce.
"""
import argparse
import json
import os
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402


def timed_steps(learner, obs, actions, steps):
    """On each learner: `steps` PPO-shaped updates on a fixed batch, timing each phase."""
    import torch.distributed as dist
    from ray.rllib.core.columns import Columns

    from moe_rl.core.losses import moe_aux_losses
    from moe_rl.rllib.rl_module import MOE_ROUTING
    module = learner.module["default_policy"]
    engine = learner._engines["default_policy"]
    moe_layers = [m for m in module.modules() if m.__class__.__name__ == "MOELayer"]
    for m in moe_layers:
        m.wall_clock_breakdown = True
    t = {"step": 0.0, "allreduce": 0.0, "alltoall": 0.0}
    engine.enable_backward_allreduce = False  # reduce explicitly below, to time it
    for i in range(steps + 1):  # first step is warm-up
        dist.barrier()
        t0 = time.perf_counter()
        out = module.forward_train({Columns.OBS: obs})
        a2a = sum(m.time_falltoall + m.time_salltoall for m in moe_layers) / 1000.0  # ms -> s
        logp = torch.log_softmax(out[Columns.ACTION_DIST_INPUTS], -1).gather(1, actions[:, None])
        loss = -logp.mean() + moe_aux_losses(out[MOE_ROUTING], 0.01, 0.001)[0]
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.allreduce_gradients()
        t2 = time.perf_counter()
        engine.step()
        dist.barrier()
        if i:
            t["step"] += time.perf_counter() - t0
            t["allreduce"] += t2 - t1
            t["alltoall"] += a2a
    engine.enable_backward_allreduce = True
    return t


def run(ep_size, experts, tokens, steps, d_model, d_ff):
    from moe_rl import MoEPPOConfig
    n = ep_size
    cfg = (MoEPPOConfig().environment("CartPole-v1")
           .training(lr=1e-4, minibatch_size=tokens, train_batch_size_per_learner=tokens)
           .learners(num_learners=n)
           .moe(num_experts=experts, top_k=2, ep_size=ep_size, num_layers=1, d_model=d_model, d_ff=d_ff,
                activation="gelu")
           .deepspeed(enabled=True, num_threads=max(1, (os.cpu_count() or 2) // n)))
    group = cfg.build_learner_group(env=gym.make("CartPole-v1"))
    try:
        rng = np.random.default_rng(0)
        obs = torch.as_tensor(rng.uniform(-1, 1, (tokens, 4)), dtype=torch.float32)
        actions = torch.as_tensor(rng.integers(0, 2, tokens))
        times = group.foreach_learner(timed_steps, obs=obs, actions=actions, steps=steps)
        stats = group.memory_stats()
    finally:
        group.shutdown()
    step = max(t["step"] for t in times) / steps
    return {"ep_size": ep_size, "learners": n, "samples_per_s": n * tokens / step, "step_s": step,
            "alltoall_share": float(np.mean([t["alltoall"] / t["step"] for t in times])),
            "allreduce_share": float(np.mean([t["allreduce"] / t["step"] for t in times])),
            "expert_param_bytes": [s["expert_param_bytes"] for s in stats],
            "peak_rss_mb": [round(s["peak_rss_mb"], 1) for s in stats]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per learner per step")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--json")
    args = ap.parse_args()
    from moe_rl.app.train import start_local_ray
    start_local_ray(num_cpus=4)
    rows = [run(ep, args.experts, args.tokens, args.steps, args.d_model, args.d_ff) for ep in (1, 2)]
    ray.shutdown()
    for r in rows:
        print(f"ep_size {r['ep_size']} ({r['learners']} learner(s)): {r['samples_per_s']:8.0f} samples/s  "
              f"step {r['step_s']:.3f}s  all-to-all {100 * r['alltoall_share']:.1f}%  "
              f"all-reduce {100 * r['allreduce_share']:.1f}%  expert bytes/learner {r['expert_param_bytes']}  "
              f"peak RSS MB {r['peak_rss_mb']}")
    a, b = rows
    print(f"ep2/ep1: samples/s {b['samples_per_s'] / a['samples_per_s']:.2f}x, expert bytes per learner "
          f"{b['expert_param_bytes'][0] / a['expert_param_bytes'][0]:.3f}x, peak RSS per learner "
          f"{max(b['peak_rss_mb']) / a['peak_rss_mb'][0]:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
