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

A sequential schedule (continual multi-task learning) plays the tasks in order instead, each for
`steps_per_task` env steps, then starts over, `cycles` times; after the last cycle it stays on the
last task. `copies` is how many env copies share the schedule (the run's env runners x envs per
runner; `moe-rl train` fills it in): each copy counts its own steps, so the switch happens at once
in every copy when the run as a whole has taken steps_per_task steps.

    env_config: {tasks: MT5, schedule: sequential, steps_per_task: 100000, cycles: 3}

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

SCHEDULES = ("balanced", "sequential")
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

    def __init__(self, tasks="MT3", schedule: str = "balanced", steps_per_task: Optional[int] = None,
                 cycles: int = 1, copies: int = 1):
        from minigrid.wrappers import ImgObsWrapper

        if schedule not in SCHEDULES:
            raise ValueError(f"schedule: must be one of {SCHEDULES}, got {schedule!r}")
        for name, value in (("cycles", cycles), ("copies", copies)):
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        if schedule == "sequential" and not (isinstance(steps_per_task, int) and steps_per_task >= 1):
            raise ValueError(f"steps_per_task: must be an int >= 1 for schedule 'sequential', got {steps_per_task!r}")
        self.schedule, self.steps_per_task, self.cycles, self.copies = schedule, steps_per_task, cycles, copies
        self._steps_total = 0   # this copy's env steps (the sequential schedule's clock)

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

    @property
    def segment(self) -> int:
        """The sequential schedule's block of steps now (task t of cycle c is segment c * tasks + t)."""
        return min(self._steps_total * self.copies // self.steps_per_task, self.num_tasks * self.cycles - 1)

    def scheduled_task(self) -> int:
        """The task the sequential schedule plays now."""
        return self.segment % self.num_tasks

    @property
    def cycle(self) -> int:
        if self.schedule != "sequential":
            return 0
        return min(self._steps_total * self.copies // self.steps_per_task // self.num_tasks, self.cycles - 1)

    def _obs(self, image):
        return {"image": image, "task": self._one_hot[self._task]}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:   # every task's own generator from this one seed: episodes replay exactly
            for i, env in enumerate(self.envs):
                env.reset(seed=int(seed) * 1_000 + i)
            self._steps_per_task[:] = 0
            self._steps_total = 0
        task = (options or {}).get("task_id")
        if task is None:
            task = self.scheduled_task() if self.schedule == "sequential" else int(np.argmin(self._steps_per_task))
        elif not (isinstance(task, (int, np.integer)) and 0 <= task < self.num_tasks):
            raise ValueError(f"task_id: must be an int in [0, {self.num_tasks - 1}], got {task!r}")
        self._task = int(task)
        image, _ = self.envs[self._task].reset()
        return self._obs(image), self._info()

    def step(self, action):
        if self._task is None:
            raise RuntimeError("MultiTaskMiniGrid: call reset() before step()")
        image, reward, terminated, truncated, _ = self.envs[self._task].step(action)
        self._steps_per_task[self._task] += 1
        self._steps_total += 1
        info = self._info()
        if terminated or truncated:
            info["success"] = bool(terminated and reward > 0)
            info["num_tasks"] = self.num_tasks
        return self._obs(image), float(reward), terminated, truncated, info

    def _info(self):
        info = {"task": self.task_names[self._task], "task_id": self._task}
        if self.schedule == "sequential":   # a planned change of task: the anomaly watch restarts there
            info["segment"] = self.segment
        return info

    def close(self):
        for env in self.envs:
            env.close()
