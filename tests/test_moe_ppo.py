"""MoE-PPO on a real local Ray with real RLlib EnvRunners."""
import numpy as np
import pytest
import torch
from ray.rllib.core.columns import Columns
from ray.rllib.utils.metrics import ENV_RUNNER_SAMPLING_TIMER, LEARNER_UPDATE_TIMER, SYNCH_WORKER_WEIGHTS_TIMER

from moe_rl import MoEPPO, MoEPPOConfig
from moe_rl.algo.results import metrics_row
from moe_rl.core.health import HEALTHY
from moe_rl.core.settings import ConfigError
from moe_rl.rllib.rl_module import MOE_TOPK

OBS = np.random.default_rng(0).uniform(-0.5, 0.5, size=(64, 4)).astype(np.float32)


def small_config(**moe):
    return (MoEPPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=1, num_envs_per_env_runner=4)
            .training(lr=3e-4, train_batch_size_per_learner=1000, minibatch_size=250, num_epochs=6,
                      vf_loss_coeff=0.5, vf_clip_param=1000.0)
            .moe(num_experts=4, top_k=2, d_model=32, d_ff=32, **moe)
            .debugging(seed=0))


def runner_forward(algo, obs):
    """Inference copy on the remote EnvRunner: (logits, top-k) for the given observations."""
    def fwd(er):
        with torch.no_grad():
            out = er.module.forward_inference({Columns.OBS: torch.as_tensor(obs)})
        return out[Columns.ACTION_DIST_INPUTS].float().numpy(), out[MOE_TOPK].numpy()
    return algo.env_runner_group.foreach_env_runner(fwd, local_env_runner=False)[0]


def learner_forward(algo, obs):
    def fwd(learner):
        with torch.no_grad():
            out = learner.module["default_policy"].forward_inference({Columns.OBS: torch.as_tensor(obs)})
        return out[Columns.ACTION_DIST_INPUTS].numpy(), out[MOE_TOPK].numpy()
    return algo.learner_group.foreach(fwd)[0]


def logp_of_actions(logits):
    return torch.log_softmax(torch.as_tensor(logits, dtype=torch.float64), -1)[:, 0].numpy()


@pytest.fixture(scope="module")
def trained(ray_local, tmp_path_factory):
    algo = small_config().build_algo()
    returns = [algo.train()["env_runners"]["episode_return_mean"] for _ in range(6)]
    yield algo, returns
    algo.stop()


def test_short_training_raises_the_return(trained):
    _, returns = trained
    assert max(returns[-2:]) > 1.5 * returns[0], returns


def test_learner_reports_moe_losses_and_health(trained):
    algo, _ = trained
    learner = algo.train()["learners"]["default_policy"]
    for key in ("aux_loss", "z_loss", "moe/cv", "moe/min_util", "moe/max_util", "moe/active_experts",
                "moe/router_entropy_norm", "moe/health", "moe/layer0/cv", "moe/layer1/health"):
        assert key in learner, key
    assert 0.0 < learner["moe/router_entropy_norm"] <= 1.0 + 1e-9
    # A short CartPole run with every expert in use (marginal entropy near 1): healthy, layer by layer.
    assert [learner[k] for k in ("moe/health", "moe/layer0/health", "moe/layer1/health")] == [HEALTHY] * 3
    assert learner["moe/dead_experts"] == learner["moe/idle_experts"] == 0


def test_each_phase_is_timed_once_for_rllib_and_for_the_iteration(trained):
    """One measurement per phase: RLlib's own timers (what its dashboards read) and this iteration's
    phase seconds, whose sum is the wall time env_steps_per_s divides by."""
    algo, _ = trained
    result = algo.train()
    phases, timers = result["moe_rl"], result["timers"]
    for rllib_key, phase in ((ENV_RUNNER_SAMPLING_TIMER, "sample_s"), (LEARNER_UPDATE_TIMER, "learn_s"),
                             (SYNCH_WORKER_WEIGHTS_TIMER, "sync_s")):
        assert timers[rllib_key] > 0 and phases[phase] > 0, (rllib_key, phase)
    spent = sum(phases[k] for k in ("sample_s", "check_s", "learn_s", "sync_s"))
    steps = result["env_runners"]["num_env_steps_sampled"]
    assert phases["env_steps"] == steps   # the metrics row divides them (moe_rl.algo.results)
    assert metrics_row(result)["env_steps_per_s"] == pytest.approx(steps / spent, rel=1e-6)
    assert spent <= result["time_this_iter_s"]


def test_rollouts_record_routing_per_step(trained):
    algo, _ = trained
    episodes = algo.env_runner_group.foreach_env_runner(
        lambda er: [(e.get_observations()[:-1], e.get_extra_model_outputs(MOE_TOPK)) for e in er.sample(
            num_timesteps=40, random_actions=False)], local_env_runner=False)[0]
    obs, topk = episodes[0]
    assert topk.dtype == np.int8 and topk.shape == (len(obs), 2, 2)  # [steps, layers, k]
    assert topk.min() >= 0 and topk.max() < 4
    # The recorded routing is what the inference copy computes for those observations.
    _, again = runner_forward(algo, np.asarray(obs, dtype=np.float32))
    assert np.array_equal(np.sort(again, -1), np.sort(topk, -1))


