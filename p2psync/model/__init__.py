"""The model as strategies see it: plain values (values.py), the replica protocol and its
capabilities (replica.py), and the flat view of a torch model and optimizer (flat.py, imported
on its own: it needs torch).

Below ``strategies/`` and ``training/``: both import from here, neither from the other for
these types.
"""

from p2psync.model.replica import (LAYERED, MODEL_BUFFERS, OPTIMIZER_SHARDS, PARAM_RANGES, SGD_COMPENSATION,
                                   STEP_AS_IS, STEP_EACH, Capability, Layered, ModelBuffers, OptimizerShards,
                                   ParamRanges, Replica, SgdCompensation, StepAsIs, StepEach, check_replica)
from p2psync.model.values import MAX_META_BYTES, Buffers, Layer, PerElement, SgdHyper, SgdStep

__all__ = ["LAYERED", "MAX_META_BYTES", "MODEL_BUFFERS", "OPTIMIZER_SHARDS", "PARAM_RANGES", "SGD_COMPENSATION",
           "STEP_AS_IS", "STEP_EACH", "Buffers", "Capability", "Layer", "Layered", "ModelBuffers", "OptimizerShards",
           "ParamRanges", "PerElement", "Replica", "SgdCompensation", "SgdHyper", "SgdStep", "StepAsIs", "StepEach",
           "check_replica"]
