"""Per-task episode figures, logged on the EnvRunners (an RLlib callback).

Any env whose final `info` names the episode's task (`info["task"]`, as moe_rl/MiniGrid-MT* and
moe_rl/MultiTask-v0 do) gets, under RLlib's `env_runners` results:

    task/<name>/return, task/<name>/length    mean over that task's episodes that ended this
                                              iteration (RLlib 2.60 clears a mean at every reduce; NaN:
                                              none ended)
    task/<name>/success                       the same, of info["success"] where the env reports it
    task_count                                info["num_tasks"] (the metrics row averages over tasks
                                              only when every one of them has a figure)
    task_segment                              info["segment"]: the block of a task schedule that
                                              changes tasks on purpose (the sequential one), the
                                              latest of the episodes ended this iteration
    task/<name>/experts/layer{i}/e{j}         tokens the rollout routed to expert j of MoE layer i in
                                              that task's episodes ended this iteration (a sum; the
                                              metrics row turns it into each task's share;
                                              up to 64 experts)

Stock RLlib PPO takes the same callback (`config.callbacks(TaskEpisodeMetrics)`): a dense policy
has no routing, so it logs the first three only. MoEPPOConfig installs it by default.
"""
from __future__ import annotations

import numpy as np
from ray.rllib.callbacks.callbacks import RLlibCallback

from moe_rl.rllib.rl_module import MOE_COMBINE, MOE_TOPK

PER_EXPERT_MAX = 64   # the metrics row's per-expert columns stop here too (tasks x layers x experts)


def _chunks(episode, prev_episode_chunks):
    return [*(prev_episode_chunks or ()), episode]


def expert_counts(topk: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, L, k] recorded top-k (a capacity-dropped choice e stored as -(e + 1)) -> [L, N] counts of
    the experts chosen, dropped or not (what the router asked for)."""
    chosen = np.where(topk < 0, -topk - 1, topk).astype(np.int64)
    return np.stack([np.bincount(chosen[:, i].ravel(), minlength=num_experts) for i in range(chosen.shape[1])])


class TaskEpisodeMetrics(RLlibCallback):
    def on_episode_end(self, *, episode, prev_episode_chunks=None, env_runner=None, metrics_logger=None,
                       rl_module=None, **kwargs) -> None:
        info = episode.get_infos(-1)
        task = info.get("task") if isinstance(info, dict) else None
        if task is None or metrics_logger is None:
            return
        chunks = _chunks(episode, prev_episode_chunks)
        window = env_runner.config.metrics_num_episodes_for_smoothing if env_runner is not None else 100
        key = f"task/{task}"
        metrics_logger.log_value(f"{key}/return", float(sum(c.get_return() for c in chunks)), window=window)
        metrics_logger.log_value(f"{key}/length", float(sum(len(c) for c in chunks)), window=window)
        if "success" in info:
            metrics_logger.log_value(f"{key}/success", float(info["success"]), window=window)
        if "num_tasks" in info:
            metrics_logger.log_value("task_count", int(info["num_tasks"]), reduce="max")
        if "segment" in info:
            metrics_logger.log_value("task_segment", int(info["segment"]), reduce="max")
        num_experts = _num_experts(rl_module)
        if num_experts is None or num_experts > PER_EXPERT_MAX:
            return
        recorded = episode.extra_model_outputs
        if MOE_TOPK in recorded:      # sparse: assignments per expert
            topk = np.concatenate([np.asarray(c.get_extra_model_outputs(MOE_TOPK)) for c in chunks if len(c)])
            loads = expert_counts(topk, num_experts)
        elif MOE_COMBINE in recorded:  # soft: combine weight per expert, summed over the steps
            loads = np.concatenate([np.asarray(c.get_extra_model_outputs(MOE_COMBINE)) for c in chunks
                                    if len(c)]).sum(0)
        else:
            return
        for layer, counts in enumerate(loads):
            for e, n in enumerate(counts):
                metrics_logger.log_value(f"{key}/experts/layer{layer}/e{e}", float(n), reduce="sum")


def _num_experts(rl_module):
    """The MoE module's expert count (None for a dense module, or a multi-agent dict of modules)."""
    settings = getattr(rl_module, "moe_settings", None)
    return settings.num_experts if settings else None
