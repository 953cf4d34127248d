"""The interface between the engine and the network.

The engine issues a collective as a ``CollectiveRequest``: one operation issued together by
every group in ``groups`` (in reduced mode, all the replicas of the simulated group, so the
fabric sees the traffic of every rank). The network answers with the isolated time, and with a
SimPy event that fires when the collective completes under contention.

Message sizes follow nccl-tests' ``size`` convention (FORMATS.md §5.2), so the numbers line up
with a real nccl-tests log:
  all_reduce, broadcast, send_recv: the buffer of one rank;
  all_gather: the gathered output buffer (count x nranks);
  reduce_scatter: the input buffer before scattering (count x nranks);
  all_to_all: the whole send buffer of one rank (count per peer x nranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import simpy

from simulator.vocabulary import NETWORK_OPS, CollectiveOp, Dim, bus_factor  # noqa: F401  (one vocabulary, re-exported)

COLLECTIVE_OPS: tuple[str, ...] = tuple(o.value for o in NETWORK_OPS)


@dataclass(frozen=True, eq=False)
class CollectiveRequest:
    op: CollectiveOp
    dim: Dim
    # shape (n_groups, group_size): global GPU ids of each group issuing the collective together.
    # For send_recv a group is [src, dst].
    groups: np.ndarray
    size_bytes: float

    @property
    def group_size(self) -> int:
        return int(self.groups.shape[1])


class Network(Protocol):
    def collective_time_s(self, req: CollectiveRequest) -> float:
        """Time of the collective when nothing else uses the network."""

    def start(self, env: simpy.Environment, req: CollectiveRequest) -> simpy.Event:
        """An event that fires when the collective completes, with contention if modelled."""

    # Optional, both or neither (the engine's closed-form collectives, ``Engine._closed_form_requests``;
    # a wrapper must define them itself, not forward them through ``__getattr__``):
    #
    # def links_of(self, req) -> np.ndarray | None:
    #     """The link ids the collective puts bytes on; None: it holds no shared link, so nothing
    #     else changes its time."""
    #
    # def run_closed_form(self, env, req, t0_s: float) -> float | None:
    #     """Account the collective as run alone from ``t0_s`` (now or later; the caller has shown
    #     that no one else uses its links) and return its time, with no event; None: run it with
    #     ``start`` instead."""
