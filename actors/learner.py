"""One DeepSpeed-MoE learner: RLlib's PPO learner (loss, GAE connectors, metrics, LR schedules)
whose optimizer step is a DeepSpeed engine and whose MoE layers are expert-parallel.

Why not RLlib's own multi-learner path: its DDP wrap broadcasts rank 0's experts to every rank and
then averages *different* experts' gradients. Here DeepSpeed owns gradient reduction: non-expert
gradients are averaged over all learners, expert gradients over the expert-data-parallel group,
both divided by the data-parallel world size (DeepSpeed's engine scaling), which equals the
gradient of the mean loss over all learners' tokens.
"""
from __future__ import annotations

import os
import resource
import socket
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from moe_rl.learner import MoEPPOTorchLearner
from moe_rl.sharding import is_expert_param, to_global_name, to_local_name


def deepspeed_config(user: Dict[str, Any], minibatch_size: int, world_size: int) -> Dict[str, Any]:
    """The user's DeepSpeed config with the batch bookkeeping DeepSpeed insists on."""
    cfg = {"zero_optimization": {"stage": 0}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    cfg.update(user or {})
    micro = int(minibatch_size)
    cfg.update({"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                "train_batch_size": micro * world_size})
    return cfg


class DeepSpeedPPOLearner(MoEPPOTorchLearner):
    """Lives inside a LearnerActor after torch.distributed is initialised."""

    def _make_module(self):
        from .deepspeed_moe import shard_moe_layers
        module = super()._make_module()
        s = self.config.moe_settings
        self.ep_size = s["ep_size"]
        # DeepSpeed's expert-parallel groups are consecutive ranks: [0..ep-1], [ep..2ep-1], ...
        self.ep_rank = dist.get_rank() % self.ep_size
        self.num_local = s["num_experts"] // self.ep_size
        for mid in module.keys():
            shard_moe_layers(module[mid], self.ep_size, self.ep_rank,
                             capacity_factor=s["trainer_capacity_factor"],
                             second_expert_sampling=s["trainer_second_expert_sampling"],
                             random_token_selection=s["trainer_random_token_selection"])
        return module

    def _make_modules_ddp_if_necessary(self) -> None:
        """Never DDP: DeepSpeed reduces gradients (see module docstring)."""

    def configure_optimizers_for_module(self, module_id, config=None):
        import deepspeed
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        module = self._module[module_id]
        params = self.get_parameters(module)
        groups = split_params_into_different_moe_groups_for_optimizer({"params": params, "name": "params"})
        ds_user = self.config.deepspeed_settings.get("config") or {}
        lr = config.lr if isinstance(config.lr, (int, float)) else 1e-3  # schedules set it each step
        optimizer = None if "optimizer" in ds_user else torch.optim.Adam(groups, lr=lr, foreach=True)
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, model_parameters=groups if optimizer is None else None,
            config=deepspeed_config(ds_user, config.minibatch_size or config.train_batch_size_per_learner,
                                    dist.get_world_size()),
            dist_init_required=False)
        self._engines = getattr(self, "_engines", {})
        self._engines[module_id] = engine
        self.register_optimizer(module_id=module_id, optimizer=optimizer or ds_optimizer, params=params,
                                lr_or_lr_schedule=config.lr)

    def _uncompiled_update(self, batch, **kwargs):
        """RLlib's update step without the DDP `no_sync` context (there is no DDP here)."""
        self._compute_off_policyness(batch)
        fwd_out = self.module.forward_train(batch)
        loss_per_module = self.compute_losses(fwd_out=fwd_out, batch=batch)
        self.apply_gradients(self.postprocess_gradients(self.compute_gradients(loss_per_module)))
        return fwd_out, loss_per_module, {}

    def compute_gradients(self, loss_per_module, **kwargs):
        for optim in self._optimizer_parameters:
            optim.zero_grad(set_to_none=True)
        for mid, loss in loss_per_module.items():
            self._engines[mid].backward(loss)  # all-reduces (dense: all ranks, experts: ep-dp group)
        return {pid: p.grad for pid, p in self._params.items()}

    def apply_gradients(self, gradients_dict) -> None:
        for pid, grad in gradients_dict.items():
            if self._params[pid].grad is not grad:
                self._params[pid].grad = grad
        for engine in self._engines.values():
            engine.step()

    # --- expert-parallel views of the module ------------------------------------------------------
    def module_shard(self, module_id: str = "default_policy", inference_only: bool = True,
                     include_dense: Optional[bool] = None, everything: bool = False) -> Dict[str, Any]:
        """This learner's part of the full state, under global (rollout-copy) names, as numpy.
        Experts: only the first replica of each expert-parallel rank publishes. Dense tensors:
        only global rank 0 (they are identical everywhere). everything=True: all it holds (for
        the replica-divergence check)."""
        rank = dist.get_rank()
        if include_dense is None:
            include_dense = rank == 0 or everything
        publishes_experts = rank < self.ep_size or everything
        module = self._module[module_id]
        skip = tuple(module.get_non_inference_attributes()) if inference_only else ()
        out = {}
        for name, tensor in module.state_dict().items():
            if skip and name.split(".")[0] in skip:
                continue
            expert = is_expert_param(name)
            if (expert and publishes_experts) or (not expert and include_dense):
                out[to_global_name(name, self.ep_rank, self.num_local)] = tensor.detach().cpu().numpy().copy()
        return out

    def load_global_state(self, state: Dict[str, Any], module_id: str = "default_policy") -> None:
        """Load a full (global-name) state: every rank keeps its own experts. Strict both ways."""
        module = self._module[module_id]
        own = module.state_dict()
        mapped = {}
        for name, value in state.items():
            local = to_local_name(name, self.ep_rank, self.num_local)
            if local is not None:
                mapped[local] = torch.as_tensor(value)
        missing, unexpected = sorted(set(own) - set(mapped)), sorted(set(mapped) - set(own))
        if missing or unexpected:
            raise ValueError(f"state does not match the learner module: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        module.load_state_dict(mapped, strict=True)

    def expert_param_bytes(self, module_id: str = "default_policy") -> int:
        return sum(p.numel() * p.element_size() for n, p in self._module[module_id].named_parameters()
                   if is_expert_param(n))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1" if os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") == "0" else "", 0))
        return s.getsockname()[1]


