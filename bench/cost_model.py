"""moe-rl on paper: an analytic cost model of one training iteration at scale.

    .venv/bin/python bench/cost_model.py                 # reference shape: sweeps + break points
    .venv/bin/python bench/cost_model.py --calibrate     # model vs the figures in BENCHMARKS.md
    .venv/bin/python bench/cost_model.py --point --gpus 64 --num-experts 128   # one breakdown
    .venv/bin/python bench/cost_model.py --json          # everything above as JSON

Pure python (no torch, no Ray). It follows the data movement the code does today:
  step       per MoE layer 4 all-to-alls of the dispatch buffer (DeepSpeed MOELayer: dispatch and
             combine forward, their gradients backward; actors/deepspeed_moe.py); non-expert grads
             all-reduced over all learners, expert grads over the expert-data-parallel group
             (actors/learner.py); nothing overlaps (stage-0 DeepSpeed, blocking all-to-all).
  sync       weight_sync.transport object_store: every learner puts its part in its node's object
             store (learner_group.publish_weights) and every rollout actor ray.get()s all parts (the
             full model) and loads it (runner.load_shards_into_runner; Ray moves objects over the
             nodes' TCP NIC). collective: every learner keeps its part (a copy in its own memory:
             the synced version for the gate, published only on demand) and broadcasts it, in the
             rollout copy's dtype, to every rollout actor, received in place
             (actors/weight_transport.py): NCCL pipelines a broadcast, so each rollout actor's link
             carries the model once; gloo sends from the source to each member in turn.
  check      at the source (actors/consistency.py, algo/sync_gate.py): each learner digests its part
             in the rollout dtype and everything it holds (replica check) and computes the update
             size against its published part; each rollout actor digests its copy; the consistency
             actor compares digests and O(sample_size) log-probs. After each sync the learners
             keep the last good state (weights + optimizer moments) for hold/rollback: a copy in
             their own memory (ZeRO stage 0), else DeepSpeed's checkpoint calls.
             The gathered check it replaced (every model in one process) is kept as check_gathered.
  memory     per learner: weights + grads + Adam moments (+ fp32 master in bf16), experts / ep_size,
             plus a rough activation term.
Formulas and assumptions: docs/SCALING.md. Every time is a lower bound (peak link bandwidths, no
contention beyond what is named), so a break point found here is an upper bound on where it breaks.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass

GB = 1e9
MIB = 2**20
SWEEP_GPUS = (8, 16, 32, 64, 128, 256, 512, 1024)
SWEEP_EXPERTS = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Setup:
    # --- model shape (defaults: a seed-scale policy, ~6.5B parameters at 64 experts) ---------
    d_model: int = 1024
    d_ff: int = 4096              # expert hidden width; an expert is fc1+fc2 with biases
    num_layers: int = 12          # MoE layers
    num_experts: int = 64
    top_k: int = 2
    dense_params: int = 100_000_000   # non-expert, non-router params (attention, embeddings, heads, vf)
    train_only_params: int = 0        # part of dense_params the rollout copy drops (value net)
    attn_act_factor: float = 10.0     # activation floats per token per layer outside the MoE, x d_model
    # --- cluster ------------------------------------------------------------------------------
    gpus: int = 8                 # learners, one GPU each
    ep_size: str = "node"         # int, "node" = min(E, N, gpus_per_node), "max" = min(E, N)
    gpus_per_node: int = 8
    rollout_per_gpu: float = 1.0  # rollout actors per learner GPU
    rollout_per_node: int = 8     # rollout actors sharing one node (and its NIC, object store)
    nvlink_gbs: float = 300.0     # per GPU per direction (A100 NVLink3)
    ib_gbs: float = 25.0          # per GPU (one 200 Gb/s HDR HCA per GPU, rail-optimised)
    eth_gbs: float = 12.5         # per node (100 GbE, TCP): Ray's object transfers use this
    fabric: str = "ib"            # NCCL between nodes: "ib" (per GPU) or "eth" (per node, shared)
    latency_us: float = 5.0       # per collective hop
    gpu_tflops: float = 312.0     # A100 bf16 dense peak
    mfu: float = 0.4
    host_copy_gbs: float = 5.0    # one process copying a state dict (measured here: 4.6)
    device_copy_gbs: float = 1000.0   # a GPU copying its own memory (A100 HBM ~1.5 TB/s, read + write)
    compare_gbs: float = 2.5      # consistency actor, fp32 bytes compared per s (measured here)
    gpu_mem_gb: float = 80.0
    host_mem_gb: float = 512.0    # the node the consistency actor runs on
    # --- run ----------------------------------------------------------------------------------
    tokens: int = 16384           # per learner per optimizer step
    steps_per_iter: int = 32      # optimizer steps per PPO iteration (epochs x minibatches)
    check_every: int = 1          # consistency.every
    param_sample: float = 1.0     # consistency.param_sample: share of tensors digested per check
    check_fixed_s: float = 0.055  # per-check fixed cost (RPCs, 3 trainer views): recorded here (2 learners)
    precision: str = "bf16"       # "fp32" | "bf16" (bf16 weights/grads/activations, fp32 master)
    zero_stage: int = 0           # 0 | 1 (1 partitions master + moments over the DP group)
    capacity_factor: float = 1.0  # dispatch buffer / (T k): 1.0 = balanced dropless
    sync_dtype: str = "fp32"      # object-store wire format (numpy: the learners' fp32)
    sync_transport: str = "collective"   # weight_sync.transport: object_store | collective
    sync_backend: str = "nccl"    # collective: nccl (GPU rollout actors) | gloo (CPU rollout actors)
    digest_gbs: float = 1.0       # bytes digested per s, one thread (moe_rl.core.digests): measured here 1.04
    digest_threads: int = 8       # threads a process digests on (DIGEST_THREADS = min(8, cores); 2 here: 2.3 GiB/s)
    snapshot: str = "memory"      # the gate's last good state per sync: "memory" (each learner copies its
                                  # weights + moments on its device: ZeRO stage 0) | "disk" (DeepSpeed's
                                  # checkpoint calls: ZeRO 1-2 or fp16/bf16 optimizer wrappers)
    snapshot_gbs: float = 0.5     # "disk": written per learner per s (8 learners sharing a node's NVMe,
                                  # ~4 GB/s); measured here 0.32 (DeepSpeed checkpoint to local disk)
    inference_dtype: str = "fp32" # rollout copy (moe.inference_dtype)
    step_compute_s: float = 0.0   # > 0: use this compute time per step instead of FLOPs / (peak x mfu)
    share_limit: float = 0.10


def _bytes(dtype: str) -> int:
    return {"fp32": 4, "bf16": 2}[dtype]


def ep_of(s: Setup) -> int:
    if s.ep_size == "node":
        ep = min(s.num_experts, s.gpus, s.gpus_per_node)
    elif s.ep_size == "max":
        ep = min(s.num_experts, s.gpus)
    else:
        ep = int(s.ep_size)
    if s.num_experts % ep or s.gpus % ep:
        raise ValueError(f"ep_size {ep} must divide num_experts {s.num_experts} and gpus {s.gpus}")
    return ep


def params(s: Setup) -> dict:
    """Parameter counts, named like the code (sharding.is_expert_param)."""
    per_expert = 2 * s.d_model * s.d_ff + s.d_ff + s.d_model          # fc1 + fc2, with biases
    routers = s.num_layers * (s.d_model * s.num_experts + s.num_experts)
    experts = s.num_layers * s.num_experts * per_expert
    nonexpert = s.dense_params + routers                             # reduced over all learners
    return {"per_expert": per_expert, "experts": experts, "routers": routers, "nonexpert": nonexpert,
            "inference": experts + nonexpert - s.train_only_params,  # the rollout copy
            "active": nonexpert + s.num_layers * s.top_k * per_expert}


def _ring(n: int, nbytes: float, bw_gbs: float, s: Setup) -> float:
    """Ring all-reduce: 2(n-1)/n x bytes at the slowest link, plus 2(n-1) latency hops."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / (bw_gbs * GB) + 2 * (n - 1) * s.latency_us * 1e-6


