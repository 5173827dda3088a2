"""Synchronization strategies: one module per algorithm, registered by name."""

from p2psync.strategies import asgd, canary, diloco, dts, esync, preduce, ps, ssgd  # noqa: F401  (register)
from p2psync.strategies.base import (REGISTRY, StepReport, Strategy, StrategyContext,
                                     get_strategy, register)

__all__ = ["REGISTRY", "StepReport", "Strategy", "StrategyContext", "get_strategy", "register"]
