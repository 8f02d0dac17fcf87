"""Every MoE section's settings, each defined once: a frozen dataclass per section whose fields
carry the type, the default and what the setting does (pure python).

    moe: MoESettings   deepspeed: DeepSpeedSettings   weight_sync: WeightSyncSettings
    stability: StabilitySettings   consistency: ConsistencySettings

Every validator returns its section typed (a `Section`: frozen, read as attributes or as a
mapping). Everything else is derived from these: the defaults dicts the validators merge
(`defaults(MoESettings)`), the builders' help (`help(MoEPPOConfig.moe)`: `builder_doc`), and the
builders' keyword arguments are checked against the fields (tests/test_bad_config.py). Validation
(what is allowed, named in one ConfigError) stays with each section's validator.
"""
from __future__ import annotations

import copy
import dataclasses
import textwrap
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

# The stability toolkit's per-group clip factors: a group's threshold is grad_clip x its factor.
DEFAULT_CLIP_FACTORS = {"router": 0.5, "shared_expert": 2.0, "experts": 3.0,
                        "policy_head": 1.0, "value_head": 1.0, "q_head": 1.0, "other": 1.0}


def setting(default: Any, doc: str):
    """A field with its default (a fresh copy of a mutable one per instance) and its doc."""
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata={"doc": doc})
    return dataclasses.field(default=default, metadata={"doc": doc})


def defaults(section) -> Dict[str, Any]:
    """{field: default} of a section's dataclass: what its validator merges a user's keys into."""
    return dataclasses.asdict(section())


class Section:
    """A section's settings once validated (its validator returns one): frozen and read as
    attributes (`s.top_k`), nowhere by string key (tests/test_settings_reads.py). A typed section
    passes through its validator without being checked again."""

    def __getitem__(self, key: str) -> Any:
        raise TypeError(f"{type(self).__name__} is read as attributes: .{key}, not [{key!r}]")

    def to_dict(self) -> Dict[str, Any]:
        """A plain (deep) copy: what config.yaml and the checkpoint manifest hold."""
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "Section":
        return dataclasses.replace(self, **changes)


def plain(section) -> Dict[str, Any]:
    """A section as a plain mapping (a builder's or a YAML file's dict, or a typed section)."""
    return section.to_dict() if isinstance(section, Section) else dict(section or {})


def builder_doc(summary: str, section) -> str:
    """A builder's docstring: the summary, then every field with its default and doc."""
    lines = [summary, "", "Args:"]
    for f in dataclasses.fields(section):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        lines += textwrap.wrap(f"{f.name}: {f.metadata['doc']} Default: {default!r}.", 100,
                               initial_indent="    ", subsequent_indent="        ")
    return "\n".join(lines)


