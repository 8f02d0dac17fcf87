"""MoEQModule: an RLlib Q-network whose trunk is an MoE network (moe_rl.core.policy), for MoE-DQN.

It implements RLlib's QNetAPI and TargetNetworkAPI as RLlib's DefaultDQNTorchRLModule does, so
RLlib's DQN learner (double Q, dueling, n-step, prioritized replay, the target network) trains it
unchanged: the MoE trunk, then a dueling head (advantage and value streams of `moe.q_hiddens`).
The target copies sit under `_target_*` attributes (moe_rl.core.param_groups.TARGET_PREFIX): no
optimizer group, balance step, dormancy probe or rollout copy sees them. The rollout copy acts
epsilon-greedily on its Q-values and records them (MOE_Q) with its routing per step: the
consistency check compares them with the trainer's at the same weights (moe_rl.core.drift_kinds).
Distributional Q (num_atoms > 1) and noisy networks are RLlib's default module's; refused here.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

import gymnasium as gym
import numpy as np
import torch
import tree
from ray.rllib.algorithms.dqn.default_dqn_rl_module import QF_NEXT_PREDS, QF_PREDS, QF_TARGET_NEXT_PREDS
from ray.rllib.core.columns import Columns
from ray.rllib.core.rl_module.apis import InferenceOnlyAPI, QNetAPI, TargetNetworkAPI
from ray.rllib.utils.schedules.scheduler import Scheduler

from moe_rl.core.drift_kinds import PolicyKind
from moe_rl.core.errors import ConfigError
from moe_rl.core.policy import mlp
from moe_rl.core.stability import expert_dropout_off
from moe_rl.rllib.appo_module import make_target_network
from moe_rl.rllib.rl_module import MOE_Q, MOE_ROUTING, ROUTING_KIND, MoEModule, copied_tensor, routing_view

HEADS = ("trunk", "af", "vf")   # what the target network copies (vf: dueling only)


class MoEQModule(MoEModule, InferenceOnlyAPI, TargetNetworkAPI, QNetAPI):
    PARAM_ROLES = {"af": "q_head", "vf": "q_head"}
    replay_mode = None   # DQN draws from a replay buffer: no rollout routing to replay (validation refuses it)

    def setup(self):
        s = self.moe_settings
        if not isinstance(self.action_space, gym.spaces.Discrete):
            raise ConfigError(f"env: algo dqn needs a discrete action space, got {self.action_space}")
        if self.model_config.get("num_atoms", 1) > 1:
            raise ConfigError("training.num_atoms: 1 with the MoE Q-network (distributional Q is RLlib's default "
                              "module's)")
        self.uses_dueling = bool(self.model_config.get("dueling", True))
        self.uses_double_q = bool(self.model_config.get("double_q", True))
        self.epsilon_schedule = Scheduler(fixed_value_or_schedule=self.model_config.get("epsilon", 0.0),
                                          framework="torch")
        self.trunk = self.mlp_trunk(s)
        actions = int(self.action_space.n)
        self.af = mlp([self.trunk.out_dim, *s.q_hiddens], actions, activation="relu")
        self.vf = mlp([self.trunk.out_dim, *s.q_hiddens], 1, activation="relu") if self.uses_dueling else None
        self.set_inference_dtype(*(m for m in (self.trunk, self.af, self.vf) if m is not None))

    # --- QNetAPI / TargetNetworkAPI ---------------------------------------------------------------
    def _q(self, obs, trunk, af, vf):
        """obs -> (Q-values [B, A] in fp32, routing records): the trunk, then the dueling head
        (V + A - mean A) or the plain one."""
        features, records = trunk(self._trunk_input(obs))
        advantages = af(features).float()
        if vf is None:
            return advantages, records
        return vf(features).float() + advantages - advantages.mean(-1, keepdim=True), records

    def compute_q_values(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        q, records = self._q(batch[Columns.OBS], self.trunk, self.af, self.vf)
        return {QF_PREDS: q, MOE_ROUTING: records}

    def make_target_networks(self) -> None:
        for name in HEADS:
            if getattr(self, name) is not None:
                setattr(self, f"_target_{name}", make_target_network(getattr(self, name)))

    def get_target_network_pairs(self):
        return [(getattr(self, n), getattr(self, f"_target_{n}")) for n in HEADS if getattr(self, n) is not None]

    def forward_target(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        """The target network's Q-values, with no expert dropout: a fixed reference."""
        with torch.no_grad(), expert_dropout_off(self._target_trunk):
            q, _ = self._q(batch[Columns.OBS], self._target_trunk, self._target_af, getattr(self, "_target_vf", None))
        return {QF_PREDS: q}

    def get_non_inference_attributes(self) -> List[str]:
        return [f"_target_{n}" for n in HEADS]

    # --- forward passes ---------------------------------------------------------------------------
    def _acting(self, batch: Dict[str, Any]):
        q, records = self._q(batch[Columns.OBS], self.trunk, self.af, self.vf)
        return q, {MOE_Q: q, **self.routing_outputs(records)}

    def _forward_inference(self, batch: Dict[str, Any], **kwargs) -> Dict[str, Any]:
        q, recorded = self._acting(batch)
        return {Columns.ACTIONS: q.argmax(-1), **recorded}

    def _forward_exploration(self, batch: Dict[str, Any], t: Optional[int] = None, **kwargs) -> Dict[str, Any]:
        """Epsilon-greedy on the Q-values, epsilon from RLlib's schedule over sampled env steps."""
        q, recorded = self._acting(batch)
        self.epsilon_schedule.update(t or 0)
        epsilon = self.epsilon_schedule.get_current_value()
        random = torch.randint(q.shape[-1], (q.shape[0],), device=q.device)
        explore = torch.rand(q.shape[0], device=q.device) < epsilon
        return {Columns.ACTIONS: torch.where(explore, random, q.argmax(-1)), **recorded}

    def _forward_train(self, batch: Dict[str, Any], **kwargs) -> Dict[str, Any]:
        """RLlib's DQN training forward: Q of the observations (with double Q, of the next ones too,
        in the same pass) and the target network's Q of the next observations. The routing records
        cover the observations of that pass (the MoE losses and health read them)."""
        obs = batch[Columns.OBS]
        if self.uses_double_q:
            both = tree.map_structure(lambda a, b: torch.cat([a, b], 0), obs, batch[Columns.NEXT_OBS])
            q, records = self._q(both, self.trunk, self.af, self.vf)
            out = dict(zip((QF_PREDS, QF_NEXT_PREDS), torch.chunk(q, 2, 0)))
        else:
            q, records = self._q(obs, self.trunk, self.af, self.vf)
            out = {QF_PREDS: q}
        out[QF_TARGET_NEXT_PREDS] = self.forward_target({Columns.OBS: batch[Columns.NEXT_OBS]})[QF_PREDS]
        out[MOE_ROUTING] = records
        return out

    # --- the consistency check -------------------------------------------------------------------
    @property
    def policy_kind(self) -> PolicyKind:
        return PolicyKind("q", ROUTING_KIND[self.moe_settings.mixture])

    def check_view(self, d: Mapping[str, Any], replay: Optional[bool] = None) -> Dict[str, np.ndarray]:
        """The training path's Q-values on rollout observations, without gradient or expert
        dropout: {"q" [T, A], "routing" (and a sparse layer's "margin")}."""
        with torch.no_grad(), expert_dropout_off(self):
            q, records = self._q(tree.map_structure(copied_tensor, d["obs"]), self.trunk, self.af, self.vf)
        return {"q": q.numpy(), **routing_view(self.trunk, records)}
