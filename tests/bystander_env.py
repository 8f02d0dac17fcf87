"""CartPole that pays nothing while a hold file exists: a bystander run that lasts as long as the
test needs and then finishes on its own (stop_return) once the file is removed."""
import os

import gymnasium as gym

HOLD_FILE_ENV = "MOE_RL_BYSTANDER_HOLD"


class HeldCartPole(gym.Wrapper):
    def __init__(self, config=None):
        super().__init__(gym.make("CartPole-v1"))

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        return obs, 0.0 if os.path.exists(os.environ[HOLD_FILE_ENV]) else reward, terminated, truncated, info