@dataclass(frozen=True)
class MoESettings(Section):
    """The MoE policy."""

    num_experts: int = setting(8, "N experts per MoE layer.")
    top_k: int = setting(2, "experts per token.")
    mixture: str = setting(
        'sparse',
        "sparse | soft | dense: what each MoE block is. sparse: each token to its router's top-k "
        "experts; soft: Soft MoE (every token softly dispatched to every expert's slots and softly "
        "combined back, moe_rl.core.soft_moe); dense: one feed-forward layer of the sparse block's "
        "active width (top_k x d_ff), the peer of equal active parameters in the same loop.")
    router: str = setting('topk', "mixture sparse: topk | sinkhorn | bias | task | reinforce.")
    slots_per_expert: int = setting(1, "mixture soft: slots each expert processes per observation (p).")
    soft_normalize: bool = setting(
        True,
        "mixture soft: the paper's l2 normalisation of tokens and slot parameters, times a learned scale "
        "(Puigcerver et al. 2023, section 2.3); false: raw logits X Phi, as google/dopamine's labs/moes "
        "(Obando-Ceron et al.'s code) runs it.")
    tokens: str = setting(
        'auto',
        "auto | one | positions: the tokens the MoE blocks see. positions: an image's conv feature map, "
        "one token per position, pooled after the blocks (token_pool); one: the observation's features as one "
        "token. auto: positions for an image observation under mixture soft, else one.")
    token_pool: str = setting(
        'flatten',
        "flatten | mean: how the trunk makes one feature vector of the tokens after the blocks. flatten: "
        "their concatenation (positions x d_model wide, what Obando-Ceron et al.'s code feeds its Q "
        "head); mean: their average (d_model wide). The tokens carry no position embedding and a Soft "
        "MoE mixes them by content alone, so after mean the heads cannot tell where anything is: the "
        "policy is the same for any shuffle of the positions. The same with one token.")
    num_layers: int = setting(2, "MoE blocks in the policy trunk.")
    d_model: int = setting(64, "trunk width.")
    d_ff: int = setting(64, "expert hidden width.")
    activation: str = setting('tanh', "expert activation (moe_rl.core.experts.ACTIVATIONS).")
    temperature: float = setting(1.0, "router softmax temperature.")
    router_init: str = setting('normal', "router weight init (moe_rl.core.routers.ROUTER_INITS).")
    router_init_std: Optional[float] = setting(None, "its std; None: 0.02 / sqrt(N).")
    router_kwargs: Dict[str, Any] = setting(
        {},
        "router-specific options, checked against the router's constructor (sinkhorn_epsilon, "
        "bias_update_rate, num_tasks, ...).")
    shared_expert: bool = setting(False, "a dense expert every token also passes through.")
    expert_dropout: float = setting(0.0, "in training, drop each of a token's experts with this probability.")
    capacity_factor: Optional[float] = setting(None, "None: dropless; else tokens beyond the capacity are dropped.")
    dispatch: str = setting('auto', "auto | dense | gathered | grouped | sorted: how tokens reach the experts.")
    aux_loss_coef: float = setting(0.01, "Switch load-balancing loss weight (the ceiling under balance \"adaptive\").")
    balance: str = setting(
        'fixed',
        "fixed | adaptive: adaptive applies the balance loss only while the load's CV is above the "
        "healthy band, rising to aux_loss_coef and fading once it is back (moe_rl.core.balance).")
    z_loss_coef: float = setting(0.001, "ST-MoE router z-loss weight.")
    reinforce_loss_coef: float = setting(1.0, "router \"reinforce\": weight of its policy-gradient loss.")
    activation_checkpointing: bool = setting(False, "recompute MoE blocks in backward (memory for compute).")
    policy_head: str = setting('linear', "linear | dual (parallel linear and MLP branches).")
    inference_dtype: str = setting('fp32', "fp32 | bf16: numeric setup of the rollout (inference) copy.")
    rollout_compile: bool = setting(
        False,
        "the rollout copy's forward through torch.compile (vector and image trunks, routers that do "
        "not sample): about 1.3-2x faster a call after a compile of 7-35 s at the first sample; off "
        "by default (BENCHMARKS.md, time to target).")
    ep_size: int = setting(1, "expert-parallel degree of the DeepSpeed learner group.")
    routing_replay: Union[bool, str] = setting(
        'auto',
        "R3, the learner replays the rollout's recorded top-k. true: all of it; mismatched: only "
        "where the trainer, at the rollout's weights, would route a token otherwise (a bf16 flip), "
        "fixed for the update, the rest following the router as it learns; auto: true where the "
        "routing is not a function of the observation alone (reinforce; capacity, except on the token "
        "trunk with an fp32 copy: its capacity groups are sequences), mismatched under a bf16 copy, "
        "else off.")
    replay_anchor_coef: float = setting(
        0.01,
        "under routing replay, weight of -log(router mass on the replayed experts), which keeps the "
        "router's own choice on the experts PPO trains (moe_rl.core.losses.replay_anchor_loss).")
    normalize_gates: Union[bool, str] = setting(
        'auto',
        "combine weights of the chosen experts: their softmax renormalised over the k (true) or each "
        "one's own router probability (false). auto: false exactly under full routing replay, where "
        "it lets R3 learn as fast as no replay.")
    trainer_capacity_factor: Optional[float] = setting(
        None,
        "DeepSpeed learner only: drop beyond this capacity (None: dropless).")
    trainer_second_expert_sampling: bool = setting(False, "DeepSpeed learner only: Gumbel-sample the 2nd expert.")
    trainer_random_token_selection: bool = setting(False, "DeepSpeed learner only: random survivors at capacity.")
    vf_hiddens: List[int] = setting([64, 64], "value network widths (kept outside the MoE).")
    q_hiddens: List[int] = setting(
        [256],
        "Q-networks (algo dqn): hidden widths of the advantage and value heads on the MoE trunk "
        "(RLlib's tuned CartPole DQN: [256]).")
    task_slice: Optional[List[int]] = setting(
        None,
        "[start, num_tasks]: a one-hot task id inside vector observations, or inside a Dict "
        "observation's \"task\" entry (router \"task\").")
    encoder: str = setting(
        'auto',
        "auto | flat | conv: what reads the observation before the MoE blocks; auto: a small CNN for "
        "image observations ((H, W, C), or a Dict with \"image\"), else the raw vector "
        "(moe_rl.core.encoders).")
    max_seq_len: int = setting(
        64,
        "token-sequence policies: context length of the transformer; under positions \"relative\", "
        "the longest distance with an attention bias of its own.")
    positions: str = setting(
        'learned',
        "token-sequence policies: learned (absolute position embeddings, sequences up to max_seq_len) "
        "| relative (a learned attention bias per distance; any length).")
    num_heads: int = setting(4, "token-sequence policies: attention heads.")


