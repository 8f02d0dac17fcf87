"""MoE-APPO against the APPO a user would run, by BENCHMARKS.md's fair-peer rule, in one run.

    .venv/bin/python bench/bench_appo.py --seeds 0-4            # resumable; seeds in turn, arms interleaved
    .venv/bin/python bench/bench_appo.py --report

Arms (CartPole-v1, the same rollout actors and learners for all: configs/appo_cartpole.yaml's 2
env runners x 4 envs, the learner in the driver):
  stock_appo   RLlib's own tuned CartPole APPO (rllib/examples/algorithms/appo/cartpole_appo.py on
               Ray's master): APPOConfig with circular_buffer_iterations_per_batch 2, vf_loss_coeff
               0.05, entropy_coeff 0.0, lambda_ 0.95, DefaultModelConfig(vf_share_layers=True) (its
               256x256 model, value layers shared); everything else APPO's defaults
  moe_appo     MoE-APPO, configs/appo_cartpole.yaml as it is (8 experts, top-2, bias router, the
               check before every 10th update)
  dense_appo   the same MoE-APPO loop and config with each MoE layer a dense one of the same active
               width (moe.mixture dense, router topk): what the loop does without the mixture
The metric, fixed before the runs: the mean training return over the 20 k..200 k env-step grid
(the curve's value at each 20 k mark, the last point at or before it), and the env steps and wall
seconds at which the return first reached 150; env steps/s over the whole run (training included);
env steps trained per step sampled. One JSON per (arm, seed) under bench/results/appo_fair/.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import peer_curves  # noqa: E402

RESULTS = os.path.join(HERE, "results", "appo_fair")
ARMS = ("stock_appo", "moe_appo", "dense_appo")
METRIC = peer_curves.Metric(budget=200_000, grid=range(20_000, 200_001, 20_000), target=150.0,
                            pairs=(("moe_appo", "stock_appo"), ("moe_appo", "dense_appo"),
                                   ("dense_appo", "stock_appo")))


def build(arm: str, seed: int):
    from ray.rllib.algorithms.appo import APPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig

    cfg = peer_curves.config_at_seed("appo_cartpole.yaml", seed)
    if arm in ("moe_appo", "dense_appo"):
        return peer_curves.through_our_loop(cfg, dense=arm == "dense_appo")
    return (APPOConfig().environment("CartPole-v1")
            .env_runners(**cfg["env_runners"]).learners(**cfg["learners"])
            .training(circular_buffer_iterations_per_batch=2, vf_loss_coeff=0.05, entropy_coeff=0.0, lambda_=0.95)
            .rl_module(model_config=DefaultModelConfig(vf_share_layers=True))
            .debugging(seed=seed))


if __name__ == "__main__":
    peer_curves.main(__doc__, ARMS, build, METRIC, RESULTS, lambda arm, seed: f"cartpole-{arm}-seed{seed}.json")
