"""RLlib's own tuned PPO, as a user would run it instead of moe-rl (a time-to-target peer).

    python bench/peers/rllib_tuned_ppo.py --env CartPole-v1 --seed 0 --target 450 [--max-steps 300000]

CartPole-v1: the settings of RLlib's `tuned_examples/ppo/cartpole_ppo.py` (one linear hidden layer of
32 shared by policy and value, lr 3e-4, 6 epochs, vf_loss_coeff 0.01, RLlib's defaults otherwise:
2 env runners, batch 4 000, minibatch 128, KL loss). Acrobot-v1: RLlib has no tuned PPO for it, so
its defaults with the same 6 epochs and lr 3e-4 (and a [64, 64] tanh MLP).
Prints one line per iteration in moe-rl's format (`iter N  steps S  return R`), R the mean over the
last 100 or more training episodes as moe-rl computes it (moe_rl.algo.results.rolling_return_mean),
and stops at the target.
"""
import argparse
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from ray.rllib.algorithms.ppo import PPOConfig  # noqa: E402
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig  # noqa: E402

from moe_rl.algo.results import metrics_row, rolling_return_mean  # noqa: E402

MODELS = {
    "CartPole-v1": dict(fcnet_hiddens=[32], fcnet_activation="linear", vf_share_layers=True),
    "Acrobot-v1": dict(fcnet_hiddens=[64, 64], fcnet_activation="tanh"),
}
TRAINING = {
    "CartPole-v1": dict(lr=3e-4, num_epochs=6, vf_loss_coeff=0.01),
    "Acrobot-v1": dict(lr=3e-4, num_epochs=6),
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--env", default="CartPole-v1", choices=sorted(MODELS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, required=True)
    p.add_argument("--max-steps", type=int, default=300_000)
    args = p.parse_args()
    config = (PPOConfig().environment(args.env).debugging(seed=args.seed)
              .training(**TRAINING[args.env])
              .rl_module(model_config=DefaultModelConfig(**MODELS[args.env])))
    from moe_rl.app.train import start_local_ray
    start_local_ray(num_cpus=max(os.cpu_count() or 1, config.num_env_runners + 1))
    algo = config.build_algo()
    try:
        steps, rows = 0, []
        while steps < args.max_steps:
            rows.append(metrics_row(algo.train()))
            steps, ret = rows[-1]["env_steps_total"], rolling_return_mean(rows)
            print(f"iter {rows[-1]['iteration']:4d}  steps {steps:8d}  return {ret:8.2f}", flush=True)
            if ret >= args.target:
                break
    finally:
        algo.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