@dataclass(frozen=True)
class DeepSpeedSettings(Section):
    """The DeepSpeed expert-parallel learner group."""

    enabled: Optional[bool] = setting(None, "None: on when moe.ep_size > 1 or a DeepSpeed config is given.")
    config: Union[Dict[str, Any], str] = setting(
        {},
        "DeepSpeed config dict (or a JSON file path), passed to deepspeed.initialize.")
    num_threads: int = setting(1, "torch intra-op threads per learner process.")
    placement_strategy: str = setting(
        'PACK',
        "the learners' placement group: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD.")


@dataclass(frozen=True)
class WeightSyncSettings(Section):
    """How the learners' weights reach the rollout actors."""

    transport: str = setting(
        'object_store',
        "object_store (each rollout actor pulls every learner's published part) or collective (each "
        "publishing learner broadcasts its part to the rollout actors in a Ray collective group; "
        "needs DeepSpeed learners and remote env runners).")
    backend: str = setting('gloo', "collective: gloo (CPU buffers) or nccl (every member holds a GPU).")
    bucket_mb: float = setting(32.0, "collective: bucket size; one bucket per source is in flight.")
    timeout_s: float = setting(
        60.0,
        "collective: a member that does not answer in time fails the sync over to the object store; "
        "the groups are formed afresh at the next sync.")


@dataclass(frozen=True)
class StabilitySettings(Section):
    """The stability toolkit."""

    lr_schedules: Dict[str, Dict[str, Any]] = setting(
        {},
        "parameter group (or \"default\": every other group) -> schedule spec, run by torch's "
        "schedulers (moe_rl.core.lr_schedules.torch_scheduler); a named group follows its schedule "
        "alone, groups without one follow training.lr.")
    grad_clip: Optional[float] = setting(None, "base max-norm (None: off); a group's threshold is base x its factor.")
    grad_clip_factors: Dict[str, float] = setting(
        dict(DEFAULT_CLIP_FACTORS),
        "parameter group -> clip factor (router 0.5, experts 3.0, ...).")
    skip_nonfinite: bool = setting(True, "a non-finite gradient on any learner skips the step on all.")
    winsorize_p: Optional[float] = setting(None, "clamp each gradient to its (1-p) quantile of |g| (None: off).")
    projection_rank: Optional[int] = setting(
        None,
        "project 2-D gradients (each expert matrix) on their top-r right singular vectors (None: "
        "off).")
    projection_groups: List[str] = setting(['experts'], "parameter groups whose gradients are projected.")
    projection_refresh: int = setting(0, "re-derive the basis every N applied steps (0: keep the first).")
    router_warmup_steps: int = setting(0, "the first N applied steps update only router parameters.")
    expert_dropout_schedule: Optional[Dict[str, float]] = setting(
        None,
        "{\"start\": 0.05, \"end\": 0.2, \"steps\": T}: linear in steps.")
    optimizer: str = setting('adam', "adam | adamw | lamb.")
    weight_decay: float = setting(0.0, "decoupled weight decay (adamw, lamb).")
    betas: List[float] = setting([0.9, 0.999], "Adam / LAMB betas.")
    lamb_clamp: float = setting(10.0, "LAMB: upper bound of the weight norm in the trust ratio.")
    anomaly_detection: bool = setting(True, "rolling-window checks over the iteration metrics.")
    anomaly_window: int = setting(100, "iterations of history the detector keeps.")
    anomaly_z: float = setting(6.0, "robust z-score (median / MAD) for spikes and drops.")
    anomaly_min_history: int = setting(10, "iterations before spikes and drops are judged.")
    entropy_band: List[float] = setting([0.3, 1.0], "normalised router entropy outside it is a breach.")
    grad_norm_band: List[float] = setting(
        [0.0, 10.0],
        "pre-clip gradient norm outside it x the run's median is a breach.")
    health_warmup: int = setting(3, "iterations before health-band breaches are judged.")
    flip_rate_max: float = setting(0.5, "probe-set routing flip rate above it is routing oscillation.")
    rss_growth_mb: float = setting(512.0, "an actor's RSS growing more than this over the window is an alert.")


