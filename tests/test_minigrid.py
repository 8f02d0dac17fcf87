"""Multi-task MiniGrid (MOORE's suites): the env, the image encoder, the task router's input, per-task
figures from a real 2-iteration run, per-task evaluation, and bad env configs refused up front."""
import os
import subprocess
import sys
import warnings

import gymnasium as gym
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from gymnasium.utils.env_checker import check_env

import moe_rl.envs  # noqa: F401
from moe_rl.app.run_config import load_run_config, validate_run_config
from moe_rl.core.encoders import ObservationEncoder
from moe_rl.core.errors import ConfigError
from moe_rl.core.policy import MoEMLPTrunk
from moe_rl.core.settings import MOE_DEFAULTS, validate_moe
from moe_rl.envs.minigrid_mt import SUITES, MultiTaskMiniGrid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_suites_pass_the_env_checker_and_keep_each_tasks_time_limit(suite):
    env = gym.make(f"moe_rl/MiniGrid-{suite}-v0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    inner = env.unwrapped
    assert len(inner.task_names) == int(suite[2:])
    assert env.observation_space["image"].shape == (7, 7, 3)
    assert env.observation_space["task"].shape == (len(inner.task_names),)
    defaults = {"DoorKey-6x6": 360, "DistShift1": 252, "RedBlueDoors-6x6": 720, "LavaGapS7": 196,
                "MemoryS11": 605, "SimpleCrossingS9N2": 324, "MultiRoom-N2-S4": 40}
    assert inner.max_steps == [defaults[n] for n in inner.task_names]
    assert env.spec.max_episode_steps is None   # no time limit of our own on top of the tasks'


def _episodes(seed, steps=1500):
    env = MultiTaskMiniGrid("MT3")
    rng = np.random.default_rng(0)
    obs, info = env.reset(seed=seed)
    trace = []
    for _ in range(steps):
        obs, r, term, trunc, info = env.step(int(rng.integers(7)))
        trace.append((obs["image"].tobytes(), obs["task"].tobytes(), r, term, trunc))
        if term or trunc:
            obs, info = env.reset()
    return trace, env


def test_same_seed_same_episodes_and_every_task_gets_its_share_of_steps():
    a, env = _episodes(3)
    b, _ = _episodes(3)
    c, _ = _episodes(4)
    assert a == b and a != c
    steps = env._steps_per_task
    assert steps.min() > 0 and steps.max() - steps.min() <= max(env.max_steps)


@pytest.mark.pure
def test_the_sequential_schedule_plays_the_tasks_in_order_then_cycles_and_names_its_segment():
    """Each episode plays the task of the block its first step falls in (segment s: task s mod 3),
    the blocks advance with this copy's steps x copies, and the last block plays on after the last
    cycle. Every info names the segment: the anomaly watch restarts its series there."""
    env = MultiTaskMiniGrid("MT3", schedule="sequential", steps_per_task=400, cycles=2, copies=2)
    rng = np.random.default_rng(0)
    obs, info = env.reset(seed=0)
    starts = [(info["segment"], info["task_id"])]
    for step in range(1, 2_000):
        obs, r, term, trunc, info = env.step(int(rng.integers(7)))
        assert info["segment"] == min(step * 2 // 400, 5)
        if term or trunc:
            obs, info = env.reset()
            starts.append((info["segment"], info["task_id"]))
    assert all(task == seg % 3 for seg, task in starts)
    assert [seg for seg, _ in starts] == sorted(seg for seg, _ in starts) and starts[-1][0] == 5
    assert len({seg for seg, _ in starts}) >= 4   # random play ends episodes in most blocks
    assert "segment" not in MultiTaskMiniGrid("MT3").reset(seed=0)[1]   # the balanced mix has none


def test_a_real_env_runner_reports_the_segment_into_the_metrics_row():
    """TaskEpisodeMetrics on an RLlib EnvRunner -> `task_segment` (the latest block of the episodes
    ended) -> the metrics row's column."""
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner

    from moe_rl import MoEPPOConfig
    from moe_rl.algo.results import task_columns
    config = (MoEPPOConfig().environment("moe_rl/MiniGrid-MT3-v0",
                                         env_config={"schedule": "sequential", "steps_per_task": 300, "cycles": 2})
              .env_runners(num_envs_per_env_runner=1).moe(num_experts=4, top_k=2, d_model=16, d_ff=16))
    runner = SingleAgentEnvRunner(config=config)
    try:
        runner.sample(num_timesteps=1_500, random_actions=True)
        row = task_columns(runner.get_metrics())
    finally:
        runner.stop()
    assert 1 <= row["task_segment"] <= 5
    assert sum(k.endswith("/return") for k in row) >= 2   # per-task figures go on beside it


def test_rewards_are_minigrids_own_and_success_is_reported():
    env = MultiTaskMiniGrid(["MultiRoom-N2-S4", "LavaGapS7"])
    seen = {}
    rng = np.random.default_rng(1)
    obs, info = env.reset(seed=1)
    for ep in range(60):
        obs, info = env.reset()
        done = False
        while not done:
            obs, r, term, trunc, info = env.step(int(rng.integers(3)))   # left, right, forward
            done = term or trunc
        assert info["success"] == (r > 0)
        assert r == 0 or 0 < r <= 1
        seen.setdefault(info["task"], set()).add(info["success"])
    assert set(seen) == {"MultiRoom-N2-S4", "LavaGapS7"}


def test_reset_option_pins_the_task_and_one_hot_matches():
    env = MultiTaskMiniGrid("MT5")
    for k in range(5):
        obs, info = env.reset(seed=0, options={"task_id": k})
        assert info["task_id"] == k and obs["task"].argmax() == k and obs["task"].sum() == 1
    with pytest.raises(ValueError, match="task_id"):
        env.reset(options={"task_id": 5})


@pytest.mark.pure
def test_the_task_router_receives_each_rows_own_task_id():
    space = gym.make("moe_rl/MiniGrid-MT3-v0").observation_space
    s = validate_moe({**MOE_DEFAULTS, "router": "task", "router_kwargs": {"num_tasks": 3}, "num_experts": 4,
                      "num_layers": 2, "task_slice": [0, 3]})
    trunk = MoEMLPTrunk(ObservationEncoder(space, "auto", [0, 3]), s)
    assert trunk.encoder.cnn is not None                 # auto picks the CNN for the image
    seen = []
    for block in trunk.blocks:
        block.moe.router.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(kwargs["task_ids"]),
                                                   with_kwargs=True)
    tasks = torch.tensor([2, 0, 1, 1, 0, 2])
    obs = {"image": torch.randint(0, 10, (6, 7, 7, 3)).float(), "task": torch.eye(3)[tasks]}
    trunk(obs)
    assert len(seen) == 2 and all(torch.equal(t, tasks) for t in seen)
    # Same grids, other task ids: the router's choice moves with the task alone.
    with torch.no_grad():
        trunk.blocks[0].moe.router.task_embedding.weight.copy_(torch.randn(3, 16) * 10)
    _, rec_a = trunk(obs)
    _, rec_b = trunk({**obs, "task": torch.eye(3)[(tasks + 1) % 3]})
    assert not torch.equal(rec_a[0].top_k_indices, rec_b[0].top_k_indices)


@pytest.mark.pure
def test_encoder_setting_is_checked_against_the_observation():
    from moe_rl.core.encoders import resolve_encoder
    assert resolve_encoder("auto", gym.spaces.Box(0, 1, (4,))) == "flat"
    assert resolve_encoder("auto", gym.spaces.Box(0, 255, (7, 7, 3))) == "conv"
    with pytest.raises(ConfigError, match="moe.encoder: 'conv' needs an image"):
        resolve_encoder("conv", gym.spaces.Box(0, 1, (4,)))


def _mt3(*overrides):
    from moe_rl.app.run_config import apply_overrides
    return apply_overrides(load_run_config(os.path.join(ROOT, "configs", "minigrid_mt3.yaml")), list(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["env_config={tasks: [DoorKey-6x7, LavaGapS7]}"],
     "env_config.tasks[0]: unknown MiniGrid task 'DoorKey-6x7'; nearest registered ids: MiniGrid-DoorKey-6x6-v0"),
    (["env_config={tasks: [DoorKey-6x6, Dynamic-Obstacles-5x5]}"],
     "env_config.tasks[1]: MiniGrid-Dynamic-Obstacles-5x5-v0 has action space Discrete(3)"),
    (["env_config={tasks: []}"], "env_config.tasks: must be a non-empty list"),
    (["env=moe_rl/MiniGrid-MT5-v0", "moe.router_kwargs.num_tasks=3"],
     "moe.router_kwargs.num_tasks: must be 5 or unset: moe_rl/MiniGrid-MT5-v0 has 5 tasks (DoorKey-6x6, LavaGapS7, "
     "RedBlueDoors-6x6, DistShift1, MemoryS11), got 3"),
    (["env=moe_rl/MiniGrid-MT5-v0", "moe.task_slice=[0, 3]"], "moe.task_slice: must be [0, 5] or unset"),
    (["moe.encoder=cnn"], "moe.encoder: must be one of ('auto', 'flat', 'conv')"),
])
def test_bad_env_configs_fail_before_any_actor_starts(overrides, message):
    """A task count or slice is an error only where the user set it against the env's own."""
    with pytest.raises(ConfigError) as e:
        validate_run_config(_mt3(*overrides))
    assert str(e.value).startswith(message), str(e.value)


