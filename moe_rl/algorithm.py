"""MoE-PPO on RLlib: MoEPPOConfig (a PPOConfig) and MoEPPO (a PPO).

    config = (MoEPPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=2)
              .moe(num_experts=8, top_k=2, router="topk"))
    algo = config.build_algo()
    algo.train()
"""
from __future__ import annotations

import copy
import logging
import os
from typing import Any, Dict

import ray
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

from .anomaly import AnomalyDetector, rss_mb
from .sample_filter import drop_nonfinite
from .settings import DEEPSPEED_DEFAULTS, MOE_DEFAULTS, ConfigError, resolve_deepspeed, validate_moe
from .stability import STABILITY_DEFAULTS, validate_stability

logger = logging.getLogger(__name__)


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
        """The stability toolkit: per-group LR schedules and clipping, NaN-step skipping,
        winsorizing, projection, router warm-up, expert-dropout schedule, LAMB, anomaly detection
        (see moe_rl.stability.STABILITY_DEFAULTS for every key and its default)."""
        unknown = sorted(set(kwargs) - set(STABILITY_DEFAULTS))
        if unknown:
            raise ConfigError(f"stability.{unknown[0]}: unknown key, allowed: {', '.join(sorted(STABILITY_DEFAULTS))}")
        self.stability_settings.update({k: v for k, v in kwargs.items() if v is not NotProvided})
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
        validate_stability(self.stability_settings)
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
        self._faults = {"env_runner_failures": 0, "lost_env_steps": 0, "env_runners_restored": 0,
                        "nonfinite_episodes_dropped": 0, "nonfinite_env_steps_dropped": 0}
        stability = validate_stability(self.config.stability_settings)
        self.anomaly = None
        self.alerts: list = []
        self.alerts_path = stability["alerts_path"]
        if stability["anomaly_detection"]:
            self.anomaly = AnomalyDetector(stability, self.config.moe_settings["num_experts"])
        from .prometheus import PrometheusExporter   # every row to Ray's Prometheus endpoint
        run = os.path.basename(os.path.dirname(os.path.abspath(self.alerts_path))) if self.alerts_path else "moe_rl"
        self.prometheus = PrometheusExporter(run=run, num_experts=self.config.moe_settings["num_experts"])

    def step(self):
        results = super().step()
        self._watch(results)
        return results

    def _watch(self, results) -> None:
        """Anomaly detection (if enabled) over this iteration's metrics (and every actor's RSS): new
        alerts go to the results (`moe_rl/alerts/*`, `moe_rl_alerts`), the log, and
        `stability.alerts_path`; then the row and the alerts go to Prometheus (moe_rl.prometheus)."""
        from .run_dir import metrics_row, write_table
        figures = results.setdefault("moe_rl", {})
        figures["memory/rss_mb/driver"] = rss_mb()
        if self.config.num_env_runners > 0:
            try:
                for i, v in enumerate(self.env_runner_group.foreach_env_runner(
                        lambda r: rss_mb(), local_env_runner=False)):
                    figures[f"memory/rss_mb/runner{i + 1}"] = v
            except ray.exceptions.RayError:   # a dead runner: fault tolerance handles it, not this watch
                pass
        row = metrics_row({**results, "training_iteration": self.iteration + 1})
        new = []
        if self.anomaly is not None:
            new = self.anomaly.observe(row)
            self.alerts.extend(new)
            figures["alerts/new"], figures["alerts/total"] = len(new), len(self.alerts)
            results["moe_rl_alerts"] = new
            for a in new:
                logger.warning("moe-rl alert: iteration %d %s: %s", a["iteration"], a["kind"], a["message"])
            if new and self.alerts_path:
                write_table(self.alerts_path, self.alerts)
        self.prometheus.export(row, new)

    def cleanup(self) -> None:
        if getattr(self, "sync_gate", None) is not None:
            self.sync_gate.close()
        if getattr(self, "prometheus", None) is not None:
            self.prometheus.close()
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
        """Rollout actors step their envs with the inference copy (weights version v). A rollout
        actor that dies mid-sample costs only its in-flight request: the others fill the batch, the
        loss is counted (`faults/*`), and RLlib restarts the actor before the next iteration.
        Episodes with non-finite observations or rewards are dropped here and counted."""
        healthy = self.env_runner_group.num_healthy_remote_workers()
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
        failed = max(0, healthy - self.env_runner_group.num_healthy_remote_workers())
        self._faults["env_runner_failures"] += failed
        # A failed request loses what it was asked for: one rollout fragment per vectorised env.
        self._faults["lost_env_steps"] += failed * self.config.get_rollout_fragment_length() * max(
            1, self.config.num_envs_per_env_runner)
        # Episodes with NaN/Inf observations or rewards never reach the checks or the learners.
        episodes, dropped, steps = drop_nonfinite(episodes or [])
        self._faults["nonfinite_episodes_dropped"] += dropped
        self._faults["nonfinite_env_steps_dropped"] += steps
        self._log_faults()
        return episodes

    def _log_faults(self) -> None:
        for k, v in self._faults.items():
            self.metrics.log_value(("moe_rl", f"faults/{k}"), v, window=1)

    def restore_env_runners(self, env_runner_group):
        """RLlib restarts failed rollout actors and syncs them from the local EnvRunner or the
        learner group; with the DeepSpeed group that is not the version the rollouts run (the
        gate may hold). A replacement takes the module state of a healthy peer (or, with none
        left, the learners' published shards) before it samples."""
        restored = super().restore_env_runners(env_runner_group)
        if not restored or env_runner_group is not self.env_runner_group:
            return restored
        self._faults["env_runners_restored"] += len(restored)
        peers = [i for i in env_runner_group.healthy_env_runner_ids() if i not in restored]
        if peers:
            state = env_runner_group.foreach_env_runner(
                lambda r: r.get_state(components=[COMPONENT_RL_MODULE, WEIGHTS_SEQ_NO]),
                remote_worker_ids=peers[:1], local_env_runner=False)[0]
            ref = ray.put(state)
            env_runner_group.foreach_env_runner(lambda r: r.set_state(ray.get(ref)), remote_worker_ids=restored,
                                                local_env_runner=False)
        elif hasattr(self.learner_group, "publish_weights"):
            self._push_learner_shards(remote_worker_ids=restored, local_env_runner=False)
        return restored

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
            self._push_learner_shards(local_env_runner=self.config.num_env_runners == 0)  # 0: it samples

    def _push_learner_shards(self, **foreach_kwargs) -> None:
        """Every learner publishes its shard once; the chosen rollout actors assemble and load them."""
        refs, seq_no = self.learner_group.publish_weights(), self.learner_group.weights_seq_no
        self.env_runner_group.foreach_env_runner(lambda runner: load_shards_into_runner(runner, refs, seq_no),
                                                 **foreach_kwargs)


def load_shards_into_runner(runner, shard_refs, weights_seq_no: int) -> None:
    """Runs on a rollout actor: assemble the learners' shards and load them (strict)."""
    import ray

    from .sharding import assemble_shards
    state = assemble_shards(ray.get(shard_refs), runner.module.state_dict().keys())
    runner.set_state({COMPONENT_RL_MODULE: state, WEIGHTS_SEQ_NO: weights_seq_no})
