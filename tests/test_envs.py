"""The envs package: API conformance, determinism, task structure, oracles, argument checks."""
import itertools
import subprocess
import sys
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

from moe_rl import envs
from moe_rl.envs import MultiTaskEnv, TokenSequenceEnv

pytestmark = pytest.mark.pure

TARGETS = {"copy": lambda p: p, "reverse": lambda p: p[::-1], "sort": sorted}


def rollout(env, policy, seed):
    """Play one episode; return (observations, rewards, infos), observations including reset's."""
    obs, info = env.reset(seed=seed)
    observations, rewards, infos = [obs], [], [info]
    done = False
    while not done:
        obs, reward, terminated, truncated, info = env.step(policy(obs))
        observations.append(obs)
        rewards.append(reward)
        infos.append(info)
        done = terminated or truncated
    return observations, rewards, infos


def token_oracle(env):
    """Emit the target, rebuilt from the prompt in the observation rather than read from env."""
    def policy(obs):
        prompt = list(obs["tokens"][:env.prompt_len])
        target = np.resize(TARGETS[env.task](prompt), env.seq_len)
        return int(target[obs["position"][0] - env.prompt_len])
    return policy


def random_policy(env, seed):
    # Not default_rng(seed): that is the very stream reset(seed=seed) draws the episode from.
    rng = np.random.default_rng([seed, 1])
    return lambda obs: int(rng.integers(env.action_space.n))


def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    return np.array_equal(a, b)


# --- API conformance -------------------------------------------------------------------------

@pytest.mark.parametrize("env_id, kwargs", [
    ("moe_rl/MultiTask-v0", {}),
    ("moe_rl/MultiTask-v0", {"num_tasks": 6, "obs_dim": 3, "n_actions": 5, "episode_length": 2}),
    ("moe_rl/TokenSequence-v0", {}),
    ("moe_rl/TokenSequence-v0", {"seq_len": 8, "prompt_len": 3, "task": "sort"}),
    ("moe_rl/TokenSequence-v0", {"seq_len": 1024, "vocab_size": 2, "task": "reverse"}),
])
def test_check_env_passes_without_warnings(env_id, kwargs):
    env = gym.make(env_id, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # check_env reports most problems as warnings
        check_env(env.unwrapped)


def test_registered_ids_accept_keyword_options():
    env = gym.make("moe_rl/MultiTask-v0", num_tasks=6, obs_dim=5, n_actions=3, episode_length=7)
    assert isinstance(env.unwrapped, MultiTaskEnv)
    assert env.observation_space.shape == (5 + 6,)
    assert env.action_space.n == 3
    assert len(rollout(env, lambda obs: 0, seed=0)[1]) == 7

    env = gym.make("moe_rl/TokenSequence-v0", vocab_size=5, seq_len=32, prompt_len=4, task="reverse")
    assert isinstance(env.unwrapped, TokenSequenceEnv)
    assert env.unwrapped.task == "reverse"
    assert env.observation_space["tokens"].shape == (36,)
    assert env.action_space.n == 5


def test_reimport_does_not_reregister():
    import importlib
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # gymnasium warns when an id is overridden
        importlib.reload(envs)
    assert {"moe_rl/MultiTask-v0", "moe_rl/TokenSequence-v0"} <= set(gym.registry)


def test_package_imports_only_gymnasium_and_numpy():
    code = "import sys, moe_rl.envs; print(sorted({'torch', 'ray'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- determinism -----------------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda: MultiTaskEnv(seed=7),
    lambda: TokenSequenceEnv(seq_len=16, task="sort"),
], ids=["multitask", "token"])
def test_same_seed_same_actions_give_identical_episodes(make):
    first, second = make(), make()
    for seed in (0, 1, 2):
        a = rollout(first, random_policy(first, seed), seed=seed)
        b = rollout(second, random_policy(second, seed), seed=seed)
        assert len(a[0]) == len(b[0])
        assert all(same(x, y) for x, y in zip(a[0], b[0]))
        assert a[1] == b[1] and a[2] == b[2]


