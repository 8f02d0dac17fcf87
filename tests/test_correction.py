"""Rollout correction (moe_rl.core.correction): every estimator and mask against a hand-computed
case, then the learner connector on a real RLlib learner (the loss denominator without the
rejected steps)."""
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from ray.rllib.core.columns import Columns

from moe_rl import MoEPPOConfig
from moe_rl.core.correction import correct, resolve_correction, routing_disagreement, sequence_ids
from moe_rl.core.settings import ConfigError

pytestmark = pytest.mark.pure

LOG = math.log


def settings(**kw):
    return resolve_correction(kw)


def test_sequence_ids_from_the_phantom_rows():
    mask = torch.tensor([True, True, False, True, False, True, True, True, False])
    assert sequence_ids(mask).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]


def test_token_is_truncates_and_normalises():
    lr = torch.tensor([LOG(3.0), LOG(0.5), 0.0, LOG(1.5)])
    valid = torch.ones(4, dtype=torch.bool)
    w, keep, m = correct(lr, valid, torch.zeros(4, dtype=torch.long), settings(is_level="token", is_threshold=2.0))
    assert w.tolist() == pytest.approx([2.0, 0.5, 1.0, 1.5]) and keep.all()
    assert m["correction/is_truncated_fraction"] == 0.25 and m["correction/is_max"] == pytest.approx(2.0)
    assert m["correction/ess"] == pytest.approx(np.mean([2, .5, 1, 1.5]) ** 2 / np.mean(np.square([2, .5, 1, 1.5])))
    w, _, _ = correct(lr, valid, torch.zeros(4, dtype=torch.long),
                      settings(is_level="token", is_threshold=2.0, is_batch_normalize=True))
    assert w.mean().item() == pytest.approx(1.0)


def test_sequence_is_is_the_product_per_sequence():
    lr = torch.tensor([LOG(2.0), LOG(0.75), LOG(1.2), 0.0])
    seq = torch.tensor([0, 0, 1, 1])
    w, _, _ = correct(lr, torch.ones(4, dtype=torch.bool), seq, settings(is_level="sequence", is_threshold=10.0))
    assert w.tolist() == pytest.approx([1.5, 1.5, 1.2, 1.2])


def test_rejection_at_token_sequence_and_geometric_level():
    lr = torch.tensor([LOG(3.0), LOG(1.0), LOG(0.4), LOG(1.0), LOG(1.1), LOG(1.1)])
    seq = torch.tensor([0, 0, 1, 1, 2, 2])
    valid = torch.ones(6, dtype=torch.bool)
    _, keep, m = correct(lr, valid, seq, settings(rs_level="token", rs_threshold=2.0))   # [1/2, 2]
    assert keep.tolist() == [False, True, False, True, True, True]
    assert m["correction/rs_rejected_fraction"] == pytest.approx(2 / 6)
    _, keep, _ = correct(lr, valid, seq, settings(rs_level="sequence", rs_threshold=2.0))  # products 3, 0.4, 1.21
    assert keep.tolist() == [False, False, False, False, True, True]
    _, keep, _ = correct(lr, valid, seq, settings(rs_level="geometric", rs_threshold=1.5))  # sqrt: 1.73, .63, 1.1
    assert keep.tolist() == [False, False, False, False, True, True]                    # 0.63 < 1 / 1.5
    _, keep, _ = correct(lr, valid, seq, settings(rs_level="geometric", rs_threshold=2.0, rs_threshold_lower=0.7))
    assert keep.tolist() == [True, True, False, False, True, True]


def test_veto_drops_the_whole_sequence_of_a_catastrophic_token():
    lr = torch.tensor([0.0, LOG(1e-6), 0.0, 0.0])
    seq = torch.tensor([0, 0, 1, 1])
    _, keep, m = correct(lr, torch.ones(4, dtype=torch.bool), seq, settings(veto_threshold=1e-4))
    assert keep.tolist() == [False, False, True, True] and m["correction/veto_fraction"] == 0.5
    assert m["correction/seq_rejected_fraction"] == 0.5


def test_masked_rows_are_never_counted_or_kept():
    lr = torch.tensor([LOG(5.0), 0.0, 0.0])
    valid = torch.tensor([True, True, False])
    _, keep, m = correct(lr, valid, torch.tensor([0, 0, 0]), settings(rs_level="token", rs_threshold=2.0))
    assert keep.tolist() == [False, True, False] and m["correction/rejected_fraction"] == 0.5


