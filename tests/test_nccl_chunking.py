"""NCCL's runtime chunking (simulator.network.nccl.chunking): calcCollChunking as NCCL-MODEL.md §4.4
documents it, worked by hand here, and how the model uses it (the network steps beyond a
channel's first loop, and Tree/LL128's size dependence across nodes)."""

from __future__ import annotations

import math

import pytest

from simulator.network.nccl import TREE_CORRECTION, NcclModel, NcclSystem, NcclTuning, chunking
from simulator.topology.spec import load_topology


def test_first_chunk_per_protocol():
    """§4.4 / §1.3: one step of each protocol's buffer (4 MiB Simple, 512 KiB LL, 4,915,200 B LL128,
    8 steps each), Ring/Simple AllReduce 4 steps; LL carries half its step as data, LL128 15/16."""
    big = 1 << 30  # large enough that no rule shrinks the chunk
    assert chunking("ring", "Simple", "all_reduce", big, 8, 1, 8).chunk_bytes == 2 << 20
    assert chunking("ring", "Simple", "broadcast", big, 8, 1, 8).chunk_bytes == 512 << 10
    assert chunking("tree", "Simple", "all_reduce", big, 16, 2, 8).chunk_bytes == 512 << 10
    assert chunking("ring", "LL", "all_reduce", big, 8, 1, 8).chunk_bytes == 32 << 10
    assert chunking("ring", "LL128", "all_reduce", big, 8, 1, 8).chunk_bytes == 576000  # 614,400 x 15/16, 300 grains


@pytest.mark.parametrize("per_channel, n, nodes, chunk", [
    # 4 nodes x 8 GPUs: nstepsLL128 = 1 + log2(4) + 0.1 x 8 = 3.8; halve (floor 128 KiB) while
    # bytes/chunk < 3.8 x 64/8 = 30.4, then (floor 32 KiB) while < 3.8 x 16/8 = 7.6.
    # 4 MiB over 16 channels = 262,144 B: 576,000 -> 72,000 (first rule), 262,144/72,000 = 3.6 and
    # 262,144/36,000 = 7.3 < 7.6 -> 18,000, rounded down to the 1,920 B grain: 9 grains.
    (262144, 32, 4, 9 * 1920),
    # 8 MiB: 524,288/36,000 = 14.6 >= 7.6 -> 36,000 -> 18 grains: the chunk doubles at 8 MiB.
    (524288, 32, 4, 18 * 1920),
    # 16 MiB: 1,048,576/72,000 = 14.6 -> 72,000 -> 37 grains.
    (1048576, 32, 4, 37 * 1920),
    # 128 MiB: 8,388,608/144,000 = 58 >= 30.4 -> 144,000 = 75 grains exactly.
    (8388608, 32, 4, 144000),
    # 2 nodes x 8 GPUs: 1 + 1 + 0.8 = 2.8 -> thresholds 22.4 and 5.6; 4 MiB over 16 channels:
    # 262,144/72,000 = 3.6 -> 36,000; 262,144/36,000 = 7.3 >= 5.6 stays -> 18 grains.
    (262144, 16, 2, 18 * 1920),
])
def test_tree_ll128_chunk_rule(per_channel, n, nodes, chunk):
    c = chunking("tree", "LL128", "all_reduce", per_channel, n, nodes, n // nodes)
    assert c.chunk_bytes == chunk
    assert c.loops == math.ceil(per_channel / chunk) and c.proxy_steps == c.loops and c.steps_per_loop == 1


def test_ring_loops_and_proxy_steps():
    """§4.4: a ring loop moves nRanks chunks per channel; the proxy runs 2(n-1) x loops x chunkSteps
    steps for AllReduce (chunkSteps 4 for Simple, 1 for LL/LL128), (n-1) x ... for AllGather."""
    c = chunking("ring", "Simple", "all_reduce", 64 << 20, 16, 2, 8)  # 64 MiB / (16 x 2 MiB) = 2 loops
    assert (c.loops, c.proxy_steps, c.steps_per_loop) == (2, 2 * 15 * 2 * 4, 15 * 2 * 4)
    c = chunking("ring", "LL128", "all_gather", 20 * 16 * 576000, 16, 2, 8)
    assert (c.loops, c.proxy_steps) == (20, 15 * 20)
    # a share smaller than one loop still takes one loop: no step beyond it
    c = chunking("ring", "LL", "all_reduce", 1000, 8, 1, 8)
    assert c.loops == 1 and c.proxy_steps == c.steps_per_loop


def _ndv4():
    return NcclSystem.from_specs(load_topology("azure-ndv4").node, "A100-SXM4-40GB")


def test_network_steps_beyond_the_first_loop_cost_net_step_us():
    """Across nodes every step after a channel's first loop costs net_step_us; inside one node
    (no proxy) nothing; NCCL's own model (net_step_us 0) is unchanged."""
    sys_ = _ndv4()
    base, stepped = NcclModel(sys_), NcclModel(sys_, NcclTuning(net_step_us=2.0))
    size = 4 << 20
    c0, c1 = base.choose("all_reduce", size, 32, 4), stepped.choose("all_reduce", size, 32, 4)
    assert (c0.algorithm, c0.protocol) == (c1.algorithm, c1.protocol) == ("tree", "LL128")
    ck = chunking("tree", "LL128", "all_reduce", size / c1.channels, 32, 4, 8)
    assert c1.chunk_bytes == ck.chunk_bytes == 17280 and c1.net_steps == ck.loops - 1 == 15
    assert c1.step_cost_us == pytest.approx(2.0 * 15)
    assert c1.time_us - c0.time_us == pytest.approx(2.0 * 15)
    assert c0.step_cost_us == 0.0
    one = stepped.choose("all_reduce", 1 << 30, 8, 1)
    assert one.net_steps == 0 and one.step_cost_us == 0.0


def test_runtime_chunking_replaces_the_tree_correction_for_ll128_only():
    """With runtime_chunking Tree/LL128 across nodes drops the tuner's size correction (§1.9):
    its bandwidth term is the table's times the correction factor; other pairs are unchanged."""
    sys_ = _ndv4()
    tuner, runtime = NcclModel(sys_), NcclModel(sys_, NcclTuning(runtime_chunking=True))
    size = 4 << 20
    a, b = tuner.choose("all_reduce", size, 32, 4), runtime.choose("all_reduce", size, 32, 4)
    corr = TREE_CORRECTION["LL128"][int(math.log2(size / 64))]
    assert corr == 0.8
    assert b.table[("tree", "LL128")] - a.latency_us == pytest.approx((a.table[("tree", "LL128")] - a.latency_us) * corr)
    assert b.table[("tree", "Simple")] == pytest.approx(a.table[("tree", "Simple")])
    assert b.table[("ring", "LL128")] == pytest.approx(a.table[("ring", "LL128")])
    # inside one node the tuner's table stays
    assert runtime.choose("all_reduce", size, 8, 1).table == pytest.approx(tuner.choose("all_reduce", size, 8, 1).table)
