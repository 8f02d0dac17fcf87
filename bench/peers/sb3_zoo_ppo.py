"""Stable-Baselines3 PPO with RL Zoo's tuned settings (a time-to-target peer; bench-only, not a
dependency: `pip install --target DIR --no-deps stable-baselines3`, then PYTHONPATH=DIR).

    python bench/peers/sb3_zoo_ppo.py --env CartPole-v1 --seed 0 --target 450 [--max-steps 300000]

RL Zoo's hyperparams/ppo.yml: CartPole-v1 8 envs, n_steps 32, batch 256, 20 epochs, gae_lambda 0.8,
gamma 0.98, linear lr 1e-3 and clip 0.2 over 1e5 steps, ent 0; Acrobot-v1 16 envs, n_steps 256,
gae_lambda 0.94, gamma 0.99, 4 epochs, ent 0, VecNormalize (observations and rewards), SB3's
defaults otherwise. Prints a line per update in moe-rl's format, with `return` SB3's own
`ep_rew_mean` (the mean over the last 100 training episodes, unnormalised), stops at the target.
"""
import argparse

from stable_baselines3 import PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.vec_env import VecNormalize


def linear(start):
    return lambda progress_remaining: progress_remaining * start   # RL Zoo's lin_<x>


ZOO = {
    "CartPole-v1": dict(n_envs=8, n_timesteps=100_000, normalize=False,
                        ppo=dict(n_steps=32, batch_size=256, gae_lambda=0.8, gamma=0.98, n_epochs=20,
                                 ent_coef=0.0, learning_rate=linear(1e-3), clip_range=linear(0.2))),
    "Acrobot-v1": dict(n_envs=16, n_timesteps=1_000_000, normalize=True,
                       ppo=dict(n_steps=256, gae_lambda=0.94, gamma=0.99, n_epochs=4, ent_coef=0.0)),
}


class Progress(BaseCallback):
    """A line per rollout; the next env step after a rollout that met the target (or --max-steps) stops."""

    def __init__(self, target, max_steps):
        super().__init__()
        self.target, self.max_steps, self.iteration, self.reached = target, max_steps, 0, False

    def _on_step(self) -> bool:
        return not self.reached and self.num_timesteps < self.max_steps

    def _on_rollout_end(self) -> None:
        self.iteration += 1
        episodes = self.model.ep_info_buffer
        ret = sum(e["r"] for e in episodes) / len(episodes) if episodes else float("nan")
        print(f"iter {self.iteration:4d}  steps {self.num_timesteps:8d}  return {ret:8.2f}", flush=True)
        self.reached = ret >= self.target


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--env", default="CartPole-v1", choices=sorted(ZOO))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, required=True)
    p.add_argument("--max-steps", type=int, default=300_000)
    args = p.parse_args()
    zoo = ZOO[args.env]
    env = make_vec_env(args.env, n_envs=zoo["n_envs"], seed=args.seed)
    if zoo["normalize"]:
        env = VecNormalize(env)
    model = PPO("MlpPolicy", env, seed=args.seed, device="cpu", **zoo["ppo"])
    # total_timesteps as RL Zoo's (its linear schedules run over it); the callback stops at the target
    model.learn(total_timesteps=zoo["n_timesteps"], callback=Progress(args.target, args.max_steps))


if __name__ == "__main__":
    main()
