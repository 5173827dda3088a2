"""p2psync: an asyncio peer-to-peer runtime for data-parallel training on heterogeneous,
far-apart clusters. See DESIGN.md for the layers; imports point down only."""

__version__ = "0.1.0"
