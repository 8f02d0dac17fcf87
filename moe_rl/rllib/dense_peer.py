"""DensePeerModule: the dense policy a user would run instead of the MoE one, for comparisons.

The same network as MoEPolicyModule's vector/image trunk with every MoE layer replaced by a dense
feed-forward layer of the same *active* width (top_k x d_ff: `dense_ffn_equal_active`): the same
encoder (a CNN for images), the same task input, the same residual pre-norm blocks, the same heads
and a separate value network. It runs under stock RLlib PPO (PPOConfig + RLModuleSpec), with no
moe-rl learner, check or gate: bench/bench_minigrid.py uses it as the "dense PPO" arm, and
DenseAPPOPeerModule (with APPO's target network) as stock APPO's in bench/bench_appo.py.

    RLModuleSpec(module_class=DensePeerModule, model_config={"moe": {...}})   # the same moe settings
"""
from __future__ import annotations

from typing import Any, Dict

from ray.rllib.core.columns import Columns
from ray.rllib.core.learner.utils import make_target_network
from ray.rllib.core.rl_module.apis import TARGET_NETWORK_ACTION_DIST_INPUTS, TargetNetworkAPI, ValueFunctionAPI
from ray.rllib.core.rl_module.torch import TorchRLModule
from torch import nn

from moe_rl.core.encoders import ObservationEncoder
from moe_rl.core.experts import tanh
from moe_rl.core.layer import dense_ffn_equal_active
from moe_rl.core.policy import mlp, policy_head
from moe_rl.core.sections import plain
from moe_rl.core.settings import MOE_DEFAULTS, validate_moe


class DenseBlock(nn.Module):
    """h + FFN(LN(h)), FFN of width top_k x d_ff: an MoE block's active compute, without routing."""

    def __init__(self, s: Dict[str, Any]):
        super().__init__()
        self.norm = nn.LayerNorm(s.d_model)
        self.ffn = dense_ffn_equal_active(s.d_model, s.d_ff, s.top_k, s.activation)

    def forward(self, h):
        return h + self.ffn(self.norm(h))


class DensePeerModule(TorchRLModule, ValueFunctionAPI):
    def setup(self):
        s = validate_moe({**MOE_DEFAULTS, **plain(self.model_config.get("moe"))})
        self.encoder = ObservationEncoder(self.observation_space, s.encoder)
        self.embed = nn.Linear(self.encoder.out_dim, s.d_model)
        self.blocks = nn.Sequential(*(DenseBlock(s) for _ in range(s.num_layers)))
        self.pi = policy_head(s.policy_head, s.d_model, int(self.action_space.n))
        self.vf_encoder = ObservationEncoder(self.observation_space, s.encoder)
        self.vf = mlp([self.vf_encoder.out_dim, *s.vf_hiddens], 1)

    @staticmethod
    def _floats(obs):
        return {k: v.float() for k, v in obs.items()} if isinstance(obs, dict) else obs.float()

    def _forward(self, batch: Dict[str, Any], **kwargs) -> Dict[str, Any]:
        features, _ = self.encoder(self._floats(batch[Columns.OBS]))
        return {Columns.ACTION_DIST_INPUTS: self.pi(self.blocks(tanh(self.embed(features))))}

    def compute_values(self, batch: Dict[str, Any], embeddings=None):
        features, _ = self.vf_encoder(self._floats(batch[Columns.OBS]))
        return self.vf(features).squeeze(-1)



class DenseAPPOPeerModule(DensePeerModule, TargetNetworkAPI):
    """The dense peer under stock RLlib APPO: its policy path (encoder, blocks, head) with the
    target copy APPO's loss clips against."""

    def make_target_networks(self) -> None:
        self._target = nn.ModuleDict({k: make_target_network(getattr(self, k))
                                      for k in ("encoder", "embed", "blocks", "pi")})

    def get_target_network_pairs(self):
        return [(getattr(self, k), self._target[k]) for k in ("encoder", "embed", "blocks", "pi")]

    def forward_target(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        t = self._target
        features, _ = t["encoder"](self._floats(batch[Columns.OBS]))
        return {TARGET_NETWORK_ACTION_DIST_INPUTS: t["pi"](t["blocks"](tanh(t["embed"](features))))}
