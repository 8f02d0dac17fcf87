"""MoE-PPO on RLlib: MoEPPOConfig (a PPOConfig) and MoEPPO (a PPO).

    config = (MoEPPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=2)
              .moe(num_experts=8, top_k=2, router="topk"))
    algo = config.build_algo()
    algo.train()
"""
from __future__ import annotations

import contextlib
import copy
import logging
import time
from typing import Any, Dict, List, Optional, Union

from ray.rllib.algorithms.algorithm_config import NotProvided
from ray.rllib.algorithms.ppo import PPO, PPOConfig
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.execution.rollout_ops import synchronous_parallel_sample
from ray.rllib.utils import force_list
from ray.rllib.utils.metrics import (
    ALL_MODULES,
    ENV_RUNNER_RESULTS,
    ENV_RUNNER_SAMPLING_TIMER,
    LEARNER_RESULTS,
    LEARNER_UPDATE_TIMER,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    NUM_MODULE_STEPS_TRAINED_LIFETIME,
    SYNCH_WORKER_WEIGHTS_TIMER,
    TIMERS,
)

import envs  # noqa: F401  registers moe_rl/ gymnasium ids in every process that loads this config
from actors.learner_group import DeepSpeedLearnerGroup
from moe_rl.algo.monitoring import MoEMonitoring
from moe_rl.algo.sync_gate import GateStop, SyncGate
from moe_rl.algo.weight_sync import CollectiveWeightSync
from moe_rl.core.gate import CONSISTENCY_DEFAULTS, validate_consistency
from moe_rl.core.sample_filter import drop_nonfinite
from moe_rl.core.settings import (
    DEEPSPEED_DEFAULTS,
    MOE_DEFAULTS,
    WEIGHT_SYNC_DEFAULTS,
    ConfigError,
    resolve_deepspeed,
    validate_moe,
    validate_weight_sync,
)
from moe_rl.core.stability import STABILITY_DEFAULTS, validate_stability
from moe_rl.rllib.learner import MoEPPOTorchLearner
from moe_rl.rllib.learner_group import MoELearnerGroup
from moe_rl.rllib.rl_module import MoEPolicyModule
from moe_rl.rllib.runner import load_shards_into_runner, runner_dtypes, runner_modules
from moe_rl.rllib.task_metrics import TaskEpisodeMetrics

__all__ = ["MoEPPOConfig", "MoEPPO", "GateStop"]

logger = logging.getLogger(__name__)