def test_multitask_construction_seed_fixes_tasks_and_reset_seed_fixes_episodes():
    assert np.array_equal(MultiTaskEnv(seed=3).task_weights, MultiTaskEnv(seed=3).task_weights)
    assert not np.array_equal(MultiTaskEnv(seed=3).task_weights, MultiTaskEnv(seed=4).task_weights)
    env = MultiTaskEnv()
    assert not np.array_equal(env.reset(seed=0)[0], env.reset(seed=1)[0])


# --- multi-task structure --------------------------------------------------------------------

def test_tasks_conflict_on_most_feature_vectors():
    env = MultiTaskEnv(num_tasks=4)
    x = np.random.default_rng(0).uniform(-1, 1, size=(2000, env.obs_dim))
    best = np.argmax(np.einsum("tad,nd->tna", env.task_weights, x), axis=2)  # [task, sample]
    for s, t in itertools.combinations(range(env.num_tasks), 2):
        assert np.mean(best[s] != best[t]) > 0.5, (s, t)


def test_task_id_is_recoverable_from_the_observation():
    env = MultiTaskEnv(num_tasks=5, obs_dim=6)
    start, n = env.task_slice
    assert (start, n) == (6, 5) and start + n == env.observation_space.shape[0]
    seen = set()
    for seed in range(40):
        observations, _, infos = rollout(env, lambda obs: 0, seed=seed)
        for obs, info in zip(observations, infos):
            block = obs[start:start + n]
            assert block.sum() == 1.0 and int(np.argmax(block)) == info["task_id"]
        seen.add(infos[0]["task_id"])
    assert seen == set(range(5))


def test_reset_option_pins_the_task():
    env = MultiTaskEnv()
    for task in range(env.num_tasks):
        assert env.reset(seed=0, options={"task_id": task})[1]["task_id"] == task
    with pytest.raises(ValueError, match="^task_id: must be"):
        env.reset(options={"task_id": env.num_tasks})


def test_multitask_optimal_policy_gets_max_return_random_much_less():
    env = MultiTaskEnv()
    optimal = [sum(rollout(env, env.best_action, seed=s)[1]) for s in range(20)]
    assert optimal == [float(env.episode_length)] * 20
    random_returns = [sum(rollout(env, random_policy(env, s), seed=s)[1]) for s in range(50)]
    # Chance is 1 / n_actions = 0.25 of the maximum.
    assert np.mean(random_returns) < 0.4 * env.episode_length


def test_a_task_blind_policy_cannot_be_optimal():
    """Acting as if every episode were task 0 is right only where tasks happen to agree."""
    env = MultiTaskEnv()
    start, _ = env.task_slice

    def task0_policy(obs):
        return int(np.argmax(env.task_weights[0] @ obs[:start]))

    returns = {t: [] for t in range(env.num_tasks)}
    for seed in range(40):
        _, rewards, infos = rollout(env, task0_policy, seed=seed)
        returns[infos[0]["task_id"]].append(sum(rewards))
    assert np.mean(returns[0]) == env.episode_length
    assert all(np.mean(returns[t]) < 0.6 * env.episode_length for t in range(1, env.num_tasks))


# --- token sequences -------------------------------------------------------------------------

@pytest.mark.parametrize("task", ["copy", "reverse", "sort"])
@pytest.mark.parametrize("seq_len, prompt_len", [(8, None), (64, None), (16, 5), (8, 20)])
def test_token_oracle_gets_return_one(task, seq_len, prompt_len):
    env = TokenSequenceEnv(seq_len=seq_len, prompt_len=prompt_len, task=task)
    for seed in range(3):
        _, rewards, _ = rollout(env, token_oracle(env), seed=seed)
        assert len(rewards) == seq_len
        assert sum(rewards) == pytest.approx(1.0, abs=1e-6)


def test_token_random_policy_gets_much_less():
    env = TokenSequenceEnv(seq_len=64, vocab_size=8)
    returns = [sum(rollout(env, random_policy(env, s), seed=s)[1]) for s in range(20)]
    assert np.mean(returns) < 0.3  # chance is 1 / vocab_size = 0.125


