"""The command line of bench/cost_model.py: the model against the figures in BENCHMARKS.md
(--calibrate), the sweep tables, break points and one setup's terms. Run it as bench/cost_model.py."""
from __future__ import annotations

import argparse
import dataclasses
import json

import cost_model
from cost_model import (
    EP_SWEEP,
    GB,
    MIB,
    SWEEP_EXPERTS,
    SWEEP_GPUS,
    Setup,
    break_points,
    check,
    evaluate,
    memory,
    step,
    sweep,
    weight_sync,
)

# --- calibration against BENCHMARKS.md --------------------------------------------------------------
# bench/bench_learner.py: 1 MoE layer, 64 experts, d 256, expert hidden 1024, top-2, gelu, CartPole
# (obs 4, 2 actions), 1024 tokens per learner per step, fp32, gloo on one 2-core host.
# Non-expert params of that module (counted from MoEPolicyModule): embed 4*256+256, LayerNorm 512,
# pi 256*2+2, value net [4, 64, 64] -> 1 = 4545 (dropped by the rollout copy); router 256*64+64.
BENCH_LEARNER = {"d_model": 256, "d_ff": 1024, "num_layers": 1, "num_experts": 64, "top_k": 2,
                 "dense_params": 1280 + 512 + 514 + 4545, "train_only_params": 4545,
                 "attn_act_factor": 0.0, "tokens": 1024, "precision": "fp32", "gpus_per_node": 2}
MEASURED_LEARNER = {  # BENCHMARKS.md, "DeepSpeed learner group: ep_size 1 vs 2"
    1: {"expert_param_bytes": 134_545_408, "peak_rss_mib": [1402.5], "samples_per_s": 2620,
        "alltoall_share": 0.0, "allreduce_share": 0.096},
    2: {"expert_param_bytes": 67_272_704, "peak_rss_mib": [1133.5, 1100.4], "samples_per_s": 3062,
        "alltoall_share": 0.162, "allreduce_share": 0.041},
}
# bench/bench_consistency.py --learners 2 (2026-12-01, the check at the source): the quickstart
# policy (2 layers, 8 experts, d 64, expert hidden 64, top-2), 2 learners, ep_size 2: check_s 0.043 s per
# check and 0.012 s more sync (digests, last good state), as the run records them.
QUICKSTART = {"d_model": 64, "d_ff": 64, "num_layers": 2, "num_experts": 8, "top_k": 2,
              "dense_params": 320 + 256 + 130 + 4545, "train_only_params": 4545, "attn_act_factor": 0.0,
              "precision": "fp32", "gpus": 2, "ep_size": "2", "gpus_per_node": 2, "check_fixed_s": 0.0}
MEASURED_CHECK = {"check_s": 0.043, "sync_added_s": 0.012}   # recorded in the run (wall-time difference: noise)
# A one-off probe on this host (docs/SCALING.md): two actors publish half the experts of the
# bench_learner shape each (numpy copies, object store), a third assembles and loads them.
MEASURED_SYNC = {"publish_s": 0.039, "load_s": 0.016, "total_s": 0.057}


