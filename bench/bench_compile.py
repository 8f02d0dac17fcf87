"""torch.compile on the quickstart MoE-PPO learner: eager vs the RLModule's forward passes
compiled with inductor, same seed, one process, one run.

    .venv/bin/python bench/bench_compile.py [--iterations 6] [--json OUT]

Reports wall time and the learner update (`learn_s`) per iteration, and the returns (compiled code
must learn the same). The modules are compiled through RLlib's own `TorchRLModule.compile` on the
learner: `config.framework(torch_compile_learner=True)` with FORWARD_TRAIN compiles nothing in Ray
2.60 (TorchLearner.build tests `isinstance(self._module, TorchRLModule)` on the MultiRLModule
instead of on each module).
"""
import argparse
import json
import os
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from ray.rllib.core.rl_module.torch.torch_compile_config import TorchCompileConfig  # noqa: E402

from moe_rl import MoEPPOConfig  # noqa: E402


def compile_modules(learner) -> None:
    for mid in learner.module.keys():
        learner.module[mid].compile(TorchCompileConfig(torch_dynamo_backend="inductor"))


def run(compiled: bool, iterations: int) -> dict:
    config = (MoEPPOConfig().environment("CartPole-v1").env_runners(num_env_runners=1, num_envs_per_env_runner=8)
              .training(lr=3e-4, train_batch_size_per_learner=4000, minibatch_size=256, num_epochs=6,
                        vf_loss_coeff=0.5, vf_clip_param=1000.0)
              .moe(num_experts=8, top_k=2, num_layers=2, d_model=64, d_ff=64)
              .consistency(enabled=False).debugging(seed=0))
    algo = config.build_algo()
    if compiled:
        algo.learner_group.foreach(compile_modules)
    row = {"compiled": compiled, "iter_s": [], "learn_s": [], "return": []}
    try:
        for _ in range(iterations):
            t0 = time.perf_counter()
            result = algo.train()
            row["iter_s"].append(time.perf_counter() - t0)
            row["learn_s"].append(result["moe_rl"]["learn_s"])
            row["return"].append(float(result["env_runners"]["episode_return_mean"]))
    finally:
        algo.stop()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--json")
    args = ap.parse_args()
    from moe_rl.app.train import start_local_ray
    start_local_ray(num_cpus=4)
    rows = [run(False, args.iterations), run(True, args.iterations)]
    ray.shutdown()
    eager, comp = rows
    steady = slice(1, None)
    ratio = sum(comp["learn_s"][steady]) / sum(eager["learn_s"][steady])
    print(f"first iteration: eager {eager['iter_s'][0]:.1f} s, compiled {comp['iter_s'][0]:.1f} s; learner "
          f"update after it: compiled / eager = {ratio:.2f}; same returns: {eager['return'] == comp['return']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
