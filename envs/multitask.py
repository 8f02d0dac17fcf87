"""Multi-task contextual bandit whose tasks demand conflicting actions.

Each episode draws one task t. Every step shows a fresh feature vector x and pays 1 for the
action argmax(W_t @ x), 0 for any other. The W_t are independent random matrices, so the same x
calls for a different action under most pairs of tasks: one small dense policy has to squeeze
num_tasks unrelated decision rules into shared weights, while MoE experts can each take a task.
The task id is appended as a one-hot block so a router (or any policy) can read it.
"""
import gymnasium as gym
import numpy as np
from gymnasium import spaces


def check_int_arg(name, value, low, high=None):
    """Return `value` if it is an int in [low, high]; else raise ValueError naming `name`.

    Shared by the envs package so every bad argument reads "name: must be ..., got ...".
    """
    allowed = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    is_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
    if not is_int or value < low or (high is not None and value > high):
        raise ValueError(f"{name}: must be {allowed}, got {value!r}")
    return int(value)


class MultiTaskEnv(gym.Env):
    """Per-episode task, per-step features; reward 1 for argmax(W_task @ features).

    Observation: float32 vector of length obs_dim + num_tasks in [-1, 1]: the features x
    (uniform in [-1, 1)) followed by the one-hot task id; `task_slice` = (obs_dim, num_tasks)
    locates that block and info["task_id"] repeats it (info["task"] names it, "task{k}", for the
    per-task figures of moe_rl.rllib.task_metrics). The optimal return is episode_length;
    a uniform random policy expects episode_length / n_actions.

    `seed` fixes the task matrices only, so every copy of the env (one per rollout worker, say)
    poses the same tasks; episodes are drawn from the generator seeded by reset(seed=...).
    Episodes end with truncated=True: the observation carries no clock, and every step is an
    independent decision, so the horizon is a time limit rather than a terminal state.
    reset(options={"task_id": k}) pins the task, e.g. to evaluate one task at a time.
    """

    metadata = {"render_modes": []}

    def __init__(self, num_tasks=4, obs_dim=8, n_actions=4, episode_length=32, seed=0):
        self.num_tasks = check_int_arg("num_tasks", num_tasks, 2)
        self.obs_dim = check_int_arg("obs_dim", obs_dim, 1)
        self.n_actions = check_int_arg("n_actions", n_actions, 2)
        self.episode_length = check_int_arg("episode_length", episode_length, 1)
        seed = check_int_arg("seed", seed, 0)

        self.task_weights = np.random.default_rng(seed).standard_normal(
            (self.num_tasks, self.n_actions, self.obs_dim)
        )
        self.task_slice = (self.obs_dim, self.num_tasks)
        self.observation_space = spaces.Box(
            -1.0, 1.0, shape=(self.obs_dim + self.num_tasks,), dtype=np.float32
        )
        self.action_space = spaces.Discrete(self.n_actions)
        self._task = 0
        self._t = self.episode_length  # no episode in progress until reset()

    def best_action(self, obs):
        """The rewarded action for an observation (features and task id both read from it)."""
        start, n = self.task_slice
        task = int(np.argmax(obs[start:start + n]))
        return int(np.argmax(self.task_weights[task] @ obs[:start]))

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        rng = self.np_random
        task = (options or {}).get("task_id")
        if task is None:
            task = int(rng.integers(self.num_tasks))
        else:
            task = check_int_arg("task_id", task, 0, self.num_tasks - 1)

        # The whole episode is drawn here so step() only indexes: rows 0..L are the L + 1
        # observations of the episode, and _best[i] is the action that row i rewards.
        length = self.episode_length
        features = rng.random((length + 1, self.obs_dim), dtype=np.float32) * 2 - 1
        self._obs = np.zeros((length + 1, self.obs_dim + self.num_tasks), dtype=np.float32)
        self._obs[:, :self.obs_dim] = features
        self._obs[:, self.obs_dim + task] = 1.0
        self._best = np.argmax(features[:length] @ self.task_weights[task].T, axis=1).tolist()
        self._task = task
        self._t = 0
        return self._obs[0], {"task_id": task, "task": f"task{task}"}

    def step(self, action):
        t = self._t
        if t >= self.episode_length:
            raise RuntimeError("MultiTaskEnv: episode is over (or never began); call reset()")
        if not 0 <= action < self.n_actions:
            raise ValueError(f"action: must be an int in [0, {self.n_actions - 1}], got {action!r}")
        reward = 1.0 if action == self._best[t] else 0.0
        self._t = t = t + 1
        return self._obs[t], reward, False, t == self.episode_length, {
            "task_id": self._task, "task": f"task{self._task}", "num_tasks": self.num_tasks}