def calibrate() -> list[dict]:
    rows = []
    for ep in (1, 2):
        s = Setup(**BENCH_LEARNER, gpus=ep, ep_size=str(ep))
        m, st, meas = memory(s), step(s), MEASURED_LEARNER[ep]
        rows.append({"what": f"expert-param bytes per learner, ep_size {ep}",
                     "model": m["expert_param_bytes"], "measured": meas["expert_param_bytes"],
                     "note": "exact (fp32, fc1+fc2 with biases)"})
        if ep == 2:
            step_s = 2 * 1024 / meas["samples_per_s"]
            fwd_a2a_bytes = st["a2a_bytes"] / 2                      # only the forward pair is timed
            a2a_s = meas["alltoall_share"] * step_s
            rows.append({"what": "all-to-all bytes sent per learner per step (4 a2a)",
                         "model": st["a2a_bytes"], "measured": "16.2% of step (forward pair)",
                         "note": (f"measured forward a2a {1e3 * a2a_s:.0f} ms for {fwd_a2a_bytes / 1e6:.2f} MB"
                                  f" = {fwd_a2a_bytes / a2a_s / 1e6:.0f} MB/s: gloo on loopback with 2"
                                  " processes on 2 cores is waiting and scheduling, not a network")})
            ar_s = meas["allreduce_share"] * step_s
            rows.append({"what": "gradient all-reduce bytes per learner per step",
                         "model": st["dense_ar_bytes"] + st["expert_ar_bytes"], "measured": "4.1% of step",
                         "note": (f"dense only (ep-dp group of 1); measured {1e3 * ar_s:.0f} ms: fixed cost"
                                  f" (ep_size 1, no peer at all, spent "
                                  f"{1e3 * MEASURED_LEARNER[1]['allreduce_share'] * 1024 / 2620:.0f} ms)")})
            m1 = memory(Setup(**BENCH_LEARNER, gpus=1, ep_size="1"))
            drop = (m1["expert_state_bytes"] - m["expert_state_bytes"]) / MIB
            rss = [MEASURED_LEARNER[1]["peak_rss_mib"][0] - r for r in meas["peak_rss_mib"]]
            rows.append({"what": "peak RSS drop ep 1 -> 2 per learner (MiB)", "model": round(drop, 1),
                         "measured": [round(r, 1) for r in rss],
                         "note": "model: 32 experts' weights + grads + Adam m, v (fp32)"})
            sy = weight_sync(dataclasses.replace(s, rollout_per_gpu=0.5))
            rows.append({"what": "object-store weight sync on one host, bench_learner shape (s)",
                         "model": round(sy["sync_object_store_s"] - sy["model_bytes"] / (s.eth_gbs * GB), 4),
                         "measured": MEASURED_SYNC["total_s"],
                         "note": "publish + load only (no network on one host); host_copy_gbs 5"})
    q = Setup(**QUICKSTART)
    ck = check(q)
    overhead = MEASURED_CHECK["check_s"] + MEASURED_CHECK["sync_added_s"]
    rows.append({"what": "consistency check at the source, quickstart, 2 learners (s per check)",
                 "model": round(ck["check_s"], 4), "measured": round(overhead, 3),
                 "note": ("bytes terms only (digests, update size, snapshot of a 0.1 MB model); the measured"
                          " time is fixed cost (RPCs, three trainer views) and is the model's check_fixed_s")})
    return rows


# --- output ---------------------------------------------------------------------------------------
COLUMNS = [("gpus", "GPUs", "{:>5}"), ("experts", "E", "{:>4}"), ("ep", "ep", "{:>4}"),
           ("params", "params", "{:>7}"), ("compute_s", "comp ms", "{:>7}"), ("a2a_share", "a2a", "{:>4}"),
           ("dense_ar_share", "dAR", "{:>4}"), ("expert_ar_share", "eAR", "{:>4}"),
           ("comm_share", "comm", "{:>4}"), ("mem_gb", "mem GB", "{:>6}"), ("sync_s", "sync s", "{:>6}"),
           ("sync_share", "sync", "{:>4}"), ("sync_object_store_s", "os s", "{:>6}"),
           ("check_s", "check s", "{:>7}"), ("check_share", "chk", "{:>4}"),
           ("check_every_needed", "every", "{:>5}"), ("check_gathered_s", "gath s", "{:>6}")]


def _cell(key: str, v) -> str:
    if key.endswith("_share"):
        return f"{100 * v:.0f}%"
    if key == "params":
        return f"{v / 1e9:.2f}B" if v >= 1e8 else f"{v / 1e6:.1f}M"
    if key == "compute_s":
        return f"{1e3 * v:.0f}"
    if isinstance(v, float):
        return f"{v:.3g}" if v < 100 else f"{v:.0f}"
    return str(v)


def table(rows: list[dict]) -> str:
    lines = [" ".join(fmt.format(name) for _, name, fmt in COLUMNS)]
    lines += [" ".join(fmt.format(_cell(k, r[k])) for k, _, fmt in COLUMNS) for r in rows]
    return "\n".join(lines)


def report(base: Setup, gpus, experts, at_gpus: int, at_experts: int, ep_at: tuple[int, int]) -> dict:
    by_gpus = sweep(dataclasses.replace(base, num_experts=at_experts), "gpus", gpus)
    by_experts = sweep(dataclasses.replace(base, gpus=at_gpus), "num_experts", experts)
    n, e = ep_at
    by_ep = [evaluate(dataclasses.replace(base, gpus=n, num_experts=e, ep_size=str(ep)))
             for ep in EP_SWEEP if ep <= min(n, e)]
    return {"setup": dataclasses.asdict(base), "at_gpus": at_gpus, "at_experts": at_experts, "ep_at": [n, e],
            "sweep_gpus": by_gpus, "sweep_experts": by_experts, "sweep_ep": by_ep,
            "break_points": break_points(by_gpus, by_experts, by_ep, base)}


