"""One-command check of the GPU paths (not run in CI here: no GPU). On one CUDA GPU, in about 5 minutes:

    bash bench/gpu_check.sh            # or: .venv/bin/python bench/gpu_check.py

  1 layer       the MoE layer on CUDA: forward + backward, output and gradients vs the same layer on CPU
  2 bf16 copy   a bf16 rollout copy of the quickstart policy on CUDA vs the fp32 policy: K3, routing agreement
  3 deepspeed   the DeepSpeed learner group, ep_size 1, on NCCL (one learner on the GPU): 2 PPO iterations
  4 sync        in the same run: collective weight syncs (learner on the GPU -> a CPU rollout actor, gloo),
                no fallback, the rollout copy bit-exact to the synced weights (digests)
  5 check       in the same run: the consistency check before each sync: a ledger row, decision sync

Prints PASS/FAIL per step and exits non-zero if any step fails. `--cpu` runs the same steps on the
CPU (gloo, no GPU asserted): a dry run of the script itself on a machine without a GPU.
"""
import os
import sys
import time
import traceback

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import torch  # noqa: E402

RESULTS = []


def step(name):
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            detail = fn()
            RESULTS.append((name, True))
            print(f"PASS {name} ({time.perf_counter() - t0:.1f}s): {detail}", flush=True)
        except Exception as e:  # noqa: BLE001 - every step is reported
            RESULTS.append((name, False))
            print(f"FAIL {name} ({time.perf_counter() - t0:.1f}s): {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        return fn
    return wrap


def main():
    cpu = "--cpu" in sys.argv[1:]
    if not cpu and not torch.cuda.is_available():
        print("FAIL cuda: torch.cuda.is_available() is False (a CUDA build of torch and a GPU are needed)")
        return 1
    dev = "cpu" if cpu else "cuda"
    from moe_rl.core.drift import drift_metrics, routing_agreement
    from moe_rl.core.layer import MoELayer

    @step("1 layer on CUDA")
    def _():
        torch.manual_seed(0)
        cpu = MoELayer(64, 8, 2, d_ff=128)
        gpu = MoELayer(64, 8, 2, d_ff=128).to(dev)
        gpu.load_state_dict(cpu.state_dict())
        x = torch.randn(4096, 64)
        y_cpu, _ = cpu(x)
        y_gpu, _ = gpu(x.to(dev))
        y_cpu.pow(2).mean().backward()
        y_gpu.pow(2).mean().backward()
        dy = (y_gpu.cpu() - y_cpu).abs().max().item()
        dg = max((pg.grad.cpu() - pc.grad).abs().max().item() for pc, pg in zip(cpu.parameters(), gpu.parameters()))
        assert dy < 1e-4 and dg < 1e-4, (dy, dg)
        return f"max |dy| {dy:.1e}, max |dgrad| {dg:.1e}"

    @step("2 bf16 inference copy")
    def _():
        import gymnasium as gym
        from ray.rllib.core.columns import Columns
        from ray.rllib.core.rl_module.rl_module import RLModuleSpec

        from moe_rl.core.settings import MOE_DEFAULTS
        from moe_rl.rllib.rl_module import MOE_TOPK, MoEPolicyModule
        env = gym.make("CartPole-v1")

        def build(dtype):
            return RLModuleSpec(module_class=MoEPolicyModule, observation_space=env.observation_space,
                                action_space=env.action_space, inference_only=True,
                                model_config={"moe": dict(MOE_DEFAULTS, inference_dtype=dtype)}).build()
        fp32, bf16 = build("fp32"), build("bf16")
        bf16.set_state(fp32.get_state())
        obs = torch.randn(2048, 4)
        outs = []
        for m in (fp32, bf16):
            m.to(dev)
            with torch.no_grad():
                outs.append(m.forward_inference({Columns.OBS: obs.to(dev)}))
        lp = [torch.log_softmax(o[Columns.ACTION_DIST_INPUTS].double(), -1)[:, 0].cpu() for o in outs]
        k3 = drift_metrics(lp[0], lp[1])["k3"]
        topk = [o[MOE_TOPK].long().cpu() for o in outs]
        agree = routing_agreement([topk[0][:, i] for i in range(topk[0].shape[1])],
                                  [topk[1][:, i] for i in range(topk[1].shape[1])])["routing_agreement"]
        assert k3 < 1e-2 and agree > 0.9, (k3, agree)
        return f"K3 {k3:.2e}, routing agreement {agree:.3f}"

    import ray

    from moe_rl import MoEPPOConfig
    from moe_rl.app.train import start_local_ray
    from moe_rl.core.digests import differing
    from moe_rl.rllib.runner import runner_digests
    start_local_ray(num_cpus=4, num_gpus=0 if cpu else 1)
    algo = None
    try:
        @step("3 DeepSpeed ep_size 1 on NCCL")
        def _():
            nonlocal algo
            algo = (MoEPPOConfig().environment("CartPole-v1")
                    .env_runners(num_env_runners=1, num_envs_per_env_runner=4)
                    .learners(num_learners=1, num_gpus_per_learner=0 if cpu else 1)
                    .training(train_batch_size_per_learner=1000, minibatch_size=250, num_epochs=2)
                    .moe(inference_dtype="bf16").deepspeed(enabled=True)
                    .weight_sync(transport="collective", backend="gloo")
                    .debugging(seed=0)).build_algo()
            backend = algo.learner_group.foreach(lambda l: torch.distributed.get_backend())[0]
            device = algo.learner_group.foreach(lambda l: str(next(l.module["default_policy"].parameters()).device))[0]
            for _ in range(2):
                result = algo.train()
            assert cpu or (backend == "nccl" and device.startswith("cuda")), (backend, device)
            return f"backend {backend}, learner on {device}, return {result['env_runners']['episode_return_mean']:.1f}"

        @step("4 collective weight sync")
        def _():
            ws = algo.gate.weights.transport
            _, digests = algo.runner_call(runner_digests)
            bad = {m: differing(algo.gate.weights.digests[m], d[m]) for d in digests for m in d}
            assert ws.fallbacks == 0 and not any(bad.values()), (ws.fallbacks, bad)
            return f"{ws.last_seconds * 1e3:.1f} ms, version {algo.weights_version}, copies bit-exact (bf16)"

        @step("5 consistency check")
        def _():
            rows = algo.sync_gate.ledger()
            assert rows and rows[-1]["decision"] in ("sync", "warn"), rows[-1:]
            r = rows[-1]
            return (f"{len(rows)} checks, decision {r['decision']}, K3 {r.get('k3', float('nan')):.2e}, "
                    f"agreement {r.get('routing_agreement', float('nan')):.3f}")
    finally:
        if algo is not None:
            algo.stop()
        ray.shutdown()
    failed = [n for n, ok in RESULTS if not ok]
    print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} passed" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
