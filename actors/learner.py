"""One DeepSpeed-MoE learner: the algorithm's own MoE learner (MoE-PPO's or MoE-APPO's: RLlib's
loss, connectors, metrics, LR schedules) whose optimizer step is a DeepSpeed engine and whose MoE
layers are expert-parallel. `DeepSpeedLearner` goes before that learner class, as the MoE learner
mixin goes before RLlib's (deepspeed_learner_class).

Why not RLlib's own multi-learner path: its DDP wrap broadcasts rank 0's experts to every rank and
then averages *different* experts' gradients. Here DeepSpeed owns gradient reduction: non-expert
gradients are averaged over all learners, expert gradients over the expert-data-parallel group,
both divided by the data-parallel world size (DeepSpeed's engine scaling), which equals the
gradient of the mean loss over all learners' tokens.
"""
from __future__ import annotations

import collections
import datetime
import os
import pickle
import resource
from typing import Any, Dict, Optional

import deepspeed
import numpy as np
import ray
import torch
import torch.distributed as dist
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

from moe_rl.actors.deepspeed_moe import shard_moe_layers
from moe_rl.actors.rendezvous import bind_collectives_to, listening_socket, tcp_store
from moe_rl.actors.startup import StartupReport, skip_unused_shm_comm_op
from moe_rl.actors.weights_only_loads import weights_only_loads
from moe_rl.core.anomaly import rss_mb
from moe_rl.core.sharding import assemble_modules, is_expert_param, to_global_name, to_local_name
from moe_rl.rllib import ray_private
from moe_rl.rllib.learner_stability import Collectives
from moe_rl.rllib.moe_learner import MoELearner
from moe_rl.rllib.rl_module import MoEPolicyModule


