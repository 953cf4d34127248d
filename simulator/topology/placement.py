"""Rank <-> parallel coordinates, from one reshaped array (as picotron does).

The mesh order lists dimensions innermost first. Megatron's default ``tp-cp-ep-dp-pp`` keeps a
TP group on consecutive GPU ids, i.e. inside one node. Expert parallelism is carved out of the
data-parallel dimension (dp = ep x edp), as in Megatron: the dense DP group spans ep and edp.
"""

from __future__ import annotations

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
    dp: int  # the whole data-parallel degree, ep included
    pp: int
    order: str = DEFAULT_ORDER

    def __post_init__(self) -> None:
        dims = self.order.split("-")
        if sorted(dims) != sorted(_DIMS):
            raise UserError(
                f"mesh order {self.order!r} must name each of tp, cp, ep, dp, pp once, innermost first "
                f"(default {DEFAULT_ORDER})"
            )
        if self.dp % self.ep:
            raise UserError(f"ep={self.ep} must divide dp={self.dp}: experts are sharded over data-parallel ranks")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    @cached_property
    def _sizes(self) -> dict[str, int]:
        # "dp" in the order string is the expert-data-parallel part (dp / ep).
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": self.edp, "pp": self.pp}

    @cached_property
    def grid(self) -> np.ndarray:
        """grid[pp, edp, ep, cp, tp] = global rank."""
        dims = self.order.split("-")
        shape = [self._sizes[d] for d in reversed(dims)]  # outermost first
        arr = np.arange(self.world_size).reshape(shape)
        axes = [list(reversed(dims)).index(d) for d in ("pp", "dp", "ep", "cp", "tp")]
        return np.ascontiguousarray(arr.transpose(axes))

    def rank(self, *, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """Global rank of the data-parallel index dp (0..dp-1, ep included) and the rest."""
        ep, edp = dp % self.ep, dp // self.ep
        return int(self.grid[pp, edp, ep, cp, tp])

    @cached_property
    def coords(self) -> np.ndarray:
        """coords[rank] = (pp, dp, cp, tp, ep) with dp the full data-parallel index."""
        out = np.empty((self.world_size, 5), dtype=np.int64)
        g = self.grid
        idx = np.indices(g.shape).reshape(5, -1).T  # pp, edp, ep, cp, tp
        ranks = g.reshape(-1)
        out[ranks, 0] = idx[:, 0]
        out[ranks, 1] = idx[:, 1] * self.ep + idx[:, 2]
        out[ranks, 2] = idx[:, 3]
        out[ranks, 3] = idx[:, 4]
        out[ranks, 4] = idx[:, 2]
        return out

    def groups(self, dim: str) -> np.ndarray:
        """All groups of a dimension, shape (n_groups, group_size), ranks in group order.

        dim: tp, cp, ep, dp (dense data parallel: ep x edp), edp (expert data parallel), pp;
        dp-cp and edp-cp: those two with the context-parallel ranks (the gradient reduction's);
        edp-cp-tp: edp-cp with the tensor-parallel ranks too (experts that tp does not split).
        """
        g = self.grid  # pp, edp, ep, cp, tp
        if dim == "tp":
            return g.reshape(-1, self.tp)
        if dim == "cp":
            return g.transpose(0, 1, 2, 4, 3).reshape(-1, self.cp)
        if dim == "ep":
            return g.transpose(0, 1, 3, 4, 2).reshape(-1, self.ep)
        if dim == "edp":
            return g.transpose(0, 2, 3, 4, 1).reshape(-1, self.edp)
        if dim == "dp":
            # dp index = edp * ep + ep_index: ep varies fastest inside a DP group
            return g.transpose(0, 3, 4, 1, 2).reshape(-1, self.dp)
        if dim == "pp":
            return g.transpose(1, 2, 3, 4, 0).reshape(-1, self.pp)
        # The ranks that hold the same parameters and reduce their gradients together: context-
        # parallel ranks see other tokens of the same sequences, so they join the data-parallel
        # reduction (megatron-core's dp_cp_group: get_data_parallel_group(with_context_parallel=
        # True) for DDP and the distributed optimizer; torchtitan 0.3.0 parallel_dims.py: the
        # "fsdp" mesh is dp_shard x cp, "efsdp" dp_shard x cp x tp / ep). cp varies fastest.
        if dim == "dp-cp":
            return g.transpose(0, 4, 1, 2, 3).reshape(-1, self.dp * self.cp)
        if dim == "edp-cp":
            return g.transpose(0, 2, 4, 1, 3).reshape(-1, self.edp * self.cp)
        # Experts with expert tensor parallelism 1 (tp does not split them) under sequence
        # parallelism: every tp rank holds all the experts of its ep index and routes its own
        # tokens through them, so the ranks holding the same experts are the dp / ep x cp x tp
        # ranks of one (pp, ep) index (megatron-core 0.16.1 parallel_state.initialize_model_parallel:
        # expert_data_parallel_size = world_size // (expert_tensor_parallel_size x
        # expert_model_parallel_size x pp); torchtitan 0.3.0 parallel_dims.py: efsdp = dp_shard x
        # cp x tp / ep). tp varies fastest, then cp: a member's neighbours in the group are its
        # tp peers, on consecutive GPUs of one node under the default order. With tp = 1 this is
        # the "edp-cp" array.
        if dim == "edp-cp-tp":
            return g.transpose(0, 2, 1, 3, 4).reshape(-1, self.edp * self.cp * self.tp)
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
        other = Mesh(self.mesh.tp, self.mesh.cp, self.mesh.ep, self.mesh.dp, self.mesh.pp, order)
        c = self.mesh.coords  # pp, dp, cp, tp, ep
        ep, edp = c[:, 1] % self.mesh.ep, c[:, 1] // self.mesh.ep
        return other.grid[c[:, 0], edp, ep, c[:, 2], c[:, 3]]

    @cached_property
    def ranks_per_domain(self) -> int:
        """Ranks laid on one NVLink domain: whole innermost blocks, as many as fit."""
        D = self.domain_gpus
        if not D:
            return self.mesh.world_size
        # The block NVLink should hold: the innermost dims of the order up to the outermost
        # model-parallel one (tp, cp, ep), as far as they fit in the domain.
        dims = (self.order or self.mesh.order).split("-")
        last = max(i for i, d in enumerate(dims) if d in ("tp", "cp", "ep"))
        block = 1
        for dim in dims[: last + 1]:
            size = self.mesh._sizes[dim]
            if block * size > D:
                break
            block *= size
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