def _inter_gbs(s: Setup) -> float:
    """Inter-node bandwidth one GPU gets from NCCL."""
    return s.ib_gbs if s.fabric == "ib" else s.eth_gbs / s.gpus_per_node


def memory(s: Setup) -> dict:
    """Bytes per learner. fp32: w 4 + g 4 + Adam m,v 8. bf16: w 2 + g 2 + master 4 + m,v 8."""
    p, ep, n = params(s), ep_of(s), s.gpus
    local_experts = p["experts"] // ep
    w = g = _bytes(s.precision)
    opt = 8 + (4 if s.precision == "bf16" else 0)                    # moments (+ fp32 master)
    dp_dense, dp_expert = (n, n // ep) if s.zero_stage >= 1 else (1, 1)
    act_floats = (s.attn_act_factor * s.d_model + 2 * s.top_k * s.capacity_factor * s.d_model
                  + 2 * s.top_k * s.d_ff + 2 * s.d_model)            # per token per layer, rough
    out = {"expert_param_bytes": local_experts * w,
           "expert_state_bytes": local_experts * (w + g + opt / dp_expert),
           "dense_state_bytes": p["nonexpert"] * (w + g + opt / dp_dense),
           "activation_bytes": s.tokens * s.num_layers * act_floats * _bytes(s.precision)}
    out["total_bytes"] = out["expert_state_bytes"] + out["dense_state_bytes"] + out["activation_bytes"]
    return out


def step(s: Setup) -> dict:
    """One optimizer step on one learner: compute, all-to-all, the two gradient all-reduces."""
    p, ep, n = params(s), ep_of(s), s.gpus
    b = _bytes(s.precision)
    compute = s.step_compute_s or 6 * s.tokens * p["active"] / (s.gpu_tflops * 1e12 * s.mfu)
    # All-to-all: the [E, C, d] dispatch buffer is T k cf d values; (ep-1)/ep of it leaves the rank,
    # (ep - on_node)/ep of it leaves the node. 4 per MoE layer per step.
    buf = s.tokens * s.top_k * s.capacity_factor * s.d_model * b
    on_node = min(ep, s.gpus_per_node)
    n_a2a = 4 * s.num_layers if ep > 1 else 0
    intra, inter = n_a2a * buf * (on_node - 1) / ep, n_a2a * buf * (ep - on_node) / ep
    a2a = 0.0
    if n_a2a:
        a2a = max(intra / (s.nvlink_gbs * GB), inter / (_inter_gbs(s) * GB)) + n_a2a * s.latency_us * 1e-6
    # Gradient all-reduces (DeepSpeed): non-expert over all n ranks, experts over the n/ep ranks
    # that hold the same experts (ranks r, r+ep, ...: on one node only if n/ep <= gpus_per_node/ep).
    dense_bytes = p["nonexpert"] * b
    expert_bytes = p["experts"] // ep * b
    g = n // ep
    dense_ar = _ring(n, dense_bytes, s.nvlink_gbs if n <= s.gpus_per_node else _inter_gbs(s), s)
    expert_ar = _ring(g, expert_bytes, s.nvlink_gbs if n <= s.gpus_per_node else _inter_gbs(s), s)
    total = compute + a2a + dense_ar + expert_ar
    return {"compute_s": compute, "a2a_bytes": intra + inter, "a2a_inter_bytes": inter, "a2a_s": a2a,
            "dense_ar_bytes": 2 * (n - 1) / n * dense_bytes, "dense_ar_s": dense_ar,
            "expert_ar_bytes": 2 * (g - 1) / g * expert_bytes if g > 1 else 0.0,
            "expert_ar_s": expert_ar, "step_s": total}


def weight_sync(s: Setup) -> dict:
    """The learners' parts to every rollout actor: object store (full model pulled by each) or
    collective (each source broadcasts its part)."""
    p, ep = params(s), ep_of(s)
    rollouts = math.ceil(s.gpus * s.rollout_per_gpu)
    rollout_nodes = math.ceil(rollouts / s.rollout_per_node)
    source_nodes = math.ceil(ep / s.gpus_per_node)                  # ranks 0..ep-1 publish experts
    eth, host = s.eth_gbs * GB, s.host_copy_gbs * GB
    part = p["experts"] // ep + p["nonexpert"]                      # rank 0's part: its experts + dense
    keep = part * _bytes(s.precision) / (s.device_copy_gbs * GB)    # collective: the part kept in place

    def object_store(wire: int, tree: bool = False) -> float:
        model = p["inference"] * wire                               # what each rollout actor pulls
        # transfer: all pulls start together and are served by the source nodes' NICs (Ray may
        # serve late pullers from copies already made: the truth lies between this and a tree)
        transfer = max(rollout_nodes * model / (source_nodes * eth), model / eth)
        if tree:                                                    # binary tree, not pipelined
            transfer = math.ceil(math.log2(rollout_nodes + 1)) * model / eth
        return 2 * part * wire / host + transfer + model / host     # publish, pull, assemble + load

    wire = _bytes(s.inference_dtype)                                # collective: the rollout copy's dtype
    model = p["inference"] * wire
    # NCCL: pipelined broadcasts from ep sources at once; each rollout actor's inbound link carries
    # the whole model once; one hop of latency per member in the chain. Received in place on the GPU.
    nccl = model / (_inter_gbs(s) * GB) + rollouts * s.latency_us * 1e-6
    # gloo: the source sends its part to each member in turn; a source node's NIC carries its
    # ranks' parts (rank 0: + dense) once per rollout actor; unpacked on the host.
    node_part = (min(ep, s.gpus_per_node) * (p["experts"] // ep) + p["nonexpert"]) * wire
    gloo = rollouts * node_part / eth + model / host
    collective = keep + (nccl if s.sync_backend == "nccl" else gloo)
    model_os = p["inference"] * _bytes(s.sync_dtype)
    return {"model_bytes": model_os, "rollout_actors": rollouts, "rollout_nodes": rollout_nodes,
            "network_bytes": rollout_nodes * model_os, "actor_bytes": rollouts * model_os,
            "sync_object_store_s": object_store(_bytes(s.sync_dtype)), "sync_fp32_s": object_store(4),
            "sync_bf16_s": object_store(2), "sync_tree_bf16_s": object_store(2, tree=True),
            "sync_keep_s": keep, "sync_collective_s": collective,
            "sync_s": collective if s.sync_transport == "collective" else object_store(_bytes(s.sync_dtype)),
            "rollout_copy_bytes": p["inference"] * _bytes(s.inference_dtype)}


def check(s: Setup) -> dict:
    """One consistency check at the source (what the code does), and the gathered check it replaced."""
    p, ep, n = params(s), ep_of(s), s.gpus
    dense_inf = p["nonexpert"] - s.train_only_params
    b = _bytes(s.precision)
    part = p["experts"] // ep + dense_inf                           # rank 0's published part
    held = p["experts"] // ep + p["nonexpert"]                      # everything a learner holds
    # Learners, in parallel: digests of (a share of) the part, cast to the rollout dtype, and of all
    # they hold (hashed on the host); the update size, both sides read in fp64: against the part
    # they kept, on the device (collective), or against the object-store copy, on the host.
    share, digest = s.param_sample, s.digest_gbs * s.digest_threads * GB
    size_rate = s.device_copy_gbs if s.sync_transport == "collective" else s.compare_gbs
    learner = share * (part + held) * b / digest + 2 * part * 8 / (size_rate * GB)
    rollout = share * p["inference"] * _bytes(s.inference_dtype) / digest   # each actor, its copy
    # The last good state after each sync: weights + optimizer moments, per learner, in parallel.
    opt = 8 + (4 if s.precision == "bf16" else 0)
    snapshot = held * (b + opt) / ((s.device_copy_gbs if s.snapshot == "memory" else s.snapshot_gbs) * GB)
    # The gathered check (before): three full fp32 models + every learner's state in one process.
    model = p["inference"] * 4
    replicas = (n * dense_inf + n // ep * p["experts"]) * 4
    fetched = 3 * model + replicas
    gathered = (s.check_fixed_s + 3 * 2 * part * 4 / (s.host_copy_gbs * GB) + fetched / (s.eth_gbs * GB)
                + fetched / (s.compare_gbs * GB))
    tensors = s.num_layers * (s.num_experts * 4 + 2) + 64          # digests travel: ~60 B per tensor
    return {"check_learner_s": learner, "check_rollout_s": rollout, "check_snapshot_s": snapshot,
            "check_s": s.check_fixed_s + learner + rollout + snapshot,
            "check_gathered_s": gathered, "fetched_gathered_bytes": fetched,
            "actor_peak_bytes": tensors * (n + 2) * 60,             # digests of every learner + copy
            "actor_peak_gathered_bytes": 3 * model + max(replicas, model)}


def evaluate(s: Setup) -> dict:
    """Everything for one setup. Each *_share judges one term alone: a per-step term against
    compute + that term, a per-iteration term against training (steps_per_iter full steps) + that
    term; rollout (sampling) time is not counted, so shares are upper bounds. comm_share is the
    all-in communication share of a step (what BENCHMARKS.md and the seeds report)."""
    st, mem, sy, ck = step(s), memory(s), weight_sync(s), check(s)
    train = s.steps_per_iter * st["step_s"]
    per_check = ck["check_s"] / s.check_every
    lim, comp = s.share_limit, st["compute_s"]
    return {"gpus": s.gpus, "experts": s.num_experts, "ep": ep_of(s), "params": params(s)["inference"],
            **st, **mem, **sy, **ck, "train_s": train, "iteration_s": train + sy["sync_s"] + per_check,
            "a2a_share": st["a2a_s"] / (comp + st["a2a_s"]),
            "dense_ar_share": st["dense_ar_s"] / (comp + st["dense_ar_s"]),
            "expert_ar_share": st["expert_ar_s"] / (comp + st["expert_ar_s"]),
            "comm_share": 1 - comp / st["step_s"],
            "sync_share": sy["sync_s"] / (train + sy["sync_s"]),
            "check_share": per_check / (train + per_check),
            # steps per iteration that keep one sync at or under share_limit of training
            "sync_steps_needed": math.ceil(sy["sync_s"] * (1 - lim) / (lim * st["step_s"])),
            # smallest consistency.every that keeps the check at or under share_limit
            "check_every_needed": max(1, math.ceil(ck["check_s"] * (1 - lim) / (lim * train))),
            "mem_gb": mem["total_bytes"] / GB, "check_actor_gb": ck["actor_peak_bytes"] / GB,
            "check_actor_gathered_gb": ck["actor_peak_gathered_bytes"] / GB,
            "rollout_copy_gb": sy["rollout_copy_bytes"] / GB}


# --- sweeps and break points ----------------------------------------------------------------------
def sweep(base: Setup, field: str, values) -> list[dict]:
    return [evaluate(dataclasses.replace(base, **{field: v})) for v in values]


# term -> (the metric that crosses, what its limit is)
TERMS = {
    "a2a": ("a2a_share", "share of step"),
    "dense_ar": ("dense_ar_share", "share of step"),
    "expert_ar": ("expert_ar_share", "share of step"),
    "weight_sync": ("sync_share", "share of iteration"),
    "consistency_check": ("check_share", "share of iteration"),
    "learner_memory": ("mem_gb", "GB > gpu_mem_gb"),
    "rollout_copy_memory": ("rollout_copy_gb", "GB > gpu_mem_gb"),
    "check_actor_memory": ("check_actor_gb", "GB > host_mem_gb"),
}


def _limit(s: Setup, key: str) -> float:
    return {"mem_gb": s.gpu_mem_gb, "rollout_copy_gb": s.gpu_mem_gb,
            "check_actor_gb": s.host_mem_gb}.get(key, s.share_limit)


EP_SWEEP = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def break_points(by_gpus: list[dict], by_experts: list[dict], by_ep: list[dict], s: Setup) -> dict:
    """For each term: the first GPU count, expert count and ep_size (in the three sweeps) where it
    crosses its limit (None: not within the sweep); for memory also the smallest ep that fits."""
    out = {}
    for term, (key, what) in TERMS.items():
        lim = _limit(s, key)

        def first(rows, col, key=key, lim=lim):
            r = next((r for r in rows if r[key] > lim), None)
            return None if r is None else {col: r[col], "value": r[key]}
        out[term] = {"metric": key, "limit": lim, "what": what, "gpus": first(by_gpus, "gpus"),
                     "experts": first(by_experts, "experts"), "ep": first(by_ep, "ep")}
        if key == "mem_gb":
            fits = next((r for r in by_ep if r[key] <= lim), None)
            out[term]["smallest_ep_that_fits"] = fits and fits["ep"]
    return out


if __name__ == "__main__":   # the command line, its tables and the calibration: cost_model_report.py
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cost_model_report import main
    sys.exit(main())