def test_after_an_iteration_the_inference_copy_matches_the_learner(trained):
    """The fixture's iterations each ended with MoEPPO's own sync (MoEPPO._sync_rollout_weights:
    the learners publish their parts, each rollout actor assembles them), the only one it runs."""
    algo, _ = trained
    (r_logits, r_topk), (l_logits, l_topk) = runner_forward(algo, OBS), learner_forward(algo, OBS)
    assert np.abs(logp_of_actions(r_logits) - logp_of_actions(l_logits)).max() <= 1e-6
    assert np.array_equal(r_topk, l_topk)


def test_get_module_is_the_trained_policy_not_the_local_runners_initial_one(trained):
    """algo.get_module() (what RLlib users evaluate with) answers with the synced weights, though
    MoEPPO syncs only the sampling rollout actors."""
    algo, _ = trained
    with torch.no_grad():
        out = algo.get_module().forward_inference({Columns.OBS: torch.as_tensor(OBS)})
    l_logits, l_topk = learner_forward(algo, OBS)
    assert np.abs(logp_of_actions(out[Columns.ACTION_DIST_INPUTS].numpy()) - logp_of_actions(l_logits)).max() <= 1e-6
    assert np.array_equal(out[MOE_TOPK].numpy(), l_topk)


def test_bf16_inference_copy_drifts_measurably(ray_local):
    algo = small_config(inference_dtype="bf16").build_algo()
    try:
        algo.train()   # ends with MoEPPO's sync: the rollout copy is the learner's weights cast to bf16
        diff = np.abs(logp_of_actions(runner_forward(algo, OBS)[0]) - logp_of_actions(learner_forward(algo, OBS)[0]))
        assert diff.max() > 1e-5  # bf16 rounding is visible (what the consistency actor measures)
        assert diff.max() < 0.2   # ... and the copy still is the same policy
    finally:
        algo.stop()


@pytest.mark.parametrize("moe, mode, token_mode", [
    ({}, None, None), ({"inference_dtype": "bf16"}, "mismatched", "mismatched"),
    ({"router": "reinforce"}, "full", "full"), ({"capacity_factor": 1.0}, "full", None),
    ({"capacity_factor": 1.0, "inference_dtype": "bf16"}, "full", "full"), ({"routing_replay": True}, "full", "full"),
    ({"routing_replay": False, "inference_dtype": "bf16"}, None, None),
    ({"routing_replay": "mismatched"}, "mismatched", "mismatched")])
def test_routing_replay_auto_resolves_by_what_makes_routing_differ(moe, mode, token_mode):
    """The token trunk's capacity groups are its sequences: in fp32 it needs no replay."""
    from moe_rl.core.settings import MOE_DEFAULTS, validate_moe
    from moe_rl.rllib.rl_module import replay_mode
    s = validate_moe({**MOE_DEFAULTS, **moe})
    assert replay_mode(s) == mode
    assert replay_mode(s, token_policy=True) == token_mode


# The quickstart's training settings before its small, frequent updates (BENCHMARKS.md's R3 figures).
OLD_QUICKSTART_TRAINING = {"lr": 3e-4, "gamma": 0.99, "lambda_": 0.95, "train_batch_size_per_learner": 4000,
                           "minibatch_size": 256, "num_epochs": 6}


@pytest.mark.slow
def test_routing_replay_learns_like_no_replay_and_keeps_the_router_balanced(ray_local):
    """R3 regression: counting the loads from the replayed experts froze the balance
    statistic for a whole update and drove one expert into every token's top-2; R3 then learned
    3.5x slower. Loads now come from the router's own choice; under full replay the gates are the
    chosen experts' own probabilities (normalize_gates auto), so the PPO loss can keep the router's
    mass on the experts it trains, and the anchor pulls back only the tokens that drifted (on
    every token it starved an expert). The quickstart, 8 iterations, seed 0 (10 seeds in
    BENCHMARKS.md: 272 +- 64 with R3, 295 +- 44 without, the load graded as without replay)."""
    import os

    from moe_rl.app.run_config import apply_overrides, load_run_config, validate_run_config
    quickstart = apply_overrides(   # the update sizes the figures above were measured at
        load_run_config(os.path.join(os.path.dirname(__file__), "..", "configs", "cartpole.yaml")),
        [f"training.{k}={v}" for k, v in OLD_QUICKSTART_TRAINING.items()])
    runs = {}
    for replay in ("false", "true"):
        algo = validate_run_config(apply_overrides(quickstart, [f"moe.routing_replay={replay}"])).build_algo()
        try:
            runs[replay] = [algo.train() for _ in range(8)]
        finally:
            algo.stop()
    returns = {k: [r["env_runners"]["episode_return_mean"] for r in v] for k, v in runs.items()}
    learner = runs["true"][-1]["learners"]["default_policy"]
    # The defect put one expert into every token's top-2 (share 0.46-0.50 = 4/N, CV above 1); the
    # every-token anchor left one with almost no share (danger).
    assert learner["moe/active_experts"] == 8 and learner["moe/cv"] < 1.0 and learner["moe/health"] < 2, (
        learner["moe/cv"], learner["moe/min_util"], learner["moe/max_util"])
    # One seed cannot show "within noise"; it does catch the defect (R3 at 28-41 % of no replay).
    assert returns["true"][-1] >= 0.8 * returns["false"][-1], returns