class MoEPPOConfig(PPOConfig):
    """PPOConfig plus `.moe(...)` (the MoE policy), `.deepspeed(...)` (the expert-parallel learner
    group), `.weight_sync(...)` (how the weights reach the rollout actors), `.stability(...)` and
    `.consistency(...)` (drift checks and the sync gate)."""

    def __init__(self, algo_class=None):
        super().__init__(algo_class=algo_class or MoEPPO)
        self.moe_settings: Dict[str, Any] = copy.deepcopy(MOE_DEFAULTS)
        self.deepspeed_settings: Dict[str, Any] = copy.deepcopy(DEEPSPEED_DEFAULTS)
        self.stability_settings: Dict[str, Any] = {}
        self.consistency_settings: Dict[str, Any] = {}
        self.weight_sync_settings: Dict[str, Any] = {}
        # Per-task returns, success and routing for multi-task envs (nothing for the others). A
        # user's own `.callbacks(...)` replaces it, as in RLlib: list both to keep it.
        self.callbacks_class = TaskEpisodeMetrics

    # Builders take every key explicitly (as RLlib's own builders do), so help() and an IDE show
    # them; `**unknown` only turns a misspelt key into the one ConfigError form naming the allowed
    # keys. Values are checked once, in validate(), before any actor starts.
    def moe(
        self,
        *,
        num_experts: int = NotProvided,
        top_k: int = NotProvided,
        router: str = NotProvided,
        num_layers: int = NotProvided,
        d_model: int = NotProvided,
        d_ff: int = NotProvided,
        activation: str = NotProvided,
        temperature: float = NotProvided,
        router_init: str = NotProvided,
        router_init_std: Optional[float] = NotProvided,
        router_kwargs: Dict[str, Any] = NotProvided,
        shared_expert: bool = NotProvided,
        expert_dropout: float = NotProvided,
        capacity_factor: Optional[float] = NotProvided,
        dispatch: str = NotProvided,
        aux_loss_coef: float = NotProvided,
        balance: str = NotProvided,
        z_loss_coef: float = NotProvided,
        reinforce_loss_coef: float = NotProvided,
        activation_checkpointing: bool = NotProvided,
        policy_head: str = NotProvided,
        inference_dtype: str = NotProvided,
        ep_size: int = NotProvided,
        routing_replay: Union[bool, str] = NotProvided,
        replay_anchor_coef: float = NotProvided,
        normalize_gates: Union[bool, str] = NotProvided,
        trainer_capacity_factor: Optional[float] = NotProvided,
        trainer_second_expert_sampling: bool = NotProvided,
        trainer_random_token_selection: bool = NotProvided,
        vf_hiddens: List[int] = NotProvided,
        task_slice: Optional[List[int]] = NotProvided,
        encoder: str = NotProvided,
        max_seq_len: int = NotProvided,
        positions: str = NotProvided,
        num_heads: int = NotProvided,
        **unknown,
    ) -> "MoEPPOConfig":
        """The MoE policy. Defaults: moe_rl.core.settings.MOE_DEFAULTS.

        Args:
            num_experts: N experts per MoE layer.
            top_k: experts per token.
            router: topk | sinkhorn | bias | task | reinforce.
            num_layers: MoE blocks in the policy trunk.
            d_model: trunk width.
            d_ff: expert hidden width.
            activation: expert activation (moe_rl.core.experts.ACTIVATIONS).
            temperature: router softmax temperature.
            router_init: router weight init (moe_rl.core.routers.ROUTER_INITS).
            router_init_std: its std; None: 0.02 / sqrt(N).
            router_kwargs: router-specific options, checked against the router's constructor
                (sinkhorn_epsilon, bias_update_rate, num_tasks, ...).
            shared_expert: a dense expert every token also passes through.
            expert_dropout: in training, drop each of a token's experts with this probability.
            capacity_factor: None: dropless; else tokens beyond the capacity are dropped.
            dispatch: auto | dense | gathered | grouped | sorted: how tokens reach the experts.
            aux_loss_coef: Switch load-balancing loss weight (the ceiling under balance "adaptive").
            balance: fixed | adaptive: adaptive applies the balance loss only while the load's CV
                is above the healthy band, rising to aux_loss_coef and fading once it is back
                (moe_rl.core.balance).
            z_loss_coef: ST-MoE router z-loss weight.
            reinforce_loss_coef: router "reinforce": weight of its policy-gradient loss.
            activation_checkpointing: recompute MoE blocks in backward (memory for compute).
            policy_head: linear | dual (parallel linear and MLP branches).
            inference_dtype: fp32 | bf16: numeric setup of the rollout (inference) copy.
            ep_size: expert-parallel degree of the DeepSpeed learner group.
            routing_replay: R3, the learner replays the rollout's recorded top-k. true: all of
                it; mismatched: only where the trainer, at the rollout's weights, would route a
                token otherwise (a bf16 flip), fixed for the update, the rest following the
                router as it learns; auto: true where the routing is not a function of the
                observation alone (reinforce; capacity, except on the token trunk with an fp32
                copy: its capacity groups are sequences), mismatched under a bf16 copy, else off.
            replay_anchor_coef: under routing replay, weight of -log(router mass on the replayed
                experts), which keeps the router's own choice on the experts PPO trains
                (moe_rl.core.losses.replay_anchor_loss).
            normalize_gates: combine weights of the chosen experts: their softmax renormalised
                over the k (true) or each one's own router probability (false). auto: false
                exactly under full routing replay, where it lets R3 learn as fast as no replay.
            trainer_capacity_factor: DeepSpeed learner only: drop beyond this capacity (None: dropless).
            trainer_second_expert_sampling: DeepSpeed learner only: Gumbel-sample the 2nd expert.
            trainer_random_token_selection: DeepSpeed learner only: random survivors at capacity.
            vf_hiddens: value network widths (kept outside the MoE).
            task_slice: [start, num_tasks]: a one-hot task id inside vector observations, or inside
                a Dict observation's "task" entry (router "task").
            encoder: auto | flat | conv: what reads the observation before the MoE blocks; auto:
                a small CNN for image observations ((H, W, C), or a Dict with "image"), else the
                raw vector (moe_rl.core.encoders).
            max_seq_len: token-sequence policies: context length of the transformer; under
                positions "relative", the longest distance with an attention bias of its own.
            positions: token-sequence policies: learned (absolute position embeddings, sequences
                up to max_seq_len) | relative (a learned attention bias per distance; any length).
            num_heads: token-sequence policies: attention heads.
        """
        return self._set_section("moe", self.moe_settings, MOE_DEFAULTS, locals())

    def deepspeed(
        self,
        *,
        enabled: Optional[bool] = NotProvided,
        config: Union[Dict[str, Any], str] = NotProvided,
        num_threads: int = NotProvided,
        placement_strategy: str = NotProvided,
        **unknown,
    ) -> "MoEPPOConfig":
        """The DeepSpeed expert-parallel learner group. Defaults: moe_rl.core.settings.DEEPSPEED_DEFAULTS.

        Args:
            enabled: None: on when moe.ep_size > 1 or a DeepSpeed config is given.
            config: DeepSpeed config dict (or a JSON file path), passed to deepspeed.initialize.
            num_threads: torch intra-op threads per learner process.
            placement_strategy: the learners' placement group: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD.
        """
        return self._set_section("deepspeed", self.deepspeed_settings, DEEPSPEED_DEFAULTS, locals())

    def weight_sync(
        self,
        *,
        transport: str = NotProvided,
        backend: str = NotProvided,
        bucket_mb: float = NotProvided,
        timeout_s: float = NotProvided,
        **unknown,
    ) -> "MoEPPOConfig":
        """How the learners' weights reach the rollout actors. Defaults:
        moe_rl.core.settings.WEIGHT_SYNC_DEFAULTS.

        Args:
            transport: object_store (each rollout actor pulls every learner's published part) or
                collective (each publishing learner broadcasts its part to the rollout actors in a
                Ray collective group; needs DeepSpeed learners and remote env runners).
            backend: collective: gloo (CPU buffers) or nccl (every member holds a GPU).
            bucket_mb: collective: bucket size; one bucket per source is in flight.
            timeout_s: collective: a member that does not answer in time fails the sync over to
                the object store; the groups are formed afresh at the next sync.
        """
        return self._set_section("weight_sync", self.weight_sync_settings, WEIGHT_SYNC_DEFAULTS, locals())

    @property
    def uses_deepspeed(self) -> bool:
        return bool(resolve_deepspeed(self.deepspeed_settings, self.moe_settings, self.num_learners)["enabled"])

    def build_learner_group(self, *, env=None, spaces=None, rl_module_spec=None, placement_group=None):
        """RLlib's LearnerGroup (as MoELearnerGroup), or the DeepSpeed expert-parallel group: both
        offer the learner-group interface of moe_rl.rllib.learner_group."""
        if rl_module_spec is None:
            rl_module_spec = self.get_multi_rl_module_spec(env=env, spaces=spaces)
        if not self.uses_deepspeed:
            return MoELearnerGroup(config=self.copy(), module_spec=rl_module_spec, placement_group=placement_group)
        config = self.copy(copy_frozen=False)
        config.deepspeed_settings = resolve_deepspeed(self.deepspeed_settings, self.moe_settings, self.num_learners)
        config.freeze()
        return DeepSpeedLearnerGroup(config=config, module_spec=rl_module_spec)

    def stability(
        self,
        *,
        lr_schedules: Dict[str, Dict[str, Any]] = NotProvided,
        grad_clip: Optional[float] = NotProvided,
        grad_clip_factors: Dict[str, float] = NotProvided,
        skip_nonfinite: bool = NotProvided,
        winsorize_p: Optional[float] = NotProvided,
        projection_rank: Optional[int] = NotProvided,
        projection_groups: List[str] = NotProvided,
        projection_refresh: int = NotProvided,
        router_warmup_steps: int = NotProvided,
        expert_dropout_schedule: Optional[Dict[str, float]] = NotProvided,
        optimizer: str = NotProvided,
        weight_decay: float = NotProvided,
        betas: List[float] = NotProvided,
        lamb_clamp: float = NotProvided,
        anomaly_detection: bool = NotProvided,
        anomaly_window: int = NotProvided,
        anomaly_z: float = NotProvided,
        anomaly_min_history: int = NotProvided,
        entropy_band: List[float] = NotProvided,
        grad_norm_band: List[float] = NotProvided,
        health_warmup: int = NotProvided,
        flip_rate_max: float = NotProvided,
        rss_growth_mb: float = NotProvided,
        **unknown,
    ) -> "MoEPPOConfig":
        """The stability toolkit. Defaults: moe_rl.core.stability.STABILITY_DEFAULTS.

        Args:
            lr_schedules: parameter group (or "default": every other group) -> schedule spec
                (moe_rl.core.stability.lr_at); groups without one follow training.lr.
            grad_clip: base max-norm (None: off); a group's threshold is base x its factor.
            grad_clip_factors: parameter group -> clip factor (router 0.5, experts 3.0, ...).
            skip_nonfinite: a non-finite gradient on any learner skips the step on all.
            winsorize_p: clamp each gradient to its (1-p) quantile of |g| (None: off).
            projection_rank: project 2-D gradients (each expert matrix) on their top-r right
                singular vectors (None: off).
            projection_groups: parameter groups whose gradients are projected.
            projection_refresh: re-derive the basis every N applied steps (0: keep the first).
            router_warmup_steps: the first N applied steps update only router parameters.
            expert_dropout_schedule: {"start": 0.05, "end": 0.2, "steps": T}: linear in steps.
            optimizer: adam | adamw | lamb.
            weight_decay: decoupled weight decay (adamw, lamb).
            betas: Adam / LAMB betas.
            lamb_clamp: LAMB: upper bound of the weight norm in the trust ratio.
            anomaly_detection: rolling-window checks over the iteration metrics.
            anomaly_window: iterations of history the detector keeps.
            anomaly_z: robust z-score (median / MAD) for spikes and drops.
            anomaly_min_history: iterations before spikes and drops are judged.
            entropy_band: normalised router entropy outside it is a breach.
            grad_norm_band: pre-clip gradient norm outside it x the run's median is a breach.
            health_warmup: iterations before health-band breaches are judged.
            flip_rate_max: probe-set routing flip rate above it is routing oscillation.
            rss_growth_mb: an actor's RSS growing more than this over the window is an alert.
        """
        return self._set_section("stability", self.stability_settings, STABILITY_DEFAULTS, locals())

    def consistency(
        self,
        *,
        enabled: bool = NotProvided,
        every: int = NotProvided,
        policy: str = NotProvided,
        thresholds: Dict[str, float] = NotProvided,
        relative_z: float = NotProvided,
        relative_warmup: int = NotProvided,
        relative_window: int = NotProvided,
        flip_margin: float = NotProvided,
        max_holds: int = NotProvided,
        max_rollbacks: int = NotProvided,
        rollback_lr_scale: float = NotProvided,
        sample_size: int = NotProvided,
        probe_size: int = NotProvided,
        param_sample: float = NotProvided,
        position_bins: List[int] = NotProvided,
        correction: Dict[str, Any] = NotProvided,
        **unknown,
    ) -> "MoEPPOConfig":
        """Drift checks and the sync gate. Defaults: moe_rl.core.gate.CONSISTENCY_DEFAULTS.

        Args:
            enabled: run the consistency checks (and the gate) at all.
            every: check before every K-th weight sync (every iteration while holding).
            policy: what a bad update does: warn | hold | rollback.
            thresholds: absolute limits: k3, max_abs_logp_diff, routing_agreement (mismatch);
                update_size, k3_old_new, probe_flip_rate (absolute caps, off by default).
            relative_z: a bad update is a value > median + z * scale of the run's accepted values.
            relative_warmup: checks before the relative limits apply.
            relative_window: accepted values kept per signal.
            flip_margin: probe flips count only where the old top-k margin (logits) exceeds it.
            max_holds: consecutive holds before escalating to rollback.
            max_rollbacks: consecutive rollbacks before the run stops (resumable).
            rollback_lr_scale: the retry after a rollback runs at this LR scale (compounding).
            sample_size: rollout steps per check given to the trainer-side forward.
            probe_size: fixed probe observations kept for the whole run.
            param_sample: share of tensors digested per check (1/K): a rotating share, so every
                tensor of every rollout copy and learner replica is compared bit for bit at least
                every K checks; 1: all of them at every check.
            position_bins: sequence-position bins of K3 by position.
            correction: rollout correction: IS / RS / veto / routing RS, with presets
                (moe_rl.core.correction).
        """
        return self._set_section("consistency", self.consistency_settings, CONSISTENCY_DEFAULTS, locals())

    def _set_section(self, section: str, target: Dict[str, Any], defaults: Dict[str, Any], given: Dict[str, Any]):
        unknown = sorted(given.pop("unknown"))
        if unknown:
            raise ConfigError(f"{section}.{unknown[0]}: unknown key, allowed: {', '.join(sorted(defaults))}")
        target.update({k: v for k, v in given.items() if k != "self" and v is not NotProvided})
        return self

    @property
    def _model_config_auto_includes(self) -> Dict[str, Any]:
        return super()._model_config_auto_includes | {"moe": dict(self.moe_settings)}

    def get_default_rl_module_spec(self) -> RLModuleSpec:
        return RLModuleSpec(module_class=MoEPolicyModule)

    def get_default_learner_class(self):
        return MoEPPOTorchLearner

    def validate(self) -> None:
        super().validate()
        validate_moe(self.moe_settings, num_learners=self.num_learners)
        validate_stability(self.stability_settings)
        resolve_deepspeed(self.deepspeed_settings, self.moe_settings, self.num_learners)
        validate_consistency(self.consistency_settings)
        validate_weight_sync(self.weight_sync_settings, uses_deepspeed=self.uses_deepspeed,   # evaluation: own runners
                             num_env_runners=None if self.in_evaluation else self.num_env_runners)


