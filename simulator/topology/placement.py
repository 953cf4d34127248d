"""Rank <-> parallel coordinates, from one reshaped array (as picotron does).

The mesh order lists dimensions innermost first. Megatron's default ``tp-cp-ep-dp-pp`` keeps a
TP group on consecutive GPU ids, i.e. inside one node. The dense model's ranks are laid out by
tp, cp, dp and pp alone: ``ep`` in the order places nothing, as megatron-core 0.16.1's decoder rank
generator is built with ep = 1 (parallel_state.initialize_model_parallel).

Expert parallelism folds over a pipeline stage's ranks as megatron-core's expert rank generator
does ("MoE parallel folding": RankGenerator(tp=etp, ep, dp=edp, cp=1) on the same ranks). With
experts whole on each rank (expert tensor parallelism 1) under sequence parallelism each tp rank
routes its own tokens, and the ranks of a stage, in tp-cp-dp order (tp fastest), are cut into EP
groups of ep consecutive ranks; the expert-data-parallel group is the ranks at the same place in
each. An EP group may so span tp, cp and dp ranks (ep divides dp x cp x tp, not dp alone):
DeepSeek-V3's TP2 EP64 on 32 dp ranks. Where tp splits the experts (etp = tp), or without sequence
parallelism (every tp rank routes the same tokens), the folding runs over cp-dp for each tp index
(``edp_tp`` = 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from simulator.errors import UserError

DEFAULT_ORDER = "tp-cp-ep-dp-pp"
_DIMS = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class Mesh:
    tp: int
    cp: int
    ep: int
    dp: int  # the whole data-parallel degree
    pp: int
    order: str = DEFAULT_ORDER
    # Tensor-parallel ranks that route their own tokens through the same experts (plan.edp_tp_of:
    # tp for a MoE model under sequence parallelism with etp 1, else 1). They join the expert folding.
    edp_tp: int = 1

    def __post_init__(self) -> None:
        dims = self.order.split("-")
        if sorted(dims) != sorted(_DIMS):
            raise UserError(
                f"mesh order {self.order!r} must name each of tp, cp, ep, dp, pp once, innermost first "
                f"(default {DEFAULT_ORDER})"
            )
        if self.edp_tp not in (1, self.tp):
            raise ValueError(f"edp_tp={self.edp_tp} must be 1 or tp={self.tp}")
        if self.expert_ranks % self.ep:
            raise UserError(
                f"ep={self.ep} must divide the {self.expert_ranks} ranks of a pipeline stage that route tokens to "
                f"experts ({self.expert_ranks_formula}): choose an ep that divides {self.expert_ranks}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_ranks(self) -> int:
        """Ranks of one pipeline stage (of one tp index without sequence parallelism) that route
        their own tokens to the experts: the ranks the EP and expert-data-parallel groups fold over."""
        return self.dp * self.cp * self.edp_tp

    @property
    def expert_ranks_formula(self) -> str:
        return f"dp x cp{' x tp' if self.edp_tp > 1 else ''} = {self.dp} x {self.cp}" + (
            f" x {self.tp}" if self.edp_tp > 1 else "")

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the ranks that hold the same experts (dp x cp x edp_tp / ep;
        megatron-core: world / (etp x ep x pp))."""
        return self.expert_ranks // self.ep

    @property
    def ep_dp_span(self) -> int:
        """Data-parallel indices one EP group's ranks reach together: an EP group of ep consecutive
        ranks over cp x edp_tp ranks a dp index ties lcm(ep, cp x edp_tp) / (cp x edp_tp) of them."""
        inner = self.cp * self.edp_tp
        return math.lcm(self.ep, inner) // inner

    @cached_property
    def _sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}

    @cached_property
    def grid(self) -> np.ndarray:
        """grid[pp, dp, cp, tp] = global rank."""
        dims = list(reversed(self.order.split("-")))  # outermost first
        arr = np.arange(self.world_size).reshape([self._sizes[d] for d in dims])
        axes = [dims.index(d) for d in ("pp", "dp", "cp", "tp", "ep")]
        return np.ascontiguousarray(arr.transpose(axes)[..., 0])

    @cached_property
    def expert_grid(self) -> np.ndarray:
        """expert_grid[pp, t, edp, ep] = global rank, t the tp index where tp ranks route the same
        tokens (edp_tp = 1; size 1 otherwise): a stage's ranks in tp-cp-dp order (tp fastest),
        cut into EP groups of ep consecutive ranks (megatron-core's expert rank generator with
        etp = 1 and the default order)."""
        t = self.tp // self.edp_tp
        g = self.grid.reshape(self.pp, self.dp, self.cp, t, self.edp_tp).transpose(0, 3, 1, 2, 4)
        return np.ascontiguousarray(g.reshape(self.pp, t, self.edp, self.ep))

    def rank(self, *, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """Global rank of the data-parallel index dp and the rest."""
        return int(self.grid[pp, dp, cp, tp])

    @cached_property
    def coords(self) -> np.ndarray:
        """coords[rank] = (pp, dp, cp, tp, ep) with ep the rank's index in its EP group."""
        out = np.empty((self.world_size, 5), dtype=np.int64)
        g = self.grid
        idx = np.indices(g.shape).reshape(4, -1).T  # pp, dp, cp, tp
        out[g.reshape(-1), :4] = idx
        e = self.expert_grid
        out[e.reshape(-1), 4] = np.indices(e.shape)[3].reshape(-1)
        return out

    def groups(self, dim: str) -> np.ndarray:
        """All groups of a dimension, shape (n_groups, group_size), ranks in group order.

        dim: tp, cp, dp (dense data parallel), pp; dp-cp: dp with the context-parallel ranks (the
        dense gradient reduction's); ep and edp: the expert folding's (``expert_grid``).
        """
        g = self.grid  # pp, dp, cp, tp
        if dim == "tp":
            return g.reshape(-1, self.tp)
        if dim == "cp":
            return g.transpose(0, 1, 3, 2).reshape(-1, self.cp)
        if dim == "dp":
            return g.transpose(0, 2, 3, 1).reshape(-1, self.dp)
        if dim == "pp":
            return g.transpose(1, 2, 3, 0).reshape(-1, self.pp)
        # The ranks that hold the same parameters and reduce their gradients together: context-
        # parallel ranks see other tokens of the same sequences, so they join the data-parallel
        # reduction (megatron-core's dp_cp_group: get_data_parallel_group(with_context_parallel=
        # True) for DDP and the distributed optimizer; torchtitan 0.3.0 parallel_dims.py: the
        # "fsdp" mesh is dp_shard x cp). cp varies fastest.
        if dim == "dp-cp":
            return g.transpose(0, 3, 1, 2).reshape(-1, self.dp * self.cp)
        if dim == "ep":
            return self.expert_grid.reshape(-1, self.ep)
        # The ranks that hold the same experts and reduce their gradients together (megatron-core
        # 0.16.1: expert_data_parallel_size = world // (etp x ep x pp); torchtitan 0.3.0
        # parallel_dims.py: efsdp = dp_shard x cp x tp / ep). In tp-cp-dp order: a member's
        # neighbours in the group are the ranks ep places on.
        if dim == "edp":
            return self.expert_grid.transpose(0, 1, 3, 2).reshape(-1, self.edp)
        raise ValueError(f"unknown mesh dimension {dim!r}")


@dataclass(frozen=True)
class Placement:
    """Mesh ranks -> GPU ids: GPUs are numbered node by node, and ranks are laid on them in
    ``order`` (innermost first; default the mesh's own, Megatron's tp-cp-ep-dp-pp, so a TP
    group fills consecutive GPUs of one node).

    ``domain_gpus``: GPUs of one NVLink domain (8 in a DGX, 72 in a GB200 NVL72 rack). When the
    innermost block of the order (e.g. a TP group of 16) does not divide the domain, a domain
    holds as many whole blocks as fit and its remaining GPUs stay idle (a TP16 job on NVL72
    racks uses 64 of each rack's 72 GPUs), so no such group straddles two domains.
    """

    mesh: Mesh
    order: str | None = None
    domain_gpus: int | None = None

    @cached_property
    def _ordered_gpu(self) -> np.ndarray:
        order = self.order or self.mesh.order
        if order == self.mesh.order:
            return np.arange(self.mesh.world_size)
        m = self.mesh
        other = Mesh(m.tp, m.cp, m.ep, m.dp, m.pp, order, m.edp_tp)
        c = m.coords  # pp, dp, cp, tp, ep
        return other.grid[c[:, 0], c[:, 1], c[:, 2], c[:, 3]]

    @cached_property
    def ranks_per_domain(self) -> int:
        """Ranks laid on one NVLink domain: whole innermost blocks, as many as fit."""
        D = self.domain_gpus
        if not D:
            return self.mesh.world_size
        # The block NVLink should hold: the innermost dims of the order up to the outermost
        # model-parallel one (tp, cp), as far as they fit in the domain.
        m = self.mesh
        dims = [d for d in (self.order or m.order).split("-") if d != "ep"]
        last = max(i for i, d in enumerate(dims) if d in ("tp", "cp"))
        block = 1
        for dim in dims[: last + 1]:
            size = m._sizes[dim]
            if block * size > D:
                break
            block *= size
        # And whole EP groups where they lie on consecutive ranks (tp and cp innermost, dp next):
        # ep consecutive ranks of the tp-cp-dp folding (Mesh.expert_grid), on each tp index's
        # ranks where tp ranks route the same tokens.
        if m.ep > 1 and set(dims[:2]) == {"tp", "cp"} and dims[2] == "dp":
            ep_block = math.lcm(m.tp * m.cp, m.ep * (m.tp // m.edp_tp))
            if ep_block <= D:
                block = ep_block
        return D // block * block

    @cached_property
    def gpu_of_rank(self) -> np.ndarray:
        slot = self._ordered_gpu
        R, D = self.ranks_per_domain, self.domain_gpus
        if not D or R == D:
            return slot
        return slot // R * D + slot % R

    @property
    def gpus_spanned(self) -> int:
        """GPU ids the job reaches (idle GPUs of partly used domains included)."""
        return int(self.gpu_of_rank.max()) + 1

    @property
    def is_identity(self) -> bool:
        return bool((self.gpu_of_rank == np.arange(self.mesh.world_size)).all())

    def groups(self, dim: str) -> np.ndarray:
        """The mesh's groups of a dimension as GPU ids, shape (n_groups, group_size)."""
        return self.gpu_of_rank[self.mesh.groups(dim)]

    def check_fits(self, n_gpus: int, gpus_per_node: int | None = None, dims_in_node: tuple[str, ...] = ()) -> None:
        """UserError if the mesh needs more GPUs than there are, or a dimension that must stay
        inside a node (e.g. tp) does not."""
        if self.mesh.world_size > n_gpus:
            raise UserError(
                f"the mesh needs {self.mesh.world_size} GPUs (tp x cp x dp x pp) but the cluster has {n_gpus}: "
                "add GPUs or shrink the parallel degrees"
            )
        for dim in dims_in_node:
            g = self.groups(dim)
            if gpus_per_node and (g // gpus_per_node != (g[:, :1] // gpus_per_node)).any():
                raise UserError(
                    f"{dim} groups of size {g.shape[1]} leave the {gpus_per_node}-GPU node under placement order "
                    f"{self.order or self.mesh.order!r}: use {dim} <= {gpus_per_node} and put {dim} first in the order"
                )


class PlacedNetwork:
    """A network seen through a placement: the engine names mesh ranks, the wrapped network
    (built for ``placement.gpus_spanned`` GPUs) GPU ids."""

    def __init__(self, base, placement: Placement):
        self.base = base
        self.gpu_of_rank = placement.gpu_of_rank
        # id(request) -> (request, mapped request): the engine issues the same request objects
        # again and again, and the fabric caches its plans per request object, so a request
        # must map to the same object every time (the original is held so its id stays its own).
        self._mapped: dict[int, tuple] = {}

    def _map(self, req):
        hit = self._mapped.get(id(req))
        if hit is not None and hit[0] is req:
            return hit[1]
        from dataclasses import replace

        mapped = replace(req, groups=self.gpu_of_rank[np.asarray(req.groups)])
        if len(self._mapped) >= 65536:  # a caller making a new request per call: only misses, bounded
            self._mapped.clear()
        self._mapped[id(req)] = (req, mapped)
        return mapped

    def collective_time_s(self, req) -> float:
        return self.base.collective_time_s(self._map(req))

    def start(self, env, req):
        return self.base.start(env, self._map(req))

    # Defined here, not forwarded by __getattr__: the wrapped network names GPUs, not ranks.
    def links_of(self, req):
        return self.base.links_of(self._map(req))

    def run_closed_form(self, env, req, t0_s: float):
        return self.base.run_closed_form(env, self._map(req), t0_s)

    def __getattr__(self, name: str):
        return getattr(self.base, name)
