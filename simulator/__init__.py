"""ClusterSim: trace-driven discrete-event simulation of LLM training on GPU clusters.

Only ``simulator.capture`` may import torch; everything else runs on a laptop CPU.
"""

__version__ = "0.1.0"