class LearnerActor:
    """Ray actor around one DeepSpeedPPOLearner (rank `rank` of `world_size`)."""

    def __init__(self, rank: int, world_size: int, num_threads: int = 1):
        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(num_threads)
        self.learner: Optional[DeepSpeedPPOLearner] = None

    def address(self):
        import ray
        ip = ray.util.get_node_ip_address()
        return ip, free_port()

    def build(self, config, module_spec, master_addr: str, master_port: int) -> None:
        import deepspeed
        os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": "0",
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        backend = "nccl" if torch.cuda.is_available() and config.num_gpus_per_learner > 0 else "gloo"
        deepspeed.init_distributed(backend, auto_mpi_discovery=False, verbose=False,
                                   rank=self.rank, world_size=self.world_size)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self.learner = DeepSpeedPPOLearner(config=config, module_spec=module_spec)
        self.learner.build()

    def update(self, **kwargs):
        return self.learner.update(**kwargs)

    def module_shard(self, inference_only: bool = True, everything: bool = False):
        return self.learner.module_shard(inference_only=inference_only, everything=everything)

    def load_global_state(self, state) -> None:
        self.learner.load_global_state(state)

    def apply(self, fn, *args, **kwargs):
        """Run fn(learner, *args) here (RLlib's foreach_learner contract)."""
        return fn(self.learner, *args, **kwargs)

    def memory_stats(self) -> Dict[str, float]:
        return {"expert_param_bytes": float(self.learner.expert_param_bytes()),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}

    def save(self, path: str) -> None:
        """DeepSpeed checkpoint of this rank (collective: every rank calls it) + RLlib learner
        state that DeepSpeed does not hold (LR schedules, KL coefficients, counters)."""
        engine = self.learner._engines["default_policy"]
        engine.save_checkpoint(path, tag="moe_rl", save_latest=False)
        extra = self.learner.get_state(not_components=["rl_module"])
        extra.pop("optimizer", None)
        torch.save(extra, os.path.join(path, f"learner_rank_{self.rank}.pt"))

    def restore(self, path: str) -> None:
        engine = self.learner._engines["default_policy"]
        engine.load_checkpoint(path, tag="moe_rl", load_optimizer_states=True, load_lr_scheduler_states=True)
        extra = torch.load(os.path.join(path, f"learner_rank_{self.rank}.pt"), weights_only=False)
        self.learner.set_state(extra)
