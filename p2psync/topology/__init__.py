"""Topology layer (pure): model, JSON load/validate/save, builders."""

from p2psync.topology.builders import (bcube, bcube_digits, bcube_switch, group_of, groups, is_gateway, mesh,
                                       ring, star)
from p2psync.topology.io import dumps, load, loads, save, topology_from_dict, topology_to_dict
from p2psync.topology.model import LinkAttrs, Network, Nic, Node, Route, Topology

__all__ = [
    "LinkAttrs", "Network", "Nic", "Node", "Route", "Topology",
    "bcube", "bcube_digits", "bcube_switch", "group_of", "groups", "is_gateway", "mesh", "ring", "star",
    "dumps", "load", "loads", "save", "topology_from_dict", "topology_to_dict",
]
