"""What torchtitan's per-op SAC keeps, measured with real torch, against the memory model
(``simulator.workload.program.selective_op_saved_bytes``).

A Llama-shaped block (RMSNorm, wq wk wv wo, SDPA causal, w1 w3 w2 SwiGLU; narrow widths so the
CPU runs it) under ``torch.utils.checkpoint`` with torchtitan's policy: save every aten.mm output
except every second one per layer, and the SDPA flash outputs (the CPU's flash op stands in for
CUDA's). Four layers are run forward at several sequence lengths, each in a fresh process with
MALLOC_MMAP_THRESHOLD_ fixed at 64 KiB so freed blocks leave the resident set; the slope of the
resident bytes over tokens is the bytes kept per token (fixed costs, such as the first call's
library workspaces, fall out). The first layer's input exists before the measurement and the last
layer's output after it (the input a fifth layer would keep): one block input per layer, as the
model counts them.

    python bench/sac_memory.py

Measured (torch 2.13 CPU, h 1024, FFN 3584, 8 query heads and 2 KV heads of 128, 1,024-4,096
tokens): 15,902 and 15,911 B a token a layer in two runs, against the model's 15,904 (within 0.05%).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
H, FFN, NH, NKV, HD, LAYERS = 1024, 3584, 8, 2, 128, 4

_CHILD = r"""
import sys, torch, torch.nn as nn, torch.nn.functional as F
from functools import partial
from collections import defaultdict
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, CheckpointPolicy
H, FFN, NH, NKV, HD, L = (int(x) for x in sys.argv[2:8])
T = int(sys.argv[1])
torch.manual_seed(0)
SAVE = {torch.ops.aten.mm.default, torch.ops.aten.linear.default, torch.ops.aten.max.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default}
MM = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)

def policy():
    count = defaultdict(int)
    def pol(ctx, func, *a, **k):
        key = "recompute" if ctx.is_recompute else "forward"
        if func in MM:
            count[key] += 1
        save = func in SAVE and not (func in MM and count[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return pol

class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.n1, s.n2 = nn.RMSNorm(H), nn.RMSNorm(H)
        lin = lambda i, o: nn.Linear(i, o, bias=False)
        s.wq, s.wk, s.wv, s.wo = lin(H, NH * HD), lin(H, NKV * HD), lin(H, NKV * HD), lin(NH * HD, H)
        s.w1, s.w3, s.w2 = lin(H, FFN), lin(H, FFN), lin(FFN, H)
    def _f(s, x):
        b, t, _ = x.shape
        h = s.n1(x)
        q = s.wq(h).view(b, t, NH, HD).transpose(1, 2)
        k = s.wk(h).view(b, t, NKV, HD).transpose(1, 2).repeat_interleave(NH // NKV, dim=1)
        v = s.wv(h).view(b, t, NKV, HD).transpose(1, 2).repeat_interleave(NH // NKV, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, NH * HD)
        x = x + s.wo(o)
        h = s.n2(x)
        return x + s.w2(F.silu(s.w1(h)) * s.w3(h))
    def forward(s, x):
        return checkpoint(s._f, x, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, policy()))

blocks = nn.ModuleList(Block() for _ in range(L)).to(torch.bfloat16)
x = torch.randn(1, T, H, dtype=torch.bfloat16, requires_grad=True)
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
r0 = rss()
y = x
for blk in blocks:
    y = blk(y)
print(rss() - r0)
"""


def measured_bytes(tokens: int) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tokens), *map(str, (H, FFN, NH, NKV, HD, LAYERS))],
                         capture_output=True, text=True, check=True, env=env).stdout.split()
    return int(out[-1])


def model_bytes_per_token(tokens: int) -> float:
    sys.path.insert(0, str(ROOT))
    from simulator.scenario import build_scenario
    from simulator.workload.memory import activation_bytes_per_layer

    sc = build_scenario({
        "model": {"name": "sac-probe", "num_layers": LAYERS, "hidden_size": H, "ffn_hidden_size": FFN,
                  "num_attention_heads": NH, "num_kv_heads": NKV, "head_dim": HD, "vocab_size": 32000, "mlp": "swiglu"},
        "framework": "torchtitan", "recompute": "selective-op", "parallelism": {"tp": 1, "pp": 1, "dp": 1},
        "batch": {"micro_batch_size": 1, "global_batch_size": 1, "seq_length": tokens},
        "cluster": {"gpus": 1, "gpu": "h100-sxm-80gb", "topology": "dgx-h100-fattree"}})
    return activation_bytes_per_layer(sc) / tokens


def main() -> None:
    sizes = (1024, 2048, 3072, 4096)
    held = [measured_bytes(t) for t in sizes]
    for t, b in zip(sizes, held):
        print(f"{t:6d} tokens: {b / 2**20:8.1f} MiB held after forward of {LAYERS} layers")
    slope = (held[-1] - held[0]) / (sizes[-1] - sizes[0]) / LAYERS
    model = model_bytes_per_token(sizes[0])
    print(f"kept a token a layer: measured {slope:,.0f} B, model {model:,.0f} B ({model / slope - 1:+.2%})")


if __name__ == "__main__":
    main()