def test_routing_rejection_compares_expert_sets_per_layer():
    rollout = torch.tensor([[[0, 1], [2, 3]], [[1, 0], [2, 3]], [[0, 1], [3, 1]], [[-1, 1], [2, 3]]])
    trainer = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 1], [2, 3]], [[0, 1], [2, 3]]])
    assert routing_disagreement(rollout, trainer, "any", 0.5).tolist() == [False, False, True, False]
    assert routing_disagreement(rollout, trainer, "share", 0.5).tolist() == [False, False, False, False]
    _, keep, m = correct(torch.zeros(4), torch.ones(4, dtype=torch.bool), torch.arange(4), settings(routing_rs="any"),
                         routing_disagreement(rollout, trainer, "any", 0.5))
    assert keep.tolist() == [True, True, False, True] and m["correction/routing_rejected_fraction"] == 0.25


def test_presets_and_bad_settings():
    s = settings(preset="geo_rs_veto")
    assert s.rs_level == "geometric" and s.veto_threshold == 1e-4
    assert settings(preset="token_is", is_threshold=3.0).is_threshold == 3.0      # explicit keys win
    for bad, field in [({"preset": "tis"}, "preset"), ({"is_level": "episode"}, "is_level"),
                       ({"mode": "bypass", "is_level": "token"}, "is_level"),
                       ({"mode": "bypass", "rs_level": "geometric"}, "mode"), ({"rs_threshold": 0}, "rs_threshold"),
                       ({"rs_threshold": 2, "rs_threshold_lower": 3}, "rs_threshold_lower"), ({"x": 1}, "x")]:
        with pytest.raises(ConfigError, match=f"^consistency.correction.{field}: "):
            resolve_correction(bad)


def test_connector_masks_rejected_steps_out_of_the_loss_denominator():
    """On a real RLlib learner (no Ray cluster): the connector's LOSS_MASK is the rejection, and the
    PPO loss is the mean over the kept steps only."""
    env = gym.make("CartPole-v1")
    config = (MoEPPOConfig().environment("CartPole-v1")
              .moe(num_experts=4, top_k=2, d_model=16, d_ff=16, aux_loss_coef=0.0, z_loss_coef=0.0)
              .consistency(correction={"rs_level": "token", "rs_threshold": 2.0}))
    learner = config.build_learner(env=env)
    module = learner.module["default_policy"]
    n = 12
    obs = torch.randn(n, 4)
    with torch.no_grad():
        out = module.forward_exploration({Columns.OBS: obs})
    actions = torch.zeros(n, dtype=torch.long)
    logp = torch.log_softmax(out[Columns.ACTION_DIST_INPUTS], -1)[:, 0]
    rollout_logp = logp.clone()
    rollout_logp[:3] -= LOG(5.0)           # three steps whose ratio pi_old / pi_rollout is 5: rejected
    batch = {"default_policy": {Columns.OBS: obs, Columns.ACTIONS: actions, Columns.ACTION_LOGP: rollout_logp,
                                Columns.ACTION_DIST_INPUTS: out[Columns.ACTION_DIST_INPUTS],
                                "moe_topk": out["moe_topk"], "advantages": torch.ones(n),
                                "value_targets": torch.zeros(n),
                                Columns.LOSS_MASK: torch.ones(n, dtype=torch.bool)}}
    from moe_rl.rllib.correction import RolloutCorrection
    batch = RolloutCorrection(settings=learner.correction)(rl_module=learner.module, batch=batch, episodes=[])
    b = batch["default_policy"]
    assert b[Columns.LOSS_MASK].tolist() == [False] * 3 + [True] * (n - 3)
    assert torch.allclose(b[Columns.ACTION_LOGP], logp)          # the ratio is re-based on the old policy
    fwd = module.forward_train(b)
    loss = learner.compute_loss_for_module(module_id="default_policy", config=learner.config.get_config_for_module(
        "default_policy"), batch=b, fwd_out=fwd)
    kept = {k: (v[3:] if torch.is_tensor(v) and v.shape[:1] == (n,) else v) for k, v in b.items()}
    kept[Columns.LOSS_MASK] = torch.ones(n - 3, dtype=torch.bool)
    loss_kept = learner.compute_loss_for_module(module_id="default_policy", config=learner.config.get_config_for_module(
        "default_policy"), batch=kept, fwd_out=module.forward_train(kept))
    assert loss.item() == pytest.approx(loss_kept.item(), rel=1e-5)


# --- the edges: each test failed before its fix ----------------------------------------------------