def deepspeed_config(user: Dict[str, Any], minibatch_size: int, world_size: int) -> Dict[str, Any]:
    """The user's DeepSpeed config with the batch bookkeeping DeepSpeed insists on."""
    cfg = {"zero_optimization": {"stage": 0}, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    cfg.update(user or {})
    micro = int(minibatch_size)
    cfg.update({"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                "train_batch_size": micro * world_size})
    return cfg


class DeepSpeedLearner(ray_private.ShardedWithoutDDP):
    """Mixed in before an MoE TorchLearner; lives inside a LearnerActor after torch.distributed is
    initialised. Nothing here is the algorithm's: the loss, the connectors and the hooks after an
    update (APPO's target network, PPO's KL coefficient) stay the learner's own. Of the MoE learner
    it changes only how gradients are reduced and stepped and what its weights and state are
    made of; the toolkit, gradient application and kept state are the MoE learner's one copy."""

    def after_module_made(self, module) -> None:
        s = self.config.moe_settings
        self.ep_size = s.ep_size
        # DeepSpeed's expert-parallel groups are consecutive ranks: [0..ep-1], [ep..2ep-1], ...
        self.ep_rank = dist.get_rank() % self.ep_size
        # Experts per rank, per module (a multi-agent module may have its own number of experts).
        self.num_local = {mid: m.moe_settings.num_experts // self.ep_size for mid, m in module.items()
                          if isinstance(m, MoEPolicyModule)}
        for mid in module.keys():
            shard_moe_layers(module[mid], self.ep_size, self.ep_rank,
                             capacity_factor=s.trainer_capacity_factor,
                             second_expert_sampling=s.trainer_second_expert_sampling,
                             random_token_selection=s.trainer_random_token_selection)
            m = module[mid]
            if isinstance(m, MoEPolicyModule) and m.replay_mode is None and m.moe_settings.capacity_factor:
                # DeepSpeed's gate keeps its own capacity (trainer_capacity_factor), not the token
                # trunk's per-sequence one: the rollout's drops reach it only by replay.
                m.replay_mode = "full"

    def collectives(self) -> Collectives:
        """Per-group norms are global: replicated tensors once, expert shards summed over the
        expert-parallel ranks; every learner gets the same numbers and the same skip decision, and
        routers (replicated) sum their balancing statistics over all learners."""
        return Collectives(all_reduce_sum=_all_reduce_sum, world_size=dist.get_world_size(), ep_size=self.ep_size)

    def optimizer_param_groups(self, toolkit, base_lr):
        """The stability groups, each split by DeepSpeed into expert / non-expert groups (expert
        gradients are reduced over the expert-data-parallel group only)."""
        groups = split_params_into_different_moe_groups_for_optimizer(toolkit.param_groups(base_lr))
        return [g for g in groups if g["params"]]

    def build_optimizer(self, module_id, toolkit, param_groups, base_lr):
        ds_user = self.config.deepspeed_settings.config or {}
        optimizer = None if "optimizer" in ds_user else toolkit.make_optimizer(param_groups, base_lr)
        config = self.config.get_config_for_module(module_id)
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=self.module[module_id], optimizer=optimizer,
            model_parameters=param_groups if optimizer is None else None,
            config=deepspeed_config(ds_user, config.minibatch_size or config.train_batch_size_per_learner,
                                    dist.get_world_size()),
            dist_init_required=False)
        self._engines = getattr(self, "_engines", {})
        self._engines[module_id] = engine
        return optimizer or ds_optimizer

    def optimizer_step(self, module_id, optimizer) -> None:
        self._engines[module_id].step()

    def compute_gradients(self, loss_per_module, **kwargs):
        for module_id in self.module.keys():
            for _, optimizer in self.get_optimizers_for_module(module_id):
                optimizer.zero_grad(set_to_none=True)
        for mid, loss in loss_per_module.items():
            self._engines[mid].backward(loss)  # all-reduces (dense: all ranks, experts: ep-dp group)
        return {self.get_param_ref(p): p.grad for mid in self.module.keys() for p in self.module[mid].parameters()}

    # --- the state the gate keeps and a checkpoint holds ------------------------------------------
    def kept_parts(self):
        """({module_id: module}, {module_id: optimizer}) of the DeepSpeed engines."""
        return ({mid: e.module for mid, e in self._engines.items()},
                {mid: e.optimizer for mid, e in self._engines.items()})

    def kept_extra(self) -> Dict[str, Any]:
        """The RLlib learner state DeepSpeed does not hold (counters, metrics, stability toolkits,
        the KL coefficients) and this process's torch RNG."""
        extra = super().kept_extra()
        if callable(extra.get("should_module_be_updated")):  # from the config; rebuilt with it
            extra.pop("should_module_be_updated")
        extra[TORCH_RNG] = torch.get_rng_state()
        return extra

    def set_state(self, state) -> None:
        state = dict(state)
        rng = state.pop(TORCH_RNG, None)
        super().set_state(state)
        if rng is not None:
            torch.set_rng_state(rng)

    # --- expert-parallel views of the module ------------------------------------------------------
    def published_items(self, module_id: str, inference_only: bool = True, everything: bool = False):
        """This learner's part of a module's published weights under global (rollout-copy) names, as
        its live tensors. Experts: only the first replica of each expert-parallel rank publishes
        (ranks 0..ep-1). Dense tensors: only global rank 0 (they are identical everywhere).
        everything=True: all it holds (the replica check compares those)."""
        rank = dist.get_rank()
        for name, tensor in self.local_state(module_id, inference_only).items():
            expert = is_expert_param(name)
            if everything or (rank < self.ep_size if expert else rank == 0):
                yield to_global_name(name, self.ep_rank, self.num_local.get(module_id, 1)), name, tensor

    def load_shards(self, shards, inference_only: bool = True) -> None:
        """Load published shards (global names): every rank keeps its own experts and the dense
        tensors. Strict both ways: the mapped keys must be exactly this rank's module keys."""
        full = assemble_modules(shards)
        for mid in self.module.keys():
            own = self.local_state(mid, inference_only)
            mapped = {}
            for name, value in full.get(mid, {}).items():
                local = to_local_name(name, self.ep_rank, self.num_local.get(mid, 1))
                if local is not None:
                    mapped[local] = value
            missing, unexpected = sorted(set(own) - set(mapped)), sorted(set(mapped) - set(own))
            if missing or unexpected:
                raise ValueError(f"module {mid!r}: shards do not match this learner: missing {missing[:3]}, "
                                 f"unexpected {unexpected[:3]}")
            with torch.no_grad():
                for k, v in mapped.items():
                    own[k].copy_(torch.as_tensor(np.asarray(v)))

    def expert_param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for mid in self.module.keys()
                   for n, p in self.plain_module(mid).named_parameters() if is_expert_param(n))


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def deepspeed_learner_class(config) -> type:
    """DeepSpeedLearner before the config's learner class (MoEPPOTorchLearner, MoEAPPOTorchLearner
    or a user's subclass of either)."""
    base = config.learner_class
    if not issubclass(base, MoELearner):
        raise TypeError(f"the DeepSpeed learner group needs an MoE learner class (moe_rl.rllib.moe_learner."
                        f"MoELearner before RLlib's), got {base.__name__}")
    return type(f"DeepSpeed{base.__name__}", (DeepSpeedLearner, base), {})


PROCESS_GROUP_TIMEOUT_S = 1800.0   # torch's default for gloo


class LearnerActor:
    """Ray actor around one DeepSpeed learner (rank `rank` of `world_size`)."""

    def __init__(self, rank: int, world_size: int, num_threads: int = 1):
        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(num_threads)
        self.learner: Optional[DeepSpeedLearner] = None
        self._listen = None   # rank 0: the process group store's socket, bound before it is announced

    def address(self):
        """Rank 0's rendezvous: the node's own IP (loopback under the embedded Ray) and a port it
        already listens on."""
        ip = ray.util.get_node_ip_address()
        self._listen = listening_socket(ip)
        return ip, self._listen.getsockname()[1]

    def build(self, config, module_spec, master_addr: str, master_port: int) -> None:
        os.environ.update({"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": "0",
                           "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)})
        backend = "nccl" if torch.cuda.is_available() and config.num_gpus_per_learner > 0 else "gloo"
        job = ray.get_runtime_context().get_job_id()
        with StartupReport(job, f"learner {self.rank}") as report:
            skip_unused_shm_comm_op()
            report.step(f"joining the {backend} process group ({self.world_size} learners)")
            # Our own store on a bound socket and pairs on this node's interface: torch's env://
            # rendezvous would listen on every interface. DeepSpeed then finds the group made.
            bind_collectives_to(ray.util.get_node_ip_address())
            store = tcp_store(master_addr, master_port, self.world_size, self.rank, PROCESS_GROUP_TIMEOUT_S,
                              listen=self._listen)
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
            deepspeed.init_distributed(backend, auto_mpi_discovery=False, verbose=False,
                                       rank=self.rank, world_size=self.world_size)
            if config.seed is not None:
                torch.manual_seed(config.seed)
            report.step("building its DeepSpeed engines")
            self.learner = deepspeed_learner_class(config)(config=config, module_spec=module_spec)
            self.learner.build()

    def update(self, **kwargs):
        return self.learner.update(**kwargs)

    def apply(self, fn, *args, **kwargs):
        """Run fn(learner, *args) here (RLlib's foreach_learner contract)."""
        return fn(self.learner, *args, **kwargs)

    def memory_stats(self) -> Dict[str, float]:
        return {"expert_param_bytes": float(self.learner.expert_param_bytes()),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
                "rss_mb": rss_mb()}

    def save(self, path: str) -> None:
        """DeepSpeed checkpoint of this rank per module (collective: every rank calls it) + the
        learner state DeepSpeed does not hold, as plain data (see save_learner_state)."""
        for mid, engine in self.learner._engines.items():
            engine.save_checkpoint(path, tag=f"moe_rl-{mid}", save_latest=False)
        save_learner_state(self.learner.kept_extra(), os.path.join(path, f"learner_rank_{self.rank}.pt"))

    def restore(self, path: str) -> None:
        for mid, engine in self.learner._engines.items():
            with weights_only_loads(engine):   # DeepSpeed's own load unpickles anything
                engine.load_checkpoint(path, tag=f"moe_rl-{mid}", load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
        self.learner.set_state(load_learner_state(os.path.join(path, f"learner_rank_{self.rank}.pt")))

    # --- the gate's last good state, kept in this process ---------------------------------------
    def can_keep_state(self) -> bool:
        """A plain torch optimizer under ZeRO stage 0 (no fp16/bf16 wrapper): its state_dict is the
        exact moments. Otherwise the group snapshots through DeepSpeed's checkpoint calls."""
        return all(isinstance(e.optimizer, torch.optim.Optimizer) and e.zero_optimization_stage() == 0
                   for e in self.learner._engines.values())

    def keep_state(self) -> None:
        """Weights, optimizer moments, learner state and RNG, copied in memory (on the learner's
        device, into the previous copy's buffers): a snapshot per sync costs a memory copy, not a
        checkpoint write."""
        self.learner.keep_state()

    def restore_kept_state(self) -> None:
        self.learner.restore_kept_state()


# --- learner_rank_{r}.pt: plain data only, loaded without unpickling code --------------------------
# Why not torch.serialization.add_safe_globals: RLlib's learner state holds numpy arrays and scalars,
# and a weights_only load of those needs four numpy internals allowed (checked with torch 2.13's
# get_unsafe_globals_in_checkpoint: numpy._core.multiarray._reconstruct and .scalar, numpy.ndarray,
# numpy.dtype; private names that moved in numpy 2). Tensors instead keep the file readable by any
# weights_only reader with no allow-list to keep in step with numpy.
TORCH_RNG = "moe_rl_torch_rng"
_TUPLE, _NDARRAY = "__moe_rl_tuple__", "__moe_rl_ndarray__"


def plain_state(obj, where: str = "state"):
    """RLlib learner state -> dict/list/str/int/float/bool/None/tensor only (tuples and numpy
    arrays tagged so they come back as such). Anything else is a TypeError naming the key."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, np.ndarray) and obj.dtype != object:
        return {_NDARRAY: torch.from_numpy(np.ascontiguousarray(obj))}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        bad = [k for k in obj if not isinstance(k, (str, int)) or isinstance(k, bool)]
        if bad:
            raise TypeError(f"{where}: key {bad[0]!r} is not a str or int")
        return {k: plain_state(v, f"{where}.{k}") for k, v in obj.items()}
    if isinstance(obj, tuple):
        return {_TUPLE: [plain_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, (list, collections.deque)):
        return [plain_state(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    raise TypeError(f"{where}: a {type(obj).__name__} cannot be stored as plain data")


def _unplain(obj):
    if isinstance(obj, dict):
        if set(obj) == {_NDARRAY}:
            return obj[_NDARRAY].numpy()
        if set(obj) == {_TUPLE}:
            return tuple(_unplain(v) for v in obj[_TUPLE])
        return {k: _unplain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unplain(v) for v in obj]
    return obj


def save_learner_state(state: Dict[str, Any], file: str) -> None:
    torch.save(plain_state(state), file)


def load_learner_state(file: str) -> Dict[str, Any]:
    """torch.load(weights_only=True): a file holding anything but plain data (e.g. a pickle that
    would run code) is refused, never executed."""
    try:
        state = torch.load(file, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, ValueError, EOFError) as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        first = next((line for line in lines if "nsupported" in line), lines[0])
        raise ValueError(f"learner state {file!r} refused: not plain data ({first})") from None
    return _unplain(state)
