"""The MoE sections of every moe-rl AlgorithmConfig, as builders in RLlib's style: `.moe()`,
`.deepspeed()`, `.weight_sync()`, `.stability()`, `.consistency()`. moe_rl.algo.moe_config mixes
them into an algorithm's config (MoEPPOConfig, MoEAPPOConfig); each stores its keyword arguments
in `<section>_settings`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from ray.rllib.algorithms.algorithm_config import NotProvided

from moe_rl.core.gate import CONSISTENCY_DEFAULTS
from moe_rl.core.settings import DEEPSPEED_DEFAULTS, MOE_DEFAULTS, WEIGHT_SYNC_DEFAULTS, ConfigError
from moe_rl.core.stability import STABILITY_DEFAULTS


class MoESections:
    """The builders of the MoE sections (help(MoEPPOConfig.moe) lists every key); each returns the config."""

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
        rollout_compile: bool = NotProvided,
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
    ) -> "MoESections":
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
            rollout_compile: the rollout copy's forward through torch.compile (vector and image
                trunks, routers that do not sample): about 1.3-2x faster a call after a compile
                of 7-35 s at the first sample; off by default (BENCHMARKS.md, time to target).
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
    ) -> "MoESections":
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
    ) -> "MoESections":
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
    ) -> "MoESections":
        """The stability toolkit. Defaults: moe_rl.core.stability.STABILITY_DEFAULTS.

        Args:
            lr_schedules: parameter group (or "default": every other group) -> schedule spec, run
                by torch's schedulers (moe_rl.core.lr_schedules.torch_scheduler); a named group
                follows its schedule alone, groups without one follow training.lr.
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
    ) -> "MoESections":
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