def test_a_kept_interval_without_the_ratio_one_is_refused():
    """rs_threshold < 1 with the default lower bound 1/U > U would reject every step of a run."""
    for bad, field in [({"rs_level": "token", "rs_threshold": 0.5}, "rs_threshold"),
                       ({"rs_level": "token", "rs_threshold": 0.9, "rs_threshold_lower": 0.5}, "rs_threshold"),
                       ({"rs_level": "geometric", "rs_threshold": 2.0, "rs_threshold_lower": 1.5},
                        "rs_threshold_lower"),
                       ({"veto_threshold": 1.5}, "veto_threshold")]:
        with pytest.raises(ConfigError, match=f"^consistency.correction.{field}: must be .*(ratio 1|agree)"):
            resolve_correction(bad)
    _, keep, _ = correct(torch.zeros(3), torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.long),
                         settings(rs_level="token", rs_threshold=1.0))
    assert keep.all()                                   # [1, 1]: the narrowest valid interval keeps ratio 1


def test_the_veto_and_rejection_see_ratios_beyond_the_clamp():
    """Thresholds below e^-20 fire: the comparisons use the unclamped log-ratio."""
    lr = torch.tensor([-math.inf, 0.0, LOG(1e-12), 0.0, 0.0, 0.0])
    seq = torch.tensor([0, 0, 1, 1, 2, 2])
    valid = torch.ones(6, dtype=torch.bool)
    _, keep, m = correct(lr, valid, seq, settings(veto_threshold=1e-10))
    assert keep.tolist() == [False, False, False, False, True, True]
    assert m["correction/veto_fraction"] == pytest.approx(2 / 3)
    _, keep, _ = correct(lr, valid, seq, settings(rs_level="token", rs_threshold=2.0, rs_threshold_lower=1e-10))
    assert keep.tolist() == [False, True, False, True, True, True]
    w, keep, _ = correct(torch.tensor([math.nan, 0.0]), torch.ones(2, dtype=torch.bool), torch.tensor([0, 1]),
                         settings(is_level="token", veto_threshold=1e-4))
    assert keep.tolist() == [False, True] and torch.isfinite(w).all()   # NaN: as bad as a ratio of 0


def test_sequence_level_normalisation_counts_each_sequence_once():
    """verl's sequence-level batch normalisation: the mean over sequences, not over their tokens."""
    lr = torch.tensor([LOG(2.0), 0.0, 0.0, 0.0])     # sequence 0: one token, weight 2; sequence 1: 3 tokens, 1
    seq = torch.tensor([0, 1, 1, 1])
    w, _, _ = correct(lr, torch.ones(4, dtype=torch.bool), seq,
                      settings(is_level="sequence", is_threshold=10.0, is_batch_normalize=True))
    assert w.tolist() == pytest.approx([2 / 1.5, 1 / 1.5, 1 / 1.5, 1 / 1.5])


def _learner(correction, **moe):
    config = (MoEPPOConfig().environment("CartPole-v1")
              .training(train_batch_size_per_learner=64, minibatch_size=32, num_epochs=2)
              .moe(num_experts=4, top_k=2, d_model=16, d_ff=16, **moe)
              .consistency(correction=correction))
    return config, config.build_learner(env=gym.make("CartPole-v1"))


def _hand_batch(learner, n=12, shift=0.0, logit_noise=0.0):
    """A batch as the connector sees it after GAE: the rollout's log-probs `shift` below the
    learner's (a rollout copy that gives the taken actions less mass) and its logits perturbed."""
    module = learner.module["default_policy"]
    obs = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = module.forward_exploration({Columns.OBS: obs})
    noise = torch.randn(n, 2, generator=torch.Generator().manual_seed(1))
    logits = out[Columns.ACTION_DIST_INPUTS] + logit_noise * noise
    actions = torch.zeros(n, dtype=torch.long)
    return {"default_policy": {Columns.OBS: obs, Columns.ACTIONS: actions,
                               Columns.ACTION_LOGP: torch.log_softmax(logits, -1)[:, 0] - shift,
                               Columns.ACTION_DIST_INPUTS: logits, "moe_topk": out["moe_topk"],
                               "advantages": torch.linspace(-1, 1, n), "value_targets": torch.zeros(n),
                               Columns.LOSS_MASK: torch.ones(n, dtype=torch.bool)}}


def _loss(learner, b):
    module = learner.module["default_policy"]
    return learner.compute_loss_for_module(module_id="default_policy", batch=b, fwd_out=module.forward_train(b),
                                           config=learner.config.get_config_for_module("default_policy"))