@dataclass(frozen=True)
class CorrectionSettings(Section):
    """The rollout correction (moe_rl.core.correction): importance weights and rejection for
    training-inference mismatch. A preset fills the keys a user leaves out."""

    preset: str = setting('off', "off | token_is | seq_is | token_is_rs | geo_rs | geo_rs_veto | token_is_veto | "
                                 "routing_rs | bypass_rs.")
    mode: str = setting('decoupled', "decoupled | bypass.")
    is_level: Optional[str] = setting(None, "token | sequence | null: importance weights.")
    is_threshold: float = setting(2.0, "truncation C of the IS weights.")
    is_batch_normalize: bool = setting(False, "rescale the kept IS weights to mean 1.")
    rs_level: Optional[str] = setting(None, "token | sequence | geometric | null: rejection.")
    rs_threshold: float = setting(2.0, "upper bound U of the kept ratio.")
    rs_threshold_lower: Optional[float] = setting(None, "lower bound L (null: 1 / U).")
    veto_threshold: Optional[float] = setting(
        None, "a token ratio below it rejects its whole sequence (e.g. 1e-4).")
    routing_rs: str = setting('off', "off | any | share: reject by routing disagreement.")
    routing_rs_share: float = setting(0.5, "share: reject when more than this share of layers disagree.")
    routing_rs_sequence: bool = setting(False, "reject the whole sequence of a disagreeing token.")


@dataclass(frozen=True)
class ConsistencySettings(Section):
    """Drift checks and the sync gate."""

    enabled: bool = setting(True, "run the consistency checks (and the gate) at all.")
    every: int = setting(1, "check before every K-th weight sync (every iteration while holding).")
    policy: str = setting('warn', "what a bad update does: warn | hold | rollback.")
    thresholds: Dict[str, float] = setting(
        {},
        "absolute limits: k3, max_abs_logp_diff, routing_agreement, greedy_agreement, q_gap_max_rel, "
        "combine_tv_max (mismatch); update_size, k3_old_new, q_change, probe_flip_rate (absolute caps, "
        "off by default).")
    relative_z: float = setting(8.0, "a bad update is a value > median + z * scale of the run's accepted values.")
    relative_warmup: int = setting(5, "checks before the relative limits apply.")
    relative_window: int = setting(50, "accepted values kept per signal.")
    flip_margin: float = setting(0.05, "probe flips count only where the old top-k margin (logits) exceeds it.")
    max_holds: int = setting(3, "consecutive holds before escalating to rollback.")
    max_rollbacks: int = setting(3, "consecutive rollbacks before the run stops (resumable).")
    rollback_lr_scale: float = setting(0.5, "the retry after a rollback runs at this LR scale (compounding).")
    sample_size: int = setting(512, "rollout steps per check given to the trainer-side forward.")
    probe_size: int = setting(256, "fixed probe observations kept for the whole run.")
    param_sample: float = setting(
        1.0,
        "share of tensors digested per check (1/K): a rotating share, so every tensor of every "
        "rollout copy and learner replica is compared bit for bit at least every K checks; 1: all of "
        "them at every check.")
    position_bins: List[int] = setting(
        [8, 16, 32, 64, 128, 256, 512, 1024],
        "sequence-position bins of K3 by position.")
    correction: Dict[str, Any] = setting(
        {},
        "rollout correction: IS / RS / veto / routing RS, with presets (moe_rl.core.correction).")