class MoEPPO(PPO):
    """PPO whose policy is an MoE. One iteration (`training_step`):

        sample     rollout actors step their envs with the inference copy (weights version v)
        check 1    rollout copies vs v (digests, repair), the learners' view of the sample (mismatch)
        update     PPO epochs on the learner group
        check 2    the candidate: finite, update size, KL and flips on the probe set (the gate decides)
        sync       the learners' parts to the rollout actors: version v + 1, strictly assembled
    """

    @classmethod
    def get_default_config(cls) -> MoEPPOConfig:
        return MoEPPOConfig()

    def setup(self, config) -> None:
        super().setup(config)
        settings = validate_consistency(self.config.consistency_settings)
        self.weights_version = 0          # the version the rollout actors run
        self.updates_since_sync = 0       # > 0: the learners are ahead of the rollouts (a hold)
        self._synced_refs: Optional[list] = []   # the learners' published parts of version weights_version
        self.synced_digests: dict = {}
        self._pending_faults: list = []   # test hooks (moe_rl.algo.faults.inject)
        self.sync_gate = None
        sync = validate_weight_sync(self.config.weight_sync_settings)
        self.weight_sync = CollectiveWeightSync(self, sync) if sync["transport"] == "collective" else None
        if settings["enabled"] or self.weight_sync is not None:   # what the digests and the wire cast to
            self.rollout_dtypes = self.runner_call(runner_dtypes)[1][0]
        if settings["enabled"]:
            discrete = {mid: hasattr(sp, "n") for mid, sp in self.runner_call(
                lambda r: {m: mod.action_space for m, mod in runner_modules(r).items()
                           if isinstance(mod, MoEPolicyModule)})[1][0].items()}
            self.sync_gate = SyncGate(self, settings, discrete)
        self._sync_rollout_weights()
        self._faults = {"env_runner_failures": 0, "lost_env_steps": 0, "env_runners_restored": 0,
                        "nonfinite_episodes_dropped": 0, "nonfinite_env_steps_dropped": 0}
        self.monitoring = MoEMonitoring(self)   # driver-only: anomaly detection, memory, Prometheus
        self.callbacks = force_list(self.callbacks) + [self.monitoring]

    def cleanup(self) -> None:
        if getattr(self, "sync_gate", None) is not None:
            self.sync_gate.close()
        if getattr(self, "weight_sync", None) is not None:
            self.weight_sync.close()
        if getattr(self, "monitoring", None) is not None:
            self.monitoring.close()
        super().cleanup()

    # --- one iteration ----------------------------------------------------------------------------
    def training_step(self) -> None:
        clock = PhaseClock()
        with clock("sample_s"):
            episodes = self._sample()
        if not episodes:
            return
        steps = sum(len(ep) for ep in episodes)
        gate = self.sync_gate
        check = gate is not None and (self.iteration % gate.s["every"] == 0 or gate.holding)
        if check:
            with clock("check_s"):
                gate.before_update(episodes)
        self._inject_faults("before_update")
        with clock("learn_s"):
            self._update(episodes)
        self.updates_since_sync += 1
        self._inject_faults("after_update")
        try:
            if check:
                with clock("check_s"):
                    verdict = gate.after_update()
                self._log_check(verdict)
                if verdict["decision"] in ("hold", "rollback"):   # rollouts stay on the last good weights
                    return
            with clock("sync_s"):
                self._sync_rollout_weights()
        finally:
            clock.seconds["env_steps_per_s"] = steps / max(clock.total, 1e-9)
            for k, v in clock.seconds.items():
                self.metrics.log_value(("moe_rl", k), v, window=1)

    def _log_check(self, verdict) -> None:
        rows = self.sync_gate.rows
        row = rows[-1]
        figures = {"drift/" + k: row[k] for k in ("k1", "k3", "max_abs_logp_diff", "routing_agreement", "lag_versions",
                                                    "lag_k3", "k3_old_new", "probe_flip_rate") if k in row}
        figures.update({"drift/decision": verdict["decision"], "drift/cause": ";".join(verdict["causes"]),
                        "drift/action": ";".join(verdict["actions"]), "drift/repairs": self.sync_gate.repairs})
        for k, v in figures.items():
            if isinstance(v, str):
                self.metrics.log_value(("moe_rl", k), v, reduce="item")
            else:
                self.metrics.log_value(("moe_rl", k), v, window=1)

    # --- weights ----------------------------------------------------------------------------------
    def runner_call(self, fn, runner_ids=None, **kwargs):
        """fn(runner, **kwargs) on the rollout actors that sample (the local one when there are
        no remote ones) -> (runner ids, results)."""
        group = self.env_runner_group
        if group.num_remote_env_runners() == 0:
            return [0], group.foreach_env_runner(lambda r: fn(r, **kwargs), local_env_runner=True)
        ids = list(runner_ids) if runner_ids is not None else list(group.healthy_env_runner_ids())
        return ids, group.foreach_env_runner(lambda r: fn(r, **kwargs), remote_worker_ids=ids,
                                             local_env_runner=False)

    def push_synced_weights(self, runner_ids=None, force: bool = False) -> None:
        """Load the synced version into rollout actors (all, or `runner_ids`; force: even when
        they already claim that version)."""
        refs, version = self.synced_refs, self.weights_version
        self.runner_call(lambda r: load_shards_into_runner(r, refs, version, force), runner_ids)

    @property
    def synced_refs(self) -> list:
        """The learners' published parts of the synced version. Under the collective transport
        they are published only when asked (a repair, a restarted rollout actor, a failed
        broadcast): from the parts the learners kept (the gate can hold them back from the
        synced version), else from their weights, which are the synced version until the next
        update."""
        if self._synced_refs is None:
            self._synced_refs = (self.learner_group.publish_synced() if self.sync_gate is not None
                                 else self.learner_group.publish_weights(inference_only=True))
        return self._synced_refs

    def _sync_rollout_weights(self) -> None:
        """Version v + 1 to the rollout actors. object_store: every learner publishes its own part
        once (in its node's object store) and each rollout actor pulls and assembles them strictly.
        collective: every learner broadcasts its part to the rollout actors (the object store
        serves when that fails) and, for the gate, keeps it. The synced version stays at hand
        (repairs, restarted actors and the update-size check use it) and its digests, in the
        rollout copies' dtypes, are taken where the parts live."""
        with self.metrics.log_time((TIMERS, SYNCH_WORKER_WEIGHTS_TIMER)):
            self.weights_version += 1
            self.updates_since_sync = 0
            if self.weight_sync is None:
                self._synced_refs = self.learner_group.publish_weights(inference_only=True)
                self.push_synced_weights()
            else:
                if self.sync_gate is not None:
                    self.learner_group.keep_synced()
                self._synced_refs = None
                if not self.weight_sync.sync(self.weights_version):
                    self.push_synced_weights()
                self.metrics.log_value(("moe_rl", "sync/collective_fallbacks"), self.weight_sync.fallbacks, window=1)
            if self.sync_gate is not None:
                self.synced_digests = {}
                for part in self.learner_group.shard_digests(self.rollout_dtypes, self.sync_gate.digest_sample()):
                    for mid, d in part.items():
                        self.synced_digests.setdefault(mid, {}).update(d)
                self.sync_gate.after_sync()

    def reference_refs(self) -> Optional[list]:
        """What the update-size check compares against: the published parts, or None where the
        learners kept them (the collective transport)."""
        return self._synced_refs if self.weight_sync is None else None

    def continue_ledgers(self, drift_rows, alerts_total: int) -> None:
        """A resumed run: the gate's ledger and the alert count go on from the checkpoint's."""
        if self.sync_gate is not None:
            self.sync_gate.rows[:] = list(drift_rows)
        self.monitoring.continue_from(len(drift_rows), alerts_total)

    def restore_last_good(self) -> None:
        """The learners back to the state of the synced version (weights and optimizer moments)."""
        self.sync_gate.restore()
        self.updates_since_sync = 0

    def _inject_faults(self, stage: str) -> None:
        for fault in [f for f in self._pending_faults if f.stage == stage]:
            self._pending_faults.remove(fault)
            fault.apply(self)

    # --- checkpoints ------------------------------------------------------------------------------
    def get_state(self, *args, **kwargs):
        state = super().get_state(*args, **kwargs)
        if getattr(self, "sync_gate", None) is not None:
            state[GATE_STATE] = self.sync_gate.get_state()
        return state

    def set_state(self, state) -> None:
        super().set_state(state)
        if getattr(self, "sync_gate", None) is not None and GATE_STATE in state:
            self.sync_gate.set_state(state[GATE_STATE])

    def restore_from_path(self, path, *args, **kwargs):
        super().restore_from_path(path, *args, **kwargs)
        self._sync_rollout_weights()   # the restored weights are a new version for the rollouts

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
        """RLlib restarts failed rollout actors and syncs them from the learner group, which may
        be ahead of the version the rollouts run (a hold). A replacement takes the synced version
        before it samples."""
        restored = super().restore_env_runners(env_runner_group)
        if not restored or env_runner_group is not self.env_runner_group:
            return restored
        self._faults["env_runners_restored"] += len(restored)
        if self.weights_version:
            self.push_synced_weights(runner_ids=restored, force=True)
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
        for rank, stats in enumerate(self.learner_group.memory_stats()):
            for k, v in stats.items():
                self.metrics.log_value(("moe_rl", f"learner/{k}/rank{rank}"), v, window=1)
        return learner_results


GATE_STATE = "moe_rl_gate"


class PhaseClock:
    """Seconds per phase of one iteration (sample_s, check_s, learn_s, sync_s): where the time goes."""

    def __init__(self):
        self.seconds = {"sample_s": 0.0, "check_s": 0.0, "learn_s": 0.0, "sync_s": 0.0}
        self.total = 0.0

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.seconds[phase] += dt
            self.total += dt
