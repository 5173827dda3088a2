"""Collectives over any group of nodes (ring when the group has one, else tree)."""

from p2psync.collectives.allreduce import GroupPlan, allreduce

__all__ = ["GroupPlan", "allreduce"]