def test_token_observation_layout():
    env = TokenSequenceEnv(seq_len=8, prompt_len=3)
    obs, _ = env.reset(seed=0)
    assert set(obs) == {"tokens", "position"}
    assert obs["position"].tolist() == [3]
    assert (obs["tokens"][:3] >= 0).all() and (obs["tokens"][3:] == -1).all()
    obs, *_ = env.step(5)
    assert obs["position"].tolist() == [4] and obs["tokens"][3] == 5 and obs["tokens"][4] == -1
    *_, terminated, truncated, _ = env.step(1)
    assert not terminated and not truncated
    for _ in range(6):
        obs, _, terminated, truncated, _ = env.step(0)
    assert terminated and not truncated and obs["position"].tolist() == [11]
    assert (obs["tokens"] >= 0).all()


# --- both envs -------------------------------------------------------------------------------

@pytest.mark.parametrize("env", [MultiTaskEnv(episode_length=2), TokenSequenceEnv(seq_len=8)],
                         ids=["multitask", "token"])
def test_returned_observations_are_not_overwritten_later(env):
    """Rollout buffers keep observations; later steps and resets must not change them."""
    first, _ = env.reset(seed=0)
    second, *_ = env.step(1)
    snapshots = [{k: np.copy(v) for k, v in o.items()} if isinstance(o, dict) else o.copy()
                 for o in (first, second)]
    env.step(1)
    env.reset(seed=1)
    env.step(0)
    assert same(first, snapshots[0]) and same(second, snapshots[1])


# --- misuse ----------------------------------------------------------------------------------

@pytest.mark.parametrize("cls, kwargs, name", [
    (MultiTaskEnv, {"num_tasks": 1}, "num_tasks"),
    (MultiTaskEnv, {"num_tasks": 2.5}, "num_tasks"),
    (MultiTaskEnv, {"obs_dim": 0}, "obs_dim"),
    (MultiTaskEnv, {"n_actions": 1}, "n_actions"),
    (MultiTaskEnv, {"episode_length": 0}, "episode_length"),
    (MultiTaskEnv, {"seed": -1}, "seed"),
    (TokenSequenceEnv, {"vocab_size": 1}, "vocab_size"),
    (TokenSequenceEnv, {"seq_len": 7}, "seq_len"),
    (TokenSequenceEnv, {"seq_len": 1025}, "seq_len"),
    (TokenSequenceEnv, {"seq_len": True}, "seq_len"),
    (TokenSequenceEnv, {"prompt_len": 0}, "prompt_len"),
    (TokenSequenceEnv, {"task": "shuffle"}, "task"),
])
def test_bad_arguments_raise_value_error_naming_the_argument(cls, kwargs, name):
    with pytest.raises(ValueError, match=f"^{name}: must be") as excinfo:
        cls(**kwargs)
    assert f"got {next(iter(kwargs.values()))!r}" in str(excinfo.value)


def test_bad_argument_message_format():
    with pytest.raises(ValueError) as excinfo:
        MultiTaskEnv(num_tasks=1)
    assert str(excinfo.value) == "num_tasks: must be an int >= 2, got 1"
    with pytest.raises(ValueError) as excinfo:
        TokenSequenceEnv(seq_len=4)
    assert str(excinfo.value) == "seq_len: must be an int in [8, 1024], got 4"


@pytest.mark.parametrize("env", [MultiTaskEnv(episode_length=2), TokenSequenceEnv(seq_len=8)],
                         ids=["multitask", "token"])
def test_step_outside_an_episode_or_out_of_range_action_raises(env):
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(0)
    env.reset(seed=0)
    with pytest.raises(ValueError, match="^action: must be"):
        env.step(env.action_space.n)
    done = False
    while not done:
        _, _, terminated, truncated, _ = env.step(0)
        done = terminated or truncated
    with pytest.raises(RuntimeError, match="call reset"):
        env.step(0)
