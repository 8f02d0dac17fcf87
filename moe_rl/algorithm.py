"""MoE-PPO on RLlib: MoEPPOConfig (a PPOConfig) and MoEPPO (a PPO).

    config = (MoEPPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=2)
              .moe(num_experts=8, top_k=2, router="topk"))
    algo = config.build_algo()
    algo.train()
"""
from __future__ import annotations

import copy
from typing import Any, Dict

from ray.rllib.algorithms.algorithm_config import NotProvided
from ray.rllib.algorithms.ppo import PPO, PPOConfig
from ray.rllib.core import COMPONENT_RL_MODULE
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.execution.rollout_ops import synchronous_parallel_sample
from ray.rllib.utils.metrics import (ALL_MODULES, ENV_RUNNER_RESULTS, ENV_RUNNER_SAMPLING_TIMER,
                                     LEARNER_RESULTS, LEARNER_UPDATE_TIMER, NUM_ENV_STEPS_SAMPLED_LIFETIME,
                                     NUM_MODULE_STEPS_TRAINED_LIFETIME, SYNCH_WORKER_WEIGHTS_TIMER, TIMERS,
                                     WEIGHTS_SEQ_NO)

import envs  # noqa: F401  registers moe_rl/ gymnasium ids in every process that loads this config

from .settings import DEEPSPEED_DEFAULTS, MOE_DEFAULTS, ConfigError, resolve_deepspeed, validate_moe


class MoEPPOConfig(PPOConfig):
    """PPOConfig plus `.moe(...)` (the MoE policy), `.deepspeed(...)` (the expert-parallel learner
    group) and `.consistency(...)` (drift checks and the sync gate)."""

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or MoEPPO)
        self.moe_settings: Dict[str, Any] = copy.deepcopy(MOE_DEFAULTS)
        self.deepspeed_settings: Dict[str, Any] = copy.deepcopy(DEEPSPEED_DEFAULTS)
        self.stability_settings: Dict[str, Any] = {}
        self.consistency_settings: Dict[str, Any] = {}

    def moe(self, **kwargs) -> "MoEPPOConfig":
        """Set `moe.*` keys (see moe_rl.settings.MOE_DEFAULTS for every key and its default)."""
        unknown = sorted(set(kwargs) - set(MOE_DEFAULTS))
        if unknown:
            raise ConfigError(f"moe.{unknown[0]}: unknown key, allowed: {', '.join(sorted(MOE_DEFAULTS))}")
        self.moe_settings.update({k: v for k, v in kwargs.items() if v is not NotProvided})
        return self

    def deepspeed(self, **kwargs) -> "MoEPPOConfig":
        """DeepSpeed learner group: `config` (dict or JSON path, passed to deepspeed.initialize),
        `enabled`, `num_threads` (see moe_rl.settings.DEEPSPEED_DEFAULTS)."""
        unknown = sorted(set(kwargs) - set(DEEPSPEED_DEFAULTS))
        if unknown:
            raise ConfigError(f"deepspeed.{unknown[0]}: unknown key, allowed: {', '.join(sorted(DEEPSPEED_DEFAULTS))}")
        self.deepspeed_settings.update({k: v for k, v in kwargs.items() if v is not NotProvided})
        return self

    @property
    def uses_deepspeed(self) -> bool:
        return bool(resolve_deepspeed(self.deepspeed_settings, self.moe_settings, self.num_learners)["enabled"])

    def build_learner_group(self, *, env=None, spaces=None, rl_module_spec=None, placement_group=None):
        if not self.uses_deepspeed:
            return super().build_learner_group(env=env, spaces=spaces, rl_module_spec=rl_module_spec,
                                               placement_group=placement_group)
        from actors.learner_group import DeepSpeedLearnerGroup
        if rl_module_spec is None:
            rl_module_spec = self.get_multi_rl_module_spec(env=env, spaces=spaces)
        config = self.copy(copy_frozen=False)
        config.deepspeed_settings = resolve_deepspeed(self.deepspeed_settings, self.moe_settings, self.num_learners)
        config.freeze()
        return DeepSpeedLearnerGroup(config=config, module_spec=rl_module_spec)

    def stability(self, **kwargs) -> "MoEPPOConfig":
        """Reserved for the stability toolkit (per-group LR and clipping, NaN-step skipping, ...),
        which is not built yet: any key is refused rather than silently ignored."""
        if kwargs:
            raise ConfigError(f"stability.{sorted(kwargs)[0]}: the stability toolkit is not implemented yet; "
                              "allowed: no keys")
        return self

    def consistency(self, **kwargs) -> "MoEPPOConfig":
        """Drift checks and the sync gate: every, policy (warn|hold|rollback), thresholds, ...
        (see moe_rl.consistency.CONSISTENCY_DEFAULTS)."""
        self.consistency_settings.update(kwargs)
        return self

    @property
    def _model_config_auto_includes(self) -> Dict[str, Any]:
        return super()._model_config_auto_includes | {"moe": dict(self.moe_settings)}

    def get_default_rl_module_spec(self) -> RLModuleSpec:
        from .rl_module import MoEPolicyModule
        return RLModuleSpec(module_class=MoEPolicyModule)

    def get_default_learner_class(self):
        from .learner import MoEPPOTorchLearner
        return MoEPPOTorchLearner

    def validate(self) -> None:
        super().validate()
        validate_moe(self.moe_settings, num_learners=self.num_learners)
        resolve_deepspeed(self.deepspeed_settings, self.moe_settings, self.num_learners)
        from .consistency import validate_consistency
        validate_consistency(self.consistency_settings)


