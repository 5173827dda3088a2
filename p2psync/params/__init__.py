"""The sharded parameter store (docs/architecture.md, "Parameter-server algorithms run on a
sharded store")."""

from p2psync.params.optim import OptimSpec, ShardOptimizer, read_hypers, read_spec
from p2psync.params.shards import piece_ranges, shard_bounds
from p2psync.params.store import ParamStore

__all__ = ["OptimSpec", "ParamStore", "ShardOptimizer", "piece_ranges", "read_hypers", "read_spec", "shard_bounds"]
