"""MoEPolicyModule: RLlib TorchRLModule whose policy trunk is an MoE network.

- Vector and image observations -> MoEMLPTrunk (a CNN encoder for images: moe.encoder);
  {"tokens", "position"} observations -> MoETransformerTrunk.
- The value function is a separate MLP on the raw observation (behind a CNN of its own for images):
  value passes never route tokens, and the inference copy on the EnvRunners drops it (InferenceOnlyAPI).
- The inference copy's numeric setup follows `moe.inference_dtype` (fp32 | bf16): a real source of
  training-inference drift that the consistency checks must be able to see.
- Every forward also returns MOE_TOPK [B, L, k] (small ints; a capacity-dropped assignment e is
  stored as -(e + 1)): the EnvRunners store it per step as an extra model output, so the learner
  can compute routing agreement and replay the routing.
- Exploring rollouts (forward_exploration) let a sampling router (`reinforce`) draw its experts;
  evaluation (forward_inference) routes greedily. Routing replay is on by default exactly where
  the routing is not a function of the token alone (a sampling router, a capacity limit), so the
  learner computes the policy the rollouts ran.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional

import gymnasium as gym
import numpy as np
import torch
import tree
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.apis import InferenceOnlyAPI, ValueFunctionAPI
from ray.rllib.core.rl_module.torch import TorchRLModule
from torch import nn

from moe_rl.core.drift_kinds import PolicyKind
from moe_rl.core.encoders import ObservationEncoder, uses_position_tokens
from moe_rl.core.errors import ConfigError
from moe_rl.core.param_groups import trained_modules
from moe_rl.core.plasticity import trunk_dormancy
from moe_rl.core.policy import MoEMLPTrunk, MoETransformerTrunk, mlp, policy_head
from moe_rl.core.routers import Router
from moe_rl.core.sections import MoESettings
from moe_rl.core.settings import MOE_DEFAULTS, resolve_gate_normalization, validate_moe
from moe_rl.core.stability import expert_dropout_off

MOE_TOPK = "moe_topk"          # [B, L, k] top-k experts per MoE layer, recorded at rollout time (sparse)
MOE_COMBINE = "moe_combine"    # [B, L, N] each expert's share of the output per Soft MoE layer, recorded
                               # at rollout time (mixture soft)
MOE_Q = "moe_q"                # [B, A] a Q-policy's Q-values, recorded at rollout time (the check's)
MOE_ROUTING = "moe_routing"    # list of RoutingRecord (train forward only; stays on the learner)
MOE_REPLAY = "moe_replay"      # [B, L, k] what training replays (routing_replay "mismatched": OWN_CHOICE
                               # rows leave the token to the router); absent: MOE_TOPK, all of it
TOKEN_OBS_KEYS = {"tokens", "position"}


def topk_dtype(num_experts: int) -> torch.dtype:
    """Smallest int type that holds an encoded expert index (-N..N-1): routing records can dominate
    host memory."""
    return torch.int8 if num_experts <= 128 else (torch.int16 if num_experts <= 32768 else torch.int32)


def replay_mode(s: Dict[str, Any], token_policy: bool = False) -> Optional[str]:
    """moe.routing_replay resolved: "full" (R3), "mismatched" (only the tokens the trainer, at the
    rollout's weights, routes otherwise: moe_rl.rllib.replay) or None. "auto": full where the
    rollout's routing is not a function of the observation alone (a sampling router, a capacity
    limit over the batch: the vector trunk's; the token trunk's capacity groups are its sequences),
    mismatched where the rollout copy computes in another dtype (bf16 flips near-ties; full when
    there is also a capacity limit: only a full replay carries the rollout's drops), none for an
    exact fp32 copy."""
    mode = s.routing_replay
    if mode == "auto":
        exact = s.inference_dtype == "fp32"
        if s.router == "reinforce" or (s.capacity_factor is not None and not (token_policy and exact)):
            return "full"
        return None if exact else "mismatched"
    if mode == "mismatched":
        return mode
    return "full" if mode else None


class MoEModule(TorchRLModule):
    """What every moe-rl RLModule shares: the checked MoE settings, the MoE trunk for vector and
    image observations, the rollout copy's numeric setup, and what a forward records of its
    routing. The policy module (below) and the Q-module (moe_rl.rllib.q_module) add their heads."""

    @property
    def moe_settings(self) -> MoESettings:
        # Typed when the module comes from a validated config (checked there); a plain mapping (a
        # module built from a spec by hand) is checked here, once: the learner reads them at every
        # minibatch.
        if "_moe_settings" not in self.__dict__:
            given = self.model_config.get("moe", {})
            self.__dict__["_moe_settings"] = validate_moe(given if isinstance(given, MoESettings)
                                                          else {**MOE_DEFAULTS, **given})
        return self.__dict__["_moe_settings"]

    def mlp_trunk(self, s: MoESettings) -> MoEMLPTrunk:
        """The trunk for vector and image observations (moe.encoder, moe.tokens)."""
        tokens = uses_position_tokens(s.tokens, s.mixture, self.observation_space)
        return MoEMLPTrunk(ObservationEncoder(self.observation_space, s.encoder, s.task_slice, tokens), s)

    def set_inference_dtype(self, *parts: nn.Module) -> None:
        """The rollout copy's numeric setup (moe.inference_dtype): a bf16 copy is a real source of
        training-inference drift that the consistency check must be able to see."""
        s = self.moe_settings
        self.topk_dtype = topk_dtype(s.num_experts)
        self.compute_dtype = torch.float32
        if self.inference_only and s.inference_dtype == "bf16":
            self.compute_dtype = torch.bfloat16
            for part in parts:
                part.to(torch.bfloat16)
        if self.inference_only:
            self.eval()   # a rollout copy never trains; RLlib's per-forward eval() is then a no-op

    def train(self, mode: bool = True):
        # RLlib calls eval()/train() around every forward pass; nn.Module's recursive walk over the
        # ~25 submodules cost a fifth of a one-observation rollout step. Walk only on a change.
        if all(m.training == mode for m in self._mode_modules()):
            return self
        return super().train(mode)

    def _mode_modules(self) -> List[nn.Module]:
        # The module tree is fixed once setup() has run; a plain attribute (not a registered one).
        if "_all_modules" not in self.__dict__:
            self.__dict__["_all_modules"] = list(self.modules())
        return self.__dict__["_all_modules"]

    def _trunk_input(self, obs):
        if getattr(self, "is_token_policy", False):
            return obs
        if isinstance(obs, dict):   # an image with its task vector (uint8 grids become floats here)
            return {k: v.to(self.compute_dtype) for k, v in obs.items()}
        if torch.is_floating_point(obs):
            # A NaN/Inf observation must not crash the rollout actor (NaN action probabilities);
            # it acts on zeros here and its episode is dropped before learning (moe_rl.core.sample_filter).
            obs = torch.nan_to_num(obs, nan=0.0, posinf=0.0, neginf=0.0)
        return obs.to(self.compute_dtype)

    def routing_outputs(self, records) -> Dict[str, torch.Tensor]:
        """What a forward records of its routing, by mixture: the encoded top-k [B, L, k] (sparse,
        MOE_TOPK), each expert's combine share [B, L, N] (soft, MOE_COMBINE), nothing (dense)."""
        if not records:
            return {}
        if getattr(records[0], "soft", False):
            return {MOE_COMBINE: torch.stack([r.encoded() for r in records], 1).float()}
        return {MOE_TOPK: torch.stack([r.encoded_top_k() for r in records], 1).to(self.topk_dtype)}


class MoEPolicyModule(MoEModule, ValueFunctionAPI, InferenceOnlyAPI):
    PARAM_ROLES = {"pi": "policy_head", "log_std": "policy_head", "vf": "value_head", "vf_encoder": "value_head"}

    def setup(self):
        s = self.moe_settings
        obs_space = self.observation_space
        self.is_token_policy = isinstance(obs_space, gym.spaces.Dict) and TOKEN_OBS_KEYS <= set(obs_space.spaces)
        # Training forwards replay in either mode (the trainer's view at the rollout's weights too:
        # there a partial replay is a full one).
        self.replay_mode = replay_mode(s, self.is_token_policy)
        s = dataclasses.replace(s, normalize_gates=resolve_gate_normalization(s, self.replay_mode == "full"))
        if self.is_token_policy:
            if s.mixture != "sparse":
                raise ConfigError(f"moe.mixture: sparse for token-sequence observations (the causal transformer's "
                                  f"feed-forward layers route one position each; a {s.mixture} mixture over a "
                                  f"sequence would let a position read later ones), got {s.mixture!r}")
            vocab = int(obs_space["tokens"].high.max()) + 1
            length = int(obs_space["tokens"].shape[0])
            if s.positions == "learned" and length > s.max_seq_len:
                raise ConfigError(f"moe.max_seq_len: must be >= the observation's {length} tokens under "
                                  f"moe.positions 'learned' (or set moe.positions: relative), got {s.max_seq_len}")
            self.trunk = MoETransformerTrunk(vocab, s)
            vf_in = int(np.prod(obs_space["tokens"].shape)) + 1
        else:
            self.trunk = self.mlp_trunk(s)
            vf_in = self.trunk.encoder.out_dim * self.trunk.encoder.num_tokens
            if self.trunk.encoder.cnn is not None and not self.inference_only:
                # The value function shares nothing with the policy: an encoder of its own (value
                # passes never route tokens, and the rollout copy drops both).
                self.vf_encoder = ObservationEncoder(obs_space, "conv")
                vf_in = self.vf_encoder.out_dim
        if isinstance(self.action_space, gym.spaces.Discrete):
            self.pi = policy_head(s.policy_head, self.trunk.out_dim, int(self.action_space.n))
            self.log_std = None
        else:
            act_dim = int(np.prod(self.action_space.shape))
            self.pi = policy_head(s.policy_head, self.trunk.out_dim, act_dim)
            self.log_std = nn.Parameter(torch.zeros(act_dim))
        if not self.inference_only:
            self.vf = mlp([vf_in, *s.vf_hiddens], 1)
        self.set_inference_dtype(self.trunk, self.pi)

    @property
    def replay_routing(self) -> bool:
        return self.replay_mode is not None

    # --- InferenceOnlyAPI -------------------------------------------------------------------------
    def get_non_inference_attributes(self) -> List[str]:
        return ["vf", "vf_encoder"] if hasattr(self, "vf_encoder") else ["vf"]

    # --- forward passes ---------------------------------------------------------------------------
    def _policy(self, batch: Dict[str, Any], replay=None, explore: bool = False, trunk=None, pi=None):
        """(action-dist inputs, routing records) of the policy path; trunk / pi: another copy of it
        (APPO's target policy) in place of the trained one."""
        trunk, pi = self.trunk if trunk is None else trunk, self.pi if pi is None else pi
        features, records = trunk(self._trunk_input(batch[Columns.OBS]), replay, explore)
        logits = pi(features).float()
        if self.log_std is not None:
            logits = torch.cat([logits, self.log_std.float().expand_as(logits)], -1)
        return logits, records

    def _training_replay(self, batch: Dict[str, Any]):
        """What a training forward replays: the rollout's top-k (or the mismatched-only marks)."""
        return batch.get(MOE_REPLAY, batch.get(MOE_TOPK)) if self.replay_routing else None

    def _forward(self, batch: Dict[str, Any], explore: bool = False, **kwargs) -> Dict[str, Any]:
        obs = batch[Columns.OBS]
        compiled = self._compiled_rollout()
        logits, routing = compiled(obs) if compiled is not None else self._rollout_outputs(obs, explore)
        return {Columns.ACTION_DIST_INPUTS: logits, **routing}

    def _rollout_outputs(self, obs, explore: bool = False):
        """obs -> (logits, routing): what a rollout records per step (routing_outputs)."""
        logits, records = self._policy({Columns.OBS: obs}, explore=explore)
        return logits, self.routing_outputs(records)

    def _compiled_rollout(self):
        """_rollout_outputs through torch.compile for a rollout copy under moe.rollout_compile, else
        None; decided and built once (at the first forward), kept out of the module's state, so
        weights synced in place reuse it. Not for a sampling router (its draws stay on eager's
        random stream) nor the token trunk (its prefix length is data: graph breaks made it slower,
        0.90x, bench/bench_rollout_compile.py); for every other router `explore` changes nothing,
        so one compiled step serves exploration and evaluation alike."""
        if "_compiled_step" not in self.__dict__:
            s = self.moe_settings
            wanted = (self.inference_only and s.rollout_compile and s.router != "reinforce"
                      and not self.is_token_policy)
            self.__dict__["_compiled_step"] = torch.compile(self._rollout_outputs) if wanted else None
        return self.__dict__["_compiled_step"]

    def _forward_exploration(self, batch: Dict[str, Any], **kwargs) -> Dict[str, Any]:
        return self._forward(batch, explore=True)

    def _forward_train(self, batch: Dict[str, Any], **kwargs) -> Dict[str, Any]:
        logits, records = self._policy(batch, self._training_replay(batch))
        return {Columns.ACTION_DIST_INPUTS: logits, MOE_ROUTING: records, **self.routing_outputs(records)}

    # --- the consistency check -------------------------------------------------------------------
    @property
    def policy_kind(self) -> PolicyKind:
        """What the check compares for this module (moe_rl.core.drift_kinds)."""
        return PolicyKind("categorical", ROUTING_KIND[self.moe_settings.mixture],
                          isinstance(self.action_space, gym.spaces.Discrete))

    def check_view(self, d: Mapping[str, Any], replay: Optional[bool] = None) -> Dict[str, np.ndarray]:
        """The training path's forward on rollout data, without gradient or expert dropout:
        d {"obs", optional "actions", optional "routing"} (numpy) -> action-dist inputs (`logits`),
        the log-probs of the given actions (`logp`), the routing (`routing`: top-k or combine
        shares per layer) and, for a sparse layer, its greedy top-k margin (`margin`). replay None:
        as this module trains (its own routing_replay); False: the router's own choice."""
        batch = {Columns.OBS: tree.map_structure(copied_tensor, d["obs"])}
        if (self.replay_routing if replay is None else replay) and d.get("routing") is not None:
            batch[MOE_TOPK] = copied_tensor(d["routing"])
        with torch.no_grad(), expert_dropout_off(self):   # dropout is a training perturbation
            logits, records = self._policy(batch, self._training_replay(batch))
            view = {"logits": logits.float().numpy(), **routing_view(self.trunk, records)}
            if d.get("actions") is not None:
                dist = self.get_train_action_dist_cls().from_logits(logits)
                view["logp"] = dist.logp(copied_tensor(d["actions"])).double().numpy()
        return view

    # --- ValueFunctionAPI -------------------------------------------------------------------------
    def compute_values(self, batch: Dict[str, Any], embeddings=None):
        obs = batch[Columns.OBS]
        if self.is_token_policy:
            obs = torch.cat([obs["tokens"].float(), obs["position"].float().reshape(-1, 1)], -1)
        elif hasattr(self, "vf_encoder"):
            obs, _ = self.vf_encoder(tree.map_structure(lambda x: x.float(), obs))
        return self.vf(obs.float().reshape(obs.shape[0], -1)).squeeze(-1)


ROUTING_KIND = {"sparse": "sparse", "soft": "soft", "dense": "none"}   # mixture -> what the check compares


def copied_tensor(x) -> torch.Tensor:
    """A tensor of its own: numpy arrays from Ray's object store are read-only, and torch warns
    about sharing their memory."""
    return torch.from_numpy(np.array(x))


def routing_view(trunk, records) -> Dict[str, np.ndarray]:
    """A check's routing figures of a forward: sparse, the encoded top-k [T, L, k] and each layer's
    greedy top-k margin [T, L]; soft, each expert's combine share [T, L, N]; dense, none."""
    if not records:
        return {}
    if getattr(records[0], "soft", False):
        return {"routing": torch.stack([r.encoded() for r in records], 1).float().numpy()}
    routers = [m for m in trained_modules(trunk) if isinstance(m, Router)]
    return {"routing": torch.stack([r.encoded_top_k() for r in records], 1).numpy().astype(np.int16),
            "margin": torch.stack([r.top_k_margin(rec.router_logits) for r, rec in zip(routers, records)], 1).numpy()}


DORMANT_ROWS = 1024   # the dormant-unit probe's rows: one extra forward of at most this many per update


def module_dormancy(module, obs) -> Dict[str, float]:
    """moe/dormant, moe/layer{i}/dormant and .../dormant/e{j}: the tau-dormant share of the policy
    trunk's feed-forward units (moe_rl.core.plasticity) on at most DORMANT_ROWS observations."""
    obs = tree.map_structure(lambda x: x[:DORMANT_ROWS], obs)
    figures = trunk_dormancy(module.trunk, lambda: module.forward_inference({Columns.OBS: obs}))
    return {f"moe/{k}": v for k, v in figures.items()}
