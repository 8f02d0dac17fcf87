"""DeepSpeed's checkpoint files read with torch.load(weights_only=True).

DeepSpeed 0.19's TorchCheckpointEngine.load unpickles with weights_only=False: a model-states or
optimizer-states file could run any code. Every file a learner restores (its model states, each
expert's, its optimizer states) goes through its engine's checkpoint_engine.load, so for the length
of a load_checkpoint the engine's checkpoint engine is one whose load is weights_only. Stage 0
files hold tensors and plain data only; ZeRO-1/2 optimizer states also hold three DeepSpeed record
classes, allowed by name (their constructors take plain values and run nothing of the file's;
checked with torch.serialization.get_unsafe_globals_in_checkpoint). Anything else is refused with
one line naming it. (The files are also read only from a private copy whose bytes were verified
against the run's signed manifest: moe_rl/app/verified_copy.py.)
"""
from __future__ import annotations

import contextlib
import pickle

import torch
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

ALLOWED = [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]


class _WeightsOnly:
    """The engine's own checkpoint engine, but for load()."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path: str, map_location=None):
        try:
            with torch.serialization.safe_globals(ALLOWED):
                return torch.load(path, map_location=map_location, weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, AttributeError, TypeError, ValueError, EOFError) as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
            first = next((line for line in lines if "nsupported" in line), lines[0])
            raise ValueError(f"DeepSpeed checkpoint file {path!r} refused: not plain data ({first[:300]})") from None


@contextlib.contextmanager
def weights_only_loads(engine):
    """For the block: the DeepSpeed engine loads its checkpoint files with weights_only=True."""
    own = engine.checkpoint_engine
    engine.checkpoint_engine = _WeightsOnly(own)
    try:
        yield
    finally:
        engine.checkpoint_engine = own
