"""Piece-level collectives over any group of nodes, planned over the topology."""

from p2psync.collectives.executor import Collectives, OpStats
from p2psync.collectives.opid import OpId
from p2psync.collectives.plan import ALGOS, Plan, Transfer, make_plan

__all__ = ["ALGOS", "Collectives", "OpId", "OpStats", "Plan", "Transfer", "make_plan"]
