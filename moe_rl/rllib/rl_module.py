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
from typing import Any, Dict, List, Optional

import gymnasium as gym
import numpy as np
import torch
import tree
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.apis import InferenceOnlyAPI, ValueFunctionAPI
from ray.rllib.core.rl_module.torch import TorchRLModule
from torch import nn

from moe_rl.core.encoders import ObservationEncoder
from moe_rl.core.errors import ConfigError
from moe_rl.core.plasticity import trunk_dormancy
from moe_rl.core.policy import MoEMLPTrunk, MoETransformerTrunk, mlp, policy_head
from moe_rl.core.sections import MoESettings
from moe_rl.core.settings import MOE_DEFAULTS, resolve_gate_normalization, validate_moe

MOE_TOPK = "moe_topk"          # [B, L, k] top-k experts per MoE layer, recorded at rollout time
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
    mode = s["routing_replay"]
    if mode == "auto":
        exact = s["inference_dtype"] == "fp32"
        if s["router"] == "reinforce" or (s["capacity_factor"] is not None and not (token_policy and exact)):
            return "full"
        return None if exact else "mismatched"
    if mode == "mismatched":
        return mode
    return "full" if mode else None


class MoEPolicyModule(TorchRLModule, ValueFunctionAPI, InferenceOnlyAPI):
    @property
    def moe_settings(self) -> Dict[str, Any]:
        # Typed when the module comes from a validated config (checked there); a plain mapping (a
        # module built from a spec by hand) is checked here, once: the learner reads them at every
        # minibatch.
        if "_moe_settings" not in self.__dict__:
            given = self.model_config.get("moe", {})
            self.__dict__["_moe_settings"] = validate_moe(given if isinstance(given, MoESettings)
                                                          else {**MOE_DEFAULTS, **given})
        return self.__dict__["_moe_settings"]

    def setup(self):
        s = self.moe_settings
        obs_space = self.observation_space
        self.is_token_policy = isinstance(obs_space, gym.spaces.Dict) and TOKEN_OBS_KEYS <= set(obs_space.spaces)
        # Training forwards replay in either mode (the trainer's view at the rollout's weights too:
        # there a partial replay is a full one).
        self.replay_mode = replay_mode(s, self.is_token_policy)
        s = dataclasses.replace(s, normalize_gates=resolve_gate_normalization(s, self.replay_mode == "full"))
        if self.is_token_policy:
            vocab = int(obs_space["tokens"].high.max()) + 1
            length = int(obs_space["tokens"].shape[0])
            if s["positions"] == "learned" and length > s["max_seq_len"]:
                raise ConfigError(f"moe.max_seq_len: must be >= the observation's {length} tokens under "
                                  f"moe.positions 'learned' (or set moe.positions: relative), got {s['max_seq_len']}")
            self.trunk = MoETransformerTrunk(vocab, s)
            vf_in = int(np.prod(obs_space["tokens"].shape)) + 1
        else:
            self.trunk = MoEMLPTrunk(ObservationEncoder(obs_space, s["encoder"], s["task_slice"]), s)
            vf_in = self.trunk.encoder.out_dim
            if self.trunk.encoder.cnn is not None and not self.inference_only:
                # The value function shares nothing with the policy: an encoder of its own (value
                # passes never route tokens, and the rollout copy drops both).
                self.vf_encoder = ObservationEncoder(obs_space, "conv")
        if isinstance(self.action_space, gym.spaces.Discrete):
            self.pi = policy_head(s["policy_head"], s["d_model"], int(self.action_space.n))
            self.log_std = None
        else:
            act_dim = int(np.prod(self.action_space.shape))
            self.pi = policy_head(s["policy_head"], s["d_model"], act_dim)
            self.log_std = nn.Parameter(torch.zeros(act_dim))
        if not self.inference_only:
            self.vf = mlp([vf_in, *s["vf_hiddens"]], 1)
        self.topk_dtype = topk_dtype(s["num_experts"])
        self.compute_dtype = torch.float32
        if self.inference_only and s["inference_dtype"] == "bf16":
            self.compute_dtype = torch.bfloat16
            self.trunk.to(torch.bfloat16)
            self.pi.to(torch.bfloat16)
        if self.inference_only:
            self.eval()   # a rollout copy never trains; RLlib's per-forward eval() is then a no-op

    @property
    def replay_routing(self) -> bool:
        return self.replay_mode is not None

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

    # --- InferenceOnlyAPI -------------------------------------------------------------------------
    def get_non_inference_attributes(self) -> List[str]:
        return ["vf", "vf_encoder"] if hasattr(self, "vf_encoder") else ["vf"]

    # --- forward passes ---------------------------------------------------------------------------
    def _trunk_input(self, obs):
        if self.is_token_policy:
            return obs
        if isinstance(obs, dict):   # an image with its task vector (uint8 grids become floats here)
            return {k: v.to(self.compute_dtype) for k, v in obs.items()}
        return obs.to(self.compute_dtype)

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
        if torch.is_tensor(obs) and torch.is_floating_point(obs):
            # A NaN/Inf observation must not crash the rollout actor (NaN action probabilities);
            # it acts on zeros here and its episode is dropped before learning (moe_rl.core.sample_filter).
            obs = torch.nan_to_num(obs, nan=0.0, posinf=0.0, neginf=0.0)
        compiled = self._compiled_rollout()
        logits, topk = compiled(obs) if compiled is not None else self._rollout_outputs(obs, explore)
        return {Columns.ACTION_DIST_INPUTS: logits, MOE_TOPK: topk}

    def _rollout_outputs(self, obs, explore: bool = False):
        """obs -> (logits, encoded top-k [B, L, k]): what a rollout records per step."""
        logits, records = self._policy({Columns.OBS: obs}, explore=explore)
        return logits, torch.stack([r.encoded_top_k() for r in records], 1).to(self.topk_dtype)

    def _compiled_rollout(self):
        """_rollout_outputs through torch.compile for a rollout copy under moe.rollout_compile, else
        None; decided and built once (at the first forward), kept out of the module's state, so
        weights synced in place reuse it. Not for a sampling router (its draws stay on eager's
        random stream) nor the token trunk (its prefix length is data: graph breaks made it slower,
        0.90x, bench/bench_rollout_compile.py); for every other router `explore` changes nothing,
        so one compiled step serves exploration and evaluation alike."""
        if "_compiled_step" not in self.__dict__:
            s = self.moe_settings
            wanted = (self.inference_only and s["rollout_compile"] and s["router"] != "reinforce"
                      and not self.is_token_policy)
            self.__dict__["_compiled_step"] = torch.compile(self._rollout_outputs) if wanted else None
        return self.__dict__["_compiled_step"]

    def _forward_exploration(self, batch: Dict[str, Any], **kwargs) -> Dict[str, Any]:
        return self._forward(batch, explore=True)

    def _forward_train(self, batch: Dict[str, Any], **kwargs) -> Dict[str, Any]:
        logits, records = self._policy(batch, self._training_replay(batch))
        return {Columns.ACTION_DIST_INPUTS: logits, MOE_ROUTING: records,
                MOE_TOPK: torch.stack([r.encoded_top_k() for r in records], 1)}

    # --- ValueFunctionAPI -------------------------------------------------------------------------
    def compute_values(self, batch: Dict[str, Any], embeddings=None):
        obs = batch[Columns.OBS]
        if self.is_token_policy:
            obs = torch.cat([obs["tokens"].float(), obs["position"].float().reshape(-1, 1)], -1)
        elif hasattr(self, "vf_encoder"):
            obs, _ = self.vf_encoder(tree.map_structure(lambda x: x.float(), obs))
        return self.vf(obs.float().reshape(obs.shape[0], -1)).squeeze(-1)


DORMANT_ROWS = 1024   # the dormant-unit probe's rows: one extra forward of at most this many per update


def module_dormancy(module, obs) -> Dict[str, float]:
    """moe/dormant, moe/layer{i}/dormant and .../dormant/e{j}: the tau-dormant share of the policy
    trunk's feed-forward units (moe_rl.core.plasticity) on at most DORMANT_ROWS observations."""
    obs = tree.map_structure(lambda x: x[:DORMANT_ROWS], obs)
    figures = trunk_dormancy(module, lambda: module.forward_inference({Columns.OBS: obs}))
    return {f"moe/{k}": v for k, v in figures.items()}
