"""MoEAPPOTorchLearner: RLlib's APPO loss (V-trace, the surrogate clipped against the target
policy, its KL) with the MoE parts (moe_rl.rllib.moe_learner)."""
from __future__ import annotations

from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner
from ray.rllib.core.learner.learner import Learner

from moe_rl.rllib.moe_learner import MoELearner


class MoEAPPOTorchLearner(MoELearner, APPOTorchLearner):
    def update(self, training_data=None, *, timesteps=None, **kwargs):
        """RLlib's synchronous Learner.update, not IMPALA's. Why: IMPALALearner.update queues the
        batch for a learner thread and returns before the step is taken (results come every 20th
        call), and the sync gate needs the update done when update() returns: it compares the
        candidate with the synced weights, keeps the last good state and rolls back to it, all on
        this learner. Rollouts still never wait for it (MoEAPPO samples asynchronously), and an
        update is the same loss on the same batch."""
        kwargs.pop("async_update", None)
        kwargs.pop("return_state", None)
        kwargs.pop("defer_solve_refs_to_learner", None)
        return Learner.update(self, training_data=training_data, timesteps=timesteps, **kwargs)
