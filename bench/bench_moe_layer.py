"""MoE layer forward+backward throughput vs. a dense FFN of equal *active* parameters and vs.
DeepSpeed's MoE layer (capacity 1.25 and dropless), same shapes, same process, same run.

    .venv/bin/python bench/bench_moe_layer.py [--quick] [--json OUT]

Prints one row per (N, k, tokens): tokens/s of each (forward+backward), the ratios that
BENCHMARKS.md reports, and for <= 64 tokens the forward-only (no autograd) latency ratio
moe/dense, which is what a rollout actor pays per step.
"""
import argparse
import json
import os
import statistics
import time

import torch

from moe_rl.core.layer import MoELayer, dense_ffn_equal_active

D, FF = 256, 512


def timed(fn, min_time=0.4, warmup=2):
    for _ in range(warmup):
        fn()
    reps, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < min_time or len(reps) < 5:
        s = time.perf_counter()
        fn()
        reps.append(time.perf_counter() - s)
    return statistics.median(reps)


def fwd_bwd(module, x):
    def run():
        out = module(x)
        y = out[0] if isinstance(out, tuple) else out
        y.sum().backward()
    return run


def deepspeed_layers(n, k):
    """DeepSpeed MoE in one process: world size 1 over gloo, ep_size 1."""
    import deepspeed
    from deepspeed.moe.layer import MoE
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed("gloo", auto_mpi_discovery=False, verbose=False)
    expert = torch.nn.Sequential(torch.nn.Linear(D, FF), torch.nn.GELU(), torch.nn.Linear(FF, D))
    cap = MoE(D, expert, num_experts=n, ep_size=1, k=k, capacity_factor=1.25, eval_capacity_factor=1.25, min_capacity=0,
              drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=False)
    dropless = MoE(D, expert, num_experts=n, ep_size=1, k=k, drop_tokens=False, use_rts=False, min_capacity=0,
                   top2_2nd_expert_sampling=False)
    cap.set_deepspeed_parallelism()  # without deepspeed.initialize, the gate needs its group
    dropless.set_deepspeed_parallelism()
    return cap, dropless


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    experts = [16] if args.quick else [8, 16, 64]
    ks = [2] if args.quick else [1, 2]
    tokens = [1, 64, 4096]
    rows = []
    hdr = (f"{'N':>3} {'k':>2} {'tokens':>6} {'moe tok/s':>11} {'dense tok/s':>11} {'moe/dense':>9} "
           f"{'ds_cap/dense':>12} {'ds_drop/dense':>13} {'moe/ds_cap':>10} {'moe/ds_drop':>11} "
           f"{'lat moe/dense':>13} {'fwd-only lat':>12}")
    print(hdr)
    for n in experts:
        for k in ks:
            moe = MoELayer(D, n, k, d_ff=FF)
            dense = dense_ffn_equal_active(D, FF, k)
            ds = None if args.no_deepspeed else deepspeed_layers(n, k)
            for t in tokens:
                x = torch.randn(t, D)
                r = {"N": n, "k": k, "tokens": t}
                r["moe_s"] = timed(fwd_bwd(moe, x))
                r["dense_s"] = timed(fwd_bwd(dense, x))
                if ds:
                    xb = x.unsqueeze(0)
                    r["ds_cap_s"] = timed(fwd_bwd(ds[0], xb))
                    r["ds_dropless_s"] = timed(fwd_bwd(ds[1], xb))
                if t <= 64:  # rollout regime: forward only, no autograd
                    with torch.no_grad():
                        r["moe_fwd_s"] = timed(lambda: moe(x))
                        r["dense_fwd_s"] = timed(lambda: dense(x))
                rows.append(r)
                ratio = lambda a, b: r[b] / r[a] if a in r and b in r else float("nan")
                print(f"{n:>3} {k:>2} {t:>6} {t / r['moe_s']:>11.0f} {t / r['dense_s']:>11.0f} "
                      f"{ratio('moe_s', 'dense_s'):>9.2f} {ratio('ds_cap_s', 'dense_s'):>12.2f} "
                      f"{ratio('ds_dropless_s', 'dense_s'):>13.2f} {ratio('moe_s', 'ds_cap_s'):>10.2f} "
                      f"{ratio('moe_s', 'ds_dropless_s'):>11.2f} {r['moe_s'] / r['dense_s']:>13.2f} "
                      f"{r['moe_fwd_s'] / r['dense_fwd_s'] if 'moe_fwd_s' in r else float('nan'):>12.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