@pytest.mark.slow
def test_a_two_iteration_mt3_run_writes_per_task_figures_and_evaluates_per_task(tmp_path):
    """Small batches; 3 envs x 2 000 steps end an episode of every task (<= 196 + 720 + 605 steps)."""
    out = tmp_path / "mt3"
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    p = subprocess.run([sys.executable, "-m", "moe_rl.app.cli", "train", "--config",
                        os.path.join(ROOT, "configs", "minigrid_mt3.yaml"), "--iterations", "2", "--output", str(out),
                        "--set", "env_runners.num_envs_per_env_runner=3",
                        "--set", "training.train_batch_size_per_learner=3000", "--set", "training.minibatch_size=1000",
                        "--set", "training.num_epochs=1"],
                       capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    table = pq.read_table(out / "metrics.parquet").to_pylist()
    tasks = ("LavaGapS7", "RedBlueDoors-6x6", "MemoryS11")
    def ended(row, task):   # a figure, not NaN: an episode of the task ended in that iteration
        v = row.get(f"task/{task}/return")
        return v is not None and v == v

    for task in tasks:   # figures are over the episodes that ended in an iteration: look in both
        row = next(r for r in table if ended(r, task))
        assert 0 <= row[f"task/{task}/success"] <= 1 and row[f"task/{task}/length"] >= 1
        for layer in (0, 1):
            shares = [row.get(f"task/{task}/experts/layer{layer}/e{e}") for e in range(4)]
            assert abs(sum(shares) - 1) < 1e-6, shares
    for row in table:
        if all(ended(row, t) for t in tasks):
            returns = [row[f"task/{t}/return"] for t in tasks]
            assert row["task_return_mean"] == pytest.approx(np.mean(returns))
            assert row["task_return_min"] == min(returns)
        else:
            assert row.get("task_return_mean") is None   # an average over some tasks is not the average
    p = subprocess.run([sys.executable, "-m", "moe_rl.app.cli", "evaluate", str(out), "--episodes", "1"],
                       capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["task", "sampled", "return"]
    assert [line.split()[0] for line in lines[1:4]] == ["LavaGapS7", "RedBlueDoors-6x6", "MemoryS11"]
    assert lines[-1].startswith("average over tasks")


def test_the_task_router_takes_its_task_count_from_the_env():
    """A user's own four-task mix through the MT3 config, with no other key set."""
    config = validate_run_config(_mt3('env_config={"tasks": [LavaGapS7, RedBlueDoors-6x6, MemoryS11, DoorKey-6x6]}'))
    assert list(config.moe_settings.task_slice) == [0, 4] and config.moe_settings.router_kwargs["num_tasks"] == 4
