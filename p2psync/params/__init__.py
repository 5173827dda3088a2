"""The sharded parameter store (DESIGN "Parameter-server algorithms ... run on a sharded
parameter store"; ../shared/specs/ssp-dssp-elasticbsp.md §6.1)."""

from p2psync.params.shards import piece_ranges, shard_bounds
from p2psync.params.store import ParamStore, ShardOptimizer

__all__ = ["ParamStore", "ShardOptimizer", "piece_ranges", "shard_bounds"]
