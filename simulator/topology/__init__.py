from simulator.topology.graph import TopologyGraph, build_graph
from simulator.topology.placement import Mesh, Placement
from simulator.topology.spec import NodeSpec, TopologySpec, available_topologies, load_topology

__all__ = ["Mesh", "NodeSpec", "Placement", "TopologyGraph", "TopologySpec", "available_topologies", "build_graph", "load_topology"]
