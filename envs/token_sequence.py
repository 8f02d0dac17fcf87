"""Token-sequence environment: read a random prompt, then emit a sequence derived from it.

The agent writes one token per step after a prompt of random tokens. The target is the prompt
copied, reversed or sorted (`task`), repeated cyclically or cut to seq_len tokens. Each correct
token pays 1 / seq_len, so the return is the fraction of correct tokens (at most 1.0) and the
dense credit lets PPO make progress on a CPU at short lengths.
"""
import gymnasium as gym
import numpy as np
from gymnasium import spaces

from moe_rl.envs.multitask import check_int_arg

TASKS = {
    "copy": lambda prompt: prompt,
    "reverse": lambda prompt: prompt[::-1],
    "sort": np.sort,
}
MIN_SEQ_LEN, MAX_SEQ_LEN = 8, 1024


class TokenSequenceEnv(gym.Env):
    """Emit `seq_len` tokens from Discrete(vocab_size) that match a target built from the prompt.

    Observation: {"tokens": int64[max_len], "position": int64[1]} with max_len = prompt_len +
    seq_len. "tokens" holds the prompt then the tokens emitted so far, -1 in unfilled slots;
    "position" counts the filled slots (prompt_len after reset, max_len at the end). The episode
    terminates after seq_len emitted tokens.
    """

    metadata = {"render_modes": []}

    def __init__(self, vocab_size=8, seq_len=16, prompt_len=None, task="copy"):
        self.vocab_size = check_int_arg("vocab_size", vocab_size, 2)
        self.seq_len = check_int_arg("seq_len", seq_len, MIN_SEQ_LEN, MAX_SEQ_LEN)
        self.prompt_len = check_int_arg(
            "prompt_len", self.seq_len if prompt_len is None else prompt_len, 1, MAX_SEQ_LEN
        )
        if task not in TASKS:
            raise ValueError(f"task: must be one of {', '.join(map(repr, TASKS))}, got {task!r}")
        self.task = task
        self.max_len = self.prompt_len + self.seq_len

        self.observation_space = spaces.Dict({
            "tokens": spaces.Box(-1, self.vocab_size - 1, shape=(self.max_len,), dtype=np.int64),
            "position": spaces.Box(0, self.max_len, shape=(1,), dtype=np.int64),
        })
        self.action_space = spaces.Discrete(self.vocab_size)
        self._tokens = np.full(self.max_len, -1, dtype=np.int64)
        self._target = []
        self._position = self.max_len  # no episode in progress until reset()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        prompt = self.np_random.integers(self.vocab_size, size=self.prompt_len)
        self._tokens.fill(-1)
        self._tokens[:self.prompt_len] = prompt
        self._target = np.resize(TASKS[self.task](prompt), self.seq_len).tolist()
        self._position = self.prompt_len
        return self._observation(), {}

    def step(self, action):
        position = self._position
        if position >= self.max_len:
            raise RuntimeError("TokenSequenceEnv: episode is over (or never began); call reset()")
        if not 0 <= action < self.vocab_size:
            raise ValueError(f"action: must be an int in [0, {self.vocab_size - 1}], got {action!r}")
        self._tokens[position] = action
        reward = 1.0 / self.seq_len if action == self._target[position - self.prompt_len] else 0.0
        self._position = position = position + 1
        return self._observation(), reward, position == self.max_len, False, {}

    def _observation(self):
        # Copies: callers keep observations (rollout buffers), and _tokens is reused in place.
        return {
            "tokens": self._tokens.copy(),
            "position": np.array([self._position], dtype=np.int64),
        }
