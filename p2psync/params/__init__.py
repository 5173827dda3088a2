"""The sharded parameter store (DESIGN "Parameter-server algorithms ... run on a sharded
parameter store"; ../shared/specs/ssp-dssp-elasticbsp.md §6.1)."""

from p2psync.params.optim import OptimSpec, ShardOptimizer, read_hypers, read_spec
from p2psync.params.shards import piece_ranges, shard_bounds
from p2psync.params.store import ParamStore

__all__ = ["OptimSpec", "ParamStore", "ShardOptimizer", "piece_ranges", "read_hypers", "read_spec", "shard_bounds"]
