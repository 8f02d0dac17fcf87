"""Multi-task MiniGrid, the benchmark of MOORE (Hendawy et al., ICLR 2024), as one gymnasium env.

Each episode plays one MiniGrid task. The observation is the agent's egocentric 7x7x3 symbolic grid
(minigrid's ImgObsWrapper: object, colour and state indices as uint8) and a one-hot task id:

    {"image": Box(0, 255, (7, 7, 3), uint8), "task": Box(0, 1, (num_tasks,), float32)}

Every task keeps its own `max_steps` (MiniGrid truncates; this env adds no time limit of its own)
and MiniGrid's own reward: 1 - 0.9 * steps / max_steps on success, else 0. `info` carries the task's
name (`task`), its index (`task_id`) and, at the end of an episode, `success` and `num_tasks`.

Equal share of env steps per task (the protocol's budget is per task): a reset plays the task that
has taken the fewest steps in this env so far (ties by list order), so long-episode tasks do not
crowd out short ones and every vectorised copy balances itself. `reset(options={"task_id": k})`
pins a task (per-task evaluation).

The suites (each `MiniGrid-<name>-v0`), from MOORE's code:
    MT3  LavaGapS7, RedBlueDoors-6x6, MemoryS11
    MT5  DoorKey-6x6, LavaGapS7, RedBlueDoors-6x6, DistShift1, MemoryS11
    MT7  DoorKey-6x6, DistShift1, RedBlueDoors-6x6, LavaGapS7, MemoryS11, SimpleCrossingS9N2, MultiRoom-N2-S4
"""
from __future__ import annotations

import difflib
from typing import List, Optional, Sequence

import gymnasium as gym
import numpy as np
from gymnasium import spaces

SUITES = {
    "MT3": ("LavaGapS7", "RedBlueDoors-6x6", "MemoryS11"),
    "MT5": ("DoorKey-6x6", "LavaGapS7", "RedBlueDoors-6x6", "DistShift1", "MemoryS11"),
    "MT7": ("DoorKey-6x6", "DistShift1", "RedBlueDoors-6x6", "LavaGapS7", "MemoryS11", "SimpleCrossingS9N2",
            "MultiRoom-N2-S4"),
}


def minigrid_id(task: str) -> str:
    """'DoorKey-6x6' and 'MiniGrid-DoorKey-6x6-v0' both name MiniGrid-DoorKey-6x6-v0."""
    return task if task.startswith("MiniGrid-") else f"MiniGrid-{task}-v0"


def short_name(env_id: str) -> str:
    """MiniGrid-DoorKey-6x6-v0 -> DoorKey-6x6 (the per-task metric names)."""
    name = env_id[len("MiniGrid-"):] if env_id.startswith("MiniGrid-") else env_id
    return name.rsplit("-v", 1)[0] if name.rsplit("-v", 1)[-1].isdigit() else name


def check_tasks(tasks) -> List[str]:
    """The task list as MiniGrid ids, or ValueError naming `tasks` (and the nearest registered ids)."""
    import minigrid  # noqa: F401  registers the MiniGrid-* ids

    if isinstance(tasks, str) or not isinstance(tasks, Sequence) or not tasks:
        raise ValueError(f"tasks: must be a non-empty list of MiniGrid task ids (e.g. [DoorKey-6x6, LavaGapS7]) "
                         f"or a suite name {sorted(SUITES)}, got {tasks!r}")
    known = sorted(k for k in gym.registry if k.startswith("MiniGrid-"))
    ids = []
    for i, task in enumerate(tasks):
        if not isinstance(task, str) or minigrid_id(task) not in gym.registry:
            near = difflib.get_close_matches(minigrid_id(str(task)), known, n=3)
            raise ValueError(f"tasks[{i}]: unknown MiniGrid task {task!r}"
                             + (f"; nearest registered ids: {', '.join(near)}" if near else ""))
        ids.append(minigrid_id(task))
    if len(set(ids)) != len(ids):
        raise ValueError(f"tasks: each task once, got {list(tasks)!r}")
    return ids


class MultiTaskMiniGrid(gym.Env):
    """tasks: a suite name ("MT3" / "MT5" / "MT7") or a list of MiniGrid ids (short or full)."""

    metadata = {"render_modes": []}

    def __init__(self, tasks="MT3"):
        from minigrid.wrappers import ImgObsWrapper

        ids = check_tasks(SUITES[tasks] if isinstance(tasks, str) and tasks in SUITES else tasks)
        self.task_ids = ids
        self.task_names = [short_name(i) for i in ids]
        self.envs = [ImgObsWrapper(gym.make(i)) for i in ids]
        first = self.envs[0]
        for i, env in enumerate(self.envs[1:], 1):
            if env.action_space != first.action_space or env.observation_space != first.observation_space:
                raise ValueError(f"tasks[{i}]: {ids[i]} has action space {env.action_space} and observation space "
                                 f"{env.observation_space}; {ids[0]} has {first.action_space} and "
                                 f"{first.observation_space} (all tasks must share both)")
        self.num_tasks = len(ids)
        self.observation_space = spaces.Dict({
            "image": first.observation_space,
            "task": spaces.Box(0.0, 1.0, (self.num_tasks,), np.float32)})
        self.action_space = first.action_space
        self.max_steps = [env.unwrapped.max_steps for env in self.envs]
        self._steps_per_task = np.zeros(self.num_tasks, np.int64)
        self._one_hot = np.eye(self.num_tasks, dtype=np.float32)
        self._task: Optional[int] = None

    def _obs(self, image):
        return {"image": image, "task": self._one_hot[self._task]}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:   # every task's own generator from this one seed: episodes replay exactly
            for i, env in enumerate(self.envs):
                env.reset(seed=int(seed) * 1_000 + i)
            self._steps_per_task[:] = 0
        task = (options or {}).get("task_id")
        if task is None:
            task = int(np.argmin(self._steps_per_task))
        elif not (isinstance(task, (int, np.integer)) and 0 <= task < self.num_tasks):
            raise ValueError(f"task_id: must be an int in [0, {self.num_tasks - 1}], got {task!r}")
        self._task = int(task)
        image, _ = self.envs[self._task].reset()
        return self._obs(image), {"task": self.task_names[self._task], "task_id": self._task}

    def step(self, action):
        if self._task is None:
            raise RuntimeError("MultiTaskMiniGrid: call reset() before step()")
        image, reward, terminated, truncated, _ = self.envs[self._task].step(action)
        self._steps_per_task[self._task] += 1
        info = {"task": self.task_names[self._task], "task_id": self._task}
        if terminated or truncated:
            info["success"] = bool(terminated and reward > 0)
            info["num_tasks"] = self.num_tasks
        return self._obs(image), float(reward), terminated, truncated, info

    def close(self):
        for env in self.envs:
            env.close()
