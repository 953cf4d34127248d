from simulator.topology.spec import NodeSpec, TopologySpec, available_topologies, load_topology

__all__ = ["NodeSpec", "TopologySpec", "available_topologies", "load_topology"]
