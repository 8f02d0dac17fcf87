"""Weight sync: object store vs collective (gloo), against the number of rollout actors and the
model size. DeepSpeed learner group, 2 learners, ep_size 2 (each publishes half of the experts;
rank 0 also the dense part). Consistency checks off, so only the sync is timed.

    .venv/bin/python bench/bench_sync.py [--runners 1,2,4] [--sizes quickstart,large] [--syncs 5] [--json OUT]
    .venv/bin/python bench/bench_sync.py --rates     # digest and snapshot rates for bench/cost_model.py

Per (size, runners, transport): the median wall time of a whole sync (publish + transfer + load,
MoEPPO._sync_rollout_weights) over `--syncs` syncs after a warm-up sync, the bytes each rollout
actor receives, and the peak RSS during those syncs (VmHWM, reset after the warm-up) of the
driver, each learner and each rollout actor, with its rise over the RSS they started from.
Ratios collective / object store are printed per row: one host, so the object store's "transfer"
is shared memory here.
"""
import argparse
import json
import os
import statistics
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402

from moe_rl import MoEPPOConfig  # noqa: E402
from moe_rl.rllib.runner import runner_modules, synced_state  # noqa: E402

SIZES = {
    "quickstart": {"num_experts": 8, "top_k": 2, "d_model": 64, "d_ff": 64},
    "large": {"num_experts": 64, "top_k": 2, "d_model": 256, "d_ff": 1024},
}


def reset_peak_rss(_=None) -> None:
    """Linux: restart this process's peak-RSS counter (VmHWM), so the peak below is the syncs' own."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mb(_=None) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024.0


def measure(size: str, runners: int, transport: str, syncs: int) -> dict:
    config = (MoEPPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=runners, num_envs_per_env_runner=1)
              .learners(num_learners=2)
              .training(train_batch_size_per_learner=64, minibatch_size=32, num_epochs=1)
              .moe(**SIZES[size], ep_size=2)
              .consistency(enabled=False)
              .weight_sync(transport=transport)
              .debugging(seed=0))
    algo = config.build_algo()
    try:
        algo._sync_rollout_weights()     # warm: the groups are formed, buffers allocated once
        reset_peak_rss()
        algo.learner_group.foreach(reset_peak_rss)
        algo.runner_call(reset_peak_rss)
        base = {"driver": peak_rss_mb(), "learners": algo.learner_group.foreach(peak_rss_mb),
                "runners": algo.runner_call(peak_rss_mb)[1]}
        times, transfer = [], []
        for _ in range(syncs + 1):
            t0 = time.perf_counter()
            algo._sync_rollout_weights()
            times.append(time.perf_counter() - t0)
            transfer.append(algo.gate.weights.transport.last_seconds if algo.gate.weights.transport else float("nan"))
        peak = {"driver": peak_rss_mb(), "learners": algo.learner_group.foreach(peak_rss_mb),
                "runners": algo.runner_call(peak_rss_mb)[1]}
        wire = algo.runner_call(lambda r: sum(t.numel() * t.element_size() for m in runner_modules(r).values()
                                              for t in synced_state(m).values()))[1][0]
        row = {"size": size, "runners": runners, "transport": transport,
               "sync_s_median": statistics.median(times[1:]), "bytes_per_runner": wire,
               # collective: the broadcast alone (both ends), without the publish every sync does
               "broadcast_s_median": statistics.median(transfer[1:]),
               "fallbacks": algo.gate.weights.transport.fallbacks if algo.gate.weights.transport else 0,
               # peak RSS during the syncs, and its rise over the RSS they started from
               "peak_rss_mb": peak, "rss_rise_mb": {k: (np.subtract(peak[k], base[k]).tolist() if k != "driver"
                                                        else peak[k] - base[k]) for k in peak}}
    finally:
        algo.stop()
    return row


def rates(size: str) -> dict:
    """The host rates bench/cost_model.py takes for the check at the source: digest throughput (one
    thread, fp32, moe_rl.core.digests) and the gate's last-good snapshot per learner (weights +
    Adam moments, DeepSpeed checkpoint calls), both on the `size` model with 2 learners."""
    from moe_rl.core.digests import tensor_digest
    torch.set_num_threads(1)
    t = torch.randn(16 * 2**20)                          # 64 MiB
    digest = []
    for _ in range(3):
        t0 = time.perf_counter()
        tensor_digest(t)
        digest.append(time.perf_counter() - t0)
    config = (MoEPPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=1, num_envs_per_env_runner=1).learners(num_learners=2)
              .training(train_batch_size_per_learner=64, minibatch_size=32, num_epochs=1)
              .moe(**SIZES[size], ep_size=2).debugging(seed=0))
    algo = config.build_algo()
    try:
        algo.train()
        snap = []
        for _ in range(3):
            t0 = time.perf_counter()
            algo.gate.keep_last_good()
            snap.append(time.perf_counter() - t0)
        expert_bytes = algo.learner_group.memory_stats()[0]["expert_param_bytes"]
    finally:
        algo.stop()
    state_bytes = 3 * expert_bytes                       # a learner's experts: weights + Adam m, v (fp32)
    return {"size": size, "digest_gbs": t.numel() * 4 / statistics.median(digest) / 1e9,
            "snapshot_s": statistics.median(snap), "snapshot_expert_state_bytes": state_bytes,
            "snapshot_gbs": state_bytes / statistics.median(snap) / 1e9}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runners", default="1,2,4")
    ap.add_argument("--sizes", default="quickstart,large")
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--rates", action="store_true", help="only the digest and snapshot rates (cost model)")
    ap.add_argument("--json")
    args = ap.parse_args()
    from moe_rl.app.train import start_local_ray
    start_local_ray(num_cpus=8)
    if args.rates:
        row = rates("large")
        print(json.dumps(row, indent=1))
        ray.shutdown()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(row, f, indent=1)
        return
    rows = []
    for size in args.sizes.split(","):
        for n in map(int, args.runners.split(",")):
            pair = {t: measure(size, n, t, args.syncs) for t in ("object_store", "collective")}
            rows += pair.values()
            o, c = pair["object_store"], pair["collective"]
            print(f"{size:10s} runners={n}: object store {o['sync_s_median']:.4f} s, collective "
                  f"{c['sync_s_median']:.4f} s (x{c['sync_s_median'] / o['sync_s_median']:.2f}; broadcast alone "
                  f"{c['broadcast_s_median']:.4f} s), "
                  f"{c['bytes_per_runner'] / 2**20:.1f} MiB per runner; RSS rise during syncs: runners "
                  f"{max(o['rss_rise_mb']['runners']):.0f} / {max(c['rss_rise_mb']['runners']):.0f} MiB, learners "
                  f"{max(o['rss_rise_mb']['learners']):.0f} / {max(c['rss_rise_mb']['learners']):.0f} MiB, driver "
                  f"{o['rss_rise_mb']['driver']:.0f} / {c['rss_rise_mb']['driver']:.0f} MiB, "
                  f"collective fallbacks {c['fallbacks']}", flush=True)
    ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