def test_decoupled_kl_penalty_is_measured_against_the_proximal_policy():
    """PPO's KL term (use_kl_loss, kl_coeff 0.2 by default) compares with the batch's logits: after
    the connector those are the learner's own old policy's, so at step 0 the KL is 0, like the ratio,
    however far the rollout copy's logits were."""
    from moe_rl.rllib.correction import RolloutCorrection
    _, learner = _learner({"preset": "token_is"})
    batch = RolloutCorrection(settings=learner.correction)(rl_module=learner.module,
                                                           batch=_hand_batch(learner, logit_noise=0.3), episodes=[])
    _loss(learner, batch["default_policy"])
    kl = learner.metrics.peek(("default_policy", "mean_kl_loss"))
    assert abs(float(torch.as_tensor(kl).detach())) < 1e-6, kl


def test_rejected_and_phantom_steps_never_train_the_reinforce_router():
    """The REINFORCE router's loss is a mean over the kept steps only, like PPO's."""
    from moe_rl.rllib.correction import RolloutCorrection
    _, learner = _learner({"rs_level": "token", "rs_threshold": 2.0}, router="reinforce")
    b = RolloutCorrection(settings=learner.correction)(rl_module=learner.module, batch=_hand_batch(learner),
                                                       episodes=[])["default_policy"]
    b[Columns.LOSS_MASK] = torch.tensor([False] * 3 + [True] * 9)   # three rejected (or phantom) steps
    torch.manual_seed(0)
    _loss(learner, b)
    with_mask = float(learner._loss_stats["default_policy"]["reinforce_router_loss"])
    kept = {k: (v[3:] if torch.is_tensor(v) and v.shape[:1] == (12,) else v) for k, v in b.items()}
    torch.manual_seed(0)
    _loss(learner, kept)
    assert with_mask == pytest.approx(float(learner._loss_stats["default_policy"]["reinforce_router_loss"]), rel=1e-5)


def test_an_update_with_every_step_rejected_is_skipped_counted_and_moves_no_weight():
    """geo_rs on rollouts whose every step is 5 % off (a rollout copy that gives each taken action
    5 % less mass): nothing is kept. The learner skips every step (no drift on the router's aux
    losses or Adam's momentum), says so in its results, and the sync gate reads the same figures."""
    from ray.rllib.env.single_agent_env_runner import SingleAgentEnvRunner
    config, learner = _learner({"preset": "geo_rs"})
    runner = SingleAgentEnvRunner(config=config)
    runner.module.set_state(learner.module["default_policy"].get_state())
    episodes = runner.sample(num_timesteps=64, random_actions=False)
    for ep in episodes:
        logp = ep.extra_model_outputs[Columns.ACTION_LOGP]
        logp.data = logp.data - LOG(1.05)
    before = {k: v.detach().clone() for k, v in learner.module["default_policy"].state_dict().items()}
    results = learner.update(episodes=episodes, num_epochs=2, minibatch_size=32)["default_policy"]
    after = learner.module["default_policy"].state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    figures = {k: float(v.peek() if hasattr(v, "peek") else v) for k, v in results.items()}
    assert figures["correction/rejected_fraction"] == 1.0
    assert figures["correction/skipped_updates"] == 1.0 and figures["correction/skipped_steps"] >= 4
    last = learner.skipped_steps.last["default_policy"]
    assert last["steps"] == last["skipped"] >= 4 and last["in_a_row"] == 1
    runner.stop()


def test_routing_rejection_leaves_out_the_layers_of_a_sampling_router():
    """A REINFORCE layer's rollout choice is a draw (replayed by the learner); comparing it with the
    greedy choice would reject most steps. Only the deterministic layers count."""
    from moe_rl.core.routing import RoutingRecord
    from moe_rl.rllib.correction import routing_flags
    greedy = torch.tensor([[0, 1], [0, 1]])
    drawn = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [0, 1]]])     # [N, L, k]: layer 1 drew other experts
    def record(sampling):
        return RoutingRecord(top_k_indices=greedy, gate_weights=torch.ones(2, 2), router_logits=torch.zeros(2, 4),
                             selection_logp=torch.zeros(2) if sampling else None,
                             baseline=torch.zeros(2) if sampling else None)
    s = settings(routing_rs="any")
    assert routing_flags(s, {"moe_topk": drawn}, [record(False), record(True)]).tolist() == [False, False]
    assert routing_flags(s, {"moe_topk": drawn}, [record(False), record(False)]).tolist() == [True, False]
    assert routing_flags(s, {"moe_topk": drawn}, [record(True), record(True)]) is None
