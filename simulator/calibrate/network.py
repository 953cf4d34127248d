"""A network that times collectives by a profile's fitted per-collective curves.

The flow-level fabric only knows link efficiencies, which reproduce the large-message end of a
measured sweep; the fitted curves (Profile.comm.collectives) reproduce the whole size range,
including the mid sizes where NCCL's (or gloo's) protocols are not yet at full bandwidth. This
wrapper uses a curve when one fits the request's collective and tier (the nearest measured group
size), and the wrapped network otherwise. A collective timed by its curve holds no links, so it
does not contend with others: use it for validation on captured layouts, the fabric for scale.
"""

from __future__ import annotations

import numpy as np
import simpy

from simulator.profile import CommModel
from simulator.network.base import CollectiveRequest


class FittedNetwork:
    def __init__(self, base, comm: CommModel, gpus_per_node: int):
        self.base = base
        self.comm = comm
        self.gpus_per_node = gpus_per_node
        self.used: dict[tuple, int] = {}  # (op, n, tier) -> calls timed by a curve

    def _fit(self, req: CollectiveRequest, count: bool = True):
        if not self.comm.collectives or req.group_size <= 1 or req.size_bytes <= 0:
            return None
        if getattr(self.comm, "nccl", None) is not None:
            return None  # a calibrated NCCL model times collectives in the wrapped network: one source
        g = np.asarray(req.groups[0])
        tier = "intra" if len(np.unique(g // self.gpus_per_node)) == 1 else "inter"
        op = req.op
        fit = self.comm.collective_fit(op, req.group_size, tier)
        if fit is not None and count:
            self.used[(op, req.group_size, tier)] = self.used.get((op, req.group_size, tier), 0) + 1
        return fit

    def collective_time_s(self, req: CollectiveRequest) -> float:
        fit = self._fit(req)
        if fit is None:
            return self.base.collective_time_s(req)
        return float(fit.time_us(req.size_bytes)) * 1e-6

    def start(self, env: simpy.Environment, req: CollectiveRequest) -> simpy.Event:
        fit = self._fit(req)
        if fit is None:
            return self.base.start(env, req)
        return env.timeout(float(fit.time_us(req.size_bytes)) * 1e-6)

    # Defined here, not forwarded by __getattr__: a collective timed by its curve holds no links.
    def links_of(self, req: CollectiveRequest):
        if self._fit(req, count=False) is not None:
            return None
        return self.base.links_of(req)

    def run_closed_form(self, env: simpy.Environment, req: CollectiveRequest, t0_s: float) -> float | None:
        fit = self._fit(req)
        if fit is None:
            return self.base.run_closed_form(env, req, t0_s)
        return float(fit.time_us(req.size_bytes)) * 1e-6

    def __getattr__(self, name: str):
        # link_report and friends come from the wrapped network.
        return getattr(self.base, name)