class MoEPPO(PPO):
    """PPO whose policy is an MoE. One iteration: sample with the inference copy -> learner update
    (PPO + MoE aux/z losses + health metrics) -> weight sync to the rollout actors."""

    @classmethod
    def get_default_config(cls) -> MoEPPOConfig:
        return MoEPPOConfig()

    def setup(self, config) -> None:
        super().setup(config)
        from .consistency import validate_consistency
        settings = validate_consistency(self.config.consistency_settings)
        self.sync_gate = None
        if settings["enabled"]:
            from .sync_gate import SyncGate
            discrete = hasattr(self.env_runner_group.foreach_env_runner(
                lambda r: r.module.action_space, local_env_runner=self.config.num_env_runners == 0)[0], "n")
            self.sync_gate = SyncGate(self, settings, self.config.moe_settings["inference_dtype"], discrete)
            self.sync_gate.snapshot()

    def cleanup(self) -> None:
        if getattr(self, "sync_gate", None) is not None:
            self.sync_gate.close()
        super().cleanup()

    def training_step(self) -> None:
        episodes = self._sample()
        if not episodes:
            return
        gate = self.sync_gate
        check = gate is not None and self.iteration % gate.s["every"] == 0
        if check:
            gate.before_update(episodes)          # trainer view + parameter divergence, weights v
        learner_results = self._update(episodes)
        if check:
            decision = self._log_check(gate.after_update())
            if decision == "rollback":            # learners back to the last good state, no sync
                gate.restore()
                return
            if decision == "hold":                # rollouts stay on the last good weights
                return
        self._sync_rollout_weights(set(learner_results[0]) - {ALL_MODULES})
        if check:
            gate.snapshot()

    def _log_check(self, result) -> str:
        row = result["row"]
        headline = {"drift/" + k: row[k] for k in ("k1", "k3", "max_abs_logp_diff", "routing_agreement",
                                                     "param_max_diff", "k3_old_new", "probe_flip_rate") if k in row}
        headline["drift/decision"] = result["decision"]
        for k, v in headline.items():
            if isinstance(v, str):
                self.metrics.log_value(("moe_rl", k), v, reduce="item")
            else:
                self.metrics.log_value(("moe_rl", k), v, window=1)
        return result["decision"]

    def restore_from_path(self, path, *args, **kwargs):
        super().restore_from_path(path, *args, **kwargs)
        if hasattr(self.learner_group, "publish_weights"):  # RLlib's restore sync only knows its own group
            self._sync_rollout_weights({"default_policy"})

    # --- the three steps --------------------------------------------------------------------------
    def _sample(self):
        """Rollout actors step their envs with the inference copy (weights version v)."""
        with self.metrics.log_time((TIMERS, ENV_RUNNER_SAMPLING_TIMER)):
            by_agent = self.config.count_steps_by == "agent_steps"
            episodes, runner_results = synchronous_parallel_sample(
                worker_set=self.env_runner_group,
                max_agent_steps=self.config.total_train_batch_size if by_agent else None,
                max_env_steps=None if by_agent else self.config.total_train_batch_size,
                sample_timeout_s=self.config.sample_timeout_s,
                _uses_new_env_runners=True, _return_metrics=True)
            if episodes:
                self.metrics.aggregate(runner_results, key=ENV_RUNNER_RESULTS)
        return episodes

    def _update(self, episodes):
        """PPO epochs on the learner group (RLlib's LearnerGroup or the DeepSpeed one)."""
        with self.metrics.log_time((TIMERS, LEARNER_UPDATE_TIMER)):
            learner_results = self.learner_group.update(
                episodes=episodes,
                timesteps={
                    NUM_ENV_STEPS_SAMPLED_LIFETIME: self.metrics.peek(
                        (ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME)),
                    NUM_MODULE_STEPS_TRAINED_LIFETIME: self.metrics.peek(
                        (LEARNER_RESULTS, ALL_MODULES, NUM_MODULE_STEPS_TRAINED_LIFETIME), default=0),
                },
                num_epochs=self.config.num_epochs,
                minibatch_size=self.config.minibatch_size,
                shuffle_batch_per_epoch=self.config.shuffle_batch_per_epoch,
            )
            self.metrics.aggregate(learner_results, key=LEARNER_RESULTS)
        if hasattr(self.learner_group, "memory_stats"):
            for rank, stats in enumerate(self.learner_group.memory_stats()):
                for k, v in stats.items():
                    self.metrics.log_value(("moe_rl", f"learner/{k}/rank{rank}"), v, window=1)
        return learner_results

    def _sync_rollout_weights(self, modules) -> None:
        """Push version v+1 to the rollout actors. With the DeepSpeed group every learner
        publishes its own shard and each rollout actor assembles them (strictly: a missing,
        unknown or duplicated tensor is an error)."""
        with self.metrics.log_time((TIMERS, SYNCH_WORKER_WEIGHTS_TIMER)):
            if not hasattr(self.learner_group, "publish_weights"):
                self.env_runner_group.sync_weights(from_worker_or_learner_group=self.learner_group,
                                                   policies=modules, inference_only=True)
                return
            refs, seq_no = self.learner_group.publish_weights(), self.learner_group.weights_seq_no
            self.env_runner_group.foreach_env_runner(
                lambda runner: load_shards_into_runner(runner, refs, seq_no), local_env_runner=False)


def load_shards_into_runner(runner, shard_refs, weights_seq_no: int) -> None:
    """Runs on a rollout actor: assemble the learners' shards and load them (strict)."""
    import ray

    from .sharding import assemble_shards
    state = assemble_shards(ray.get(shard_refs), runner.module.state_dict().keys())
    runner.set_state({COMPONENT_RL_MODULE: state, WEIGHTS_SEQ_NO: weights_seq_no})
