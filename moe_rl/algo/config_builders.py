"""The MoE sections of every moe-rl AlgorithmConfig, as builders in RLlib's style: `.moe()`,
`.deepspeed()`, `.weight_sync()`, `.stability()`, `.consistency()`. moe_rl.algo.moe_config mixes
them into an algorithm's config (MoEPPOConfig, MoEAPPOConfig); each stores its keyword arguments
in `<section>_settings`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from ray.rllib.algorithms.algorithm_config import NotProvided

from moe_rl.core.errors import ConfigError
from moe_rl.core.sections import (
    ConsistencySettings,
    DeepSpeedSettings,
    MoESettings,
    StabilitySettings,
    WeightSyncSettings,
    builder_doc,
    defaults,
    plain,
)


class MoESections:
    """The builders of the MoE sections (help(MoEPPOConfig.moe) lists every key); each returns the config."""

    # Builders take every key explicitly (as RLlib's own builders do), so an IDE shows them; their
    # names, defaults and help come from the section's dataclass (moe_rl.core.sections), and a test
    # checks the keywords are exactly its fields. `**unknown` only turns a misspelt key into the one
    # ConfigError form naming the allowed keys. Values are checked once, in validate(), before any
    # actor starts.
    def moe(
        self,
        *,
        num_experts: int = NotProvided,
        top_k: int = NotProvided,
        mixture: str = NotProvided,
        router: str = NotProvided,
        slots_per_expert: int = NotProvided,
        soft_normalize: bool = NotProvided,
        tokens: str = NotProvided,
        token_pool: str = NotProvided,
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
        q_hiddens: List[int] = NotProvided,
        task_slice: Optional[List[int]] = NotProvided,
        encoder: str = NotProvided,
        max_seq_len: int = NotProvided,
        positions: str = NotProvided,
        num_heads: int = NotProvided,
        **unknown,
    ) -> "MoESections":
        return self._set_section("moe", self.moe_settings, MoESettings, locals())

    def deepspeed(
        self,
        *,
        enabled: Optional[bool] = NotProvided,
        config: Union[Dict[str, Any], str] = NotProvided,
        num_threads: int = NotProvided,
        placement_strategy: str = NotProvided,
        **unknown,
    ) -> "MoESections":
        return self._set_section("deepspeed", self.deepspeed_settings, DeepSpeedSettings, locals())

    def weight_sync(
        self,
        *,
        transport: str = NotProvided,
        backend: str = NotProvided,
        bucket_mb: float = NotProvided,
        timeout_s: float = NotProvided,
        **unknown,
    ) -> "MoESections":
        return self._set_section("weight_sync", self.weight_sync_settings, WeightSyncSettings, locals())

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
        return self._set_section("stability", self.stability_settings, StabilitySettings, locals())

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
        return self._set_section("consistency", self.consistency_settings, ConsistencySettings, locals())

    def _set_section(self, section: str, target: Dict[str, Any], fields, given: Dict[str, Any]):
        unknown = sorted(given.pop("unknown"))
        if unknown:
            raise ConfigError(f"{section}.{unknown[0]}: unknown key, allowed: {', '.join(sorted(defaults(fields)))}")
        # A new mapping (the section may be a validated, frozen one): checked again in validate().
        setattr(self, f"{section}_settings",
                {**plain(target), **{k: v for k, v in given.items() if k != "self" and v is not NotProvided}})
        return self


# help(MoEPPOConfig.moe) and friends: every key, its default and what it does, from its dataclass.
SECTION_FIELDS = {"moe": MoESettings, "deepspeed": DeepSpeedSettings, "weight_sync": WeightSyncSettings,
                  "stability": StabilitySettings, "consistency": ConsistencySettings}
_SUMMARIES = {"moe": "The MoE policy.", "deepspeed": "The DeepSpeed expert-parallel learner group.",
              "weight_sync": "How the learners' weights reach the rollout actors.",
              "stability": "The stability toolkit.", "consistency": "Drift checks and the sync gate."}
for _name, _fields in SECTION_FIELDS.items():
    getattr(MoESections, _name).__doc__ = builder_doc(_SUMMARIES[_name], _fields)