def print_report(rep: dict) -> None:
    setup = rep["setup"]
    inter = f"{setup['ib_gbs']:g} GB/s/GPU ib" if setup["fabric"] == "ib" else f"{setup['eth_gbs']:g} GB/s/node eth"
    print(f"shape d={setup['d_model']} d_ff={setup['d_ff']} L={setup['num_layers']} k={setup['top_k']} "
          f"dense={setup['dense_params']:,};"
          f" {setup['tokens']} tokens/learner/step, {setup['steps_per_iter']} steps/iter, {setup['precision']},"
          f" check every {setup['check_every']}, ep_size {setup['ep_size']};\nNVLink {setup['nvlink_gbs']:g} GB/s,"
          f" inter-node {inter}, object store {setup['eth_gbs']:g} GB/s/node; {setup['gpu_tflops']:g} TFLOPS x"
          f" {setup['mfu']:g} MFU; {setup['rollout_per_gpu']:g} rollout actor/GPU, {setup['rollout_per_node']}/node")
    print("a2a, dAR, eAR: term alone vs compute; comm: all-in share of the step; sync, chk: term alone vs"
          f" training time per iteration;\nsync s: weight_sync.transport {setup['sync_transport']}"
          f" ({setup['sync_backend']}, {setup['inference_dtype']} rollout copy), os s: the object store (fp32);"
          " every: smallest consistency.every for chk <= limit;\ngath s: the gathered check this one replaced")
    n, e = rep["ep_at"]
    print(f"\nGPU sweep at {rep['at_experts']} experts\n" + table(rep["sweep_gpus"]))
    print(f"\nexpert sweep at {rep['at_gpus']} GPUs\n" + table(rep["sweep_experts"]))
    print(f"\nep_size sweep at {n} GPUs, {e} experts\n" + table(rep["sweep_ep"]))
    print(f"\nbreak points: first crossing in each sweep (GPUs at {rep['at_experts']} experts, experts at"
          f" {rep['at_gpus']} GPUs, ep at {n} GPUs x {e} experts)")
    for term, b in rep["break_points"].items():
        lim = f"{100 * b['limit']:.0f}%" if b["metric"].endswith("_share") else f"{b['limit']:g} GB"
        cells = []
        for col in ("gpus", "experts", "ep"):
            hit = b[col]
            cells.append(f"{col} {hit[col]} ({_cell(b['metric'], hit['value'])})" if hit else f"{col} -")
        extra = f"  fits from ep {b['smallest_ep_that_fits']}" if "smallest_ep_that_fits" in b else ""
        print((f"  {term:<20} > {lim:<7} " + "".join(f"{c:<22}" for c in cells) + extra).rstrip())


def _num(v) -> str:
    if isinstance(v, list):
        return ", ".join(map(_num, v))
    if isinstance(v, float) and v.is_integer() and v > 1000:
        v = int(v)
    return f"{v:,}" if isinstance(v, int) else str(v)


def print_point(r: dict) -> None:
    for k, v in r.items():
        print(f"  {k:<20} {v:.4g}" if isinstance(v, float) else f"  {k:<20} {v}")


def _args(argv=None):
    ap = argparse.ArgumentParser(description=cost_model.__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Setup):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                        help=f"default {f.default}")
    ap.add_argument("--sweep-gpus", default=",".join(map(str, SWEEP_GPUS)))
    ap.add_argument("--sweep-experts", default=",".join(map(str, SWEEP_EXPERTS)))
    ap.add_argument("--at-gpus", type=int, default=64, help="GPU count of the expert sweep")
    ap.add_argument("--at-experts", type=int, default=64, help="expert count of the GPU sweep")
    ap.add_argument("--ep-at", default="256,256", help="GPUS,EXPERTS of the ep_size sweep")
    ap.add_argument("--point", action="store_true", help="one setup (--gpus, --num-experts), every term")
    ap.add_argument("--calibrate", action="store_true", help="model vs BENCHMARKS.md")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = _args(argv)
    base = Setup(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Setup)})
    if a.calibrate:
        rows = calibrate()
        if a.json:
            print(json.dumps({"calibration": rows}, indent=1))
        else:
            for r in rows:
                print(f"{r['what']}\n    model {_num(r['model'])}  measured {_num(r['measured'])}  ({r['note']})")
        return 0
    if a.point:
        r = evaluate(base)
        print(json.dumps(r, indent=1)) if a.json else print_point(r)
        return 0
    gpus = [int(x) for x in a.sweep_gpus.split(",")]
    experts = [int(x) for x in a.sweep_experts.split(",")]
    n, e = (int(x) for x in a.ep_at.split(","))
    rep = report(base, gpus, experts, a.at_gpus, a.at_experts, (n, e))
    print(json.dumps(rep, indent=1)) if a.json else print_report(rep)
    return 0