@pytest.mark.parametrize("moe, normalized", [
    ({}, True), ({"routing_replay": True}, False), ({"routing_replay": "mismatched"}, True),
    ({"router": "reinforce"}, False), ({"routing_replay": True, "normalize_gates": True}, True),
    ({"normalize_gates": False}, False)])
def test_gate_normalization_auto_is_off_exactly_under_full_replay(moe, normalized):
    import gymnasium as gym

    from moe_rl.core.layer import MoELayer
    from moe_rl.rllib.rl_module import MoEPolicyModule
    for inference_only in (False, True):   # the rollout copy computes the same combine
        module = MoEPolicyModule(observation_space=gym.spaces.Box(-1, 1, (4,)), action_space=gym.spaces.Discrete(2),
                                 inference_only=inference_only, model_config={"moe": moe})
        layers = [m for m in module.modules() if isinstance(m, MoELayer)]
        assert layers and all(m.router.normalize_gates is normalized for m in layers)


def test_switching_the_modules_mode_reaches_every_submodule():
    """MoEPolicyModule.train skips nn.Module's walk when no submodule's mode would change (RLlib
    switches it around every forward): a change still reaches every submodule (expert dropout,
    routers' balancing statistics depend on it)."""
    import gymnasium as gym

    from moe_rl.rllib.rl_module import MoEPolicyModule
    module = MoEPolicyModule(observation_space=gym.spaces.Box(-1, 1, (4,)), action_space=gym.spaces.Discrete(2),
                             model_config={"moe": {}})
    for mode in (True, False, False, True, True, False):
        module.train(mode)
        assert all(m.training is mode for m in module.modules())
    module.eval()
    module.trunk.train()   # a submodule switched on its own: the module's next eval() still reaches it
    module.eval()
    assert not any(m.training for m in module.modules())


@pytest.mark.slow
def test_mismatched_replay_pins_only_flipped_tokens_and_costs_nothing_in_fp32(ray_local):
    """routing_replay "mismatched": in fp32 nothing differs at the rollout's weights, so training
    is the no-replay run to the last digit; a bf16 copy flips some tokens, and only those replay."""
    runs = {}
    for name, moe in {"off": {"routing_replay": False}, "mismatched": {"routing_replay": "mismatched"},
                      "bf16": {"inference_dtype": "bf16"}}.items():   # auto: mismatched
        algo = small_config(**moe).build_algo()
        try:
            results = [algo.train() for _ in range(2)]
        finally:
            algo.stop()
        runs[name] = ([r["env_runners"]["episode_return_mean"] for r in results],
                      [r["learners"]["default_policy"].get("replay/replayed_fraction") for r in results])
    assert runs["mismatched"][0] == runs["off"][0]
    assert runs["mismatched"][1] == [0.0, 0.0] and runs["off"][1] == [None, None]
    assert all(0.0 < f < 0.5 for f in runs["bf16"][1]), runs["bf16"]


def test_checkpoint_round_trip(trained, tmp_path):
    algo, _ = trained
    path = algo.save_to_path(str(tmp_path / "ckpt"))
    restored = MoEPPO.from_checkpoint(path)
    try:
        assert np.allclose(learner_forward(restored, OBS)[0], learner_forward(algo, OBS)[0], atol=0, rtol=0)
    finally:
        restored.stop()


@pytest.mark.parametrize("kwargs, field", [
    ({"top_k": 9}, "moe.top_k"), ({"router": "magic"}, "moe.router"), ({"ep_size": 3}, "moe.ep_size"),
    ({"inference_dtype": "fp8"}, "moe.inference_dtype"), ({"capacity_factor": 0}, "moe.capacity_factor"),
    ({"routing_replay": "some"}, "moe.routing_replay"), ({"positions": "rotary"}, "moe.positions"),
    ({"routing_replay": "mismatched", "router": "reinforce"}, "moe.routing_replay"),
    ({"normalize_gates": "sometimes"}, "moe.normalize_gates"),
])
def test_validate_rejects_bad_moe_settings(kwargs, field):
    with pytest.raises(ConfigError, match=f"^{field}: must be"):
        MoEPPOConfig().environment("CartPole-v1").moe(**kwargs).validate()


def test_unknown_moe_key_is_refused():
    with pytest.raises(ConfigError, match="^moe.experts: unknown key"):
        MoEPPOConfig().moe(experts=4)
