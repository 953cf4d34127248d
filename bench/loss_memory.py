"""What torchtitan's loss, F.cross_entropy(pred.flatten(0, 1).float(), labels), keeps for its backward
and holds at its peaks: eager and under torch.compile, plain and under tensor parallelism's
loss_parallel (vocab-sharded DTensor logits, 2 gloo ranks). Bytes a (local) logit.

Source of simulator.workload.memory.loss_bytes_per_logit. Runs real torch on CPU (inductor needs a
C compiler): large tensors come from mmap, so the process's resident size follows the live bytes;
the peaks are the resident high-water mark over the bf16 logits. torch.compile's partition of
forward and backward (what is saved) is made before code generation, on fake tensors, and is the
same for CPU and CUDA; the code generated for each is not.

    python bench/loss_memory.py [--tokens 16384] [--vocab 32768]

Measured (torch 2.13 CPU, 16,384 x 32,768 logits; loss_parallel 8,192 x 32,768 over 2 ranks):
                    kept  fwd peak  bwd peak   (over the bf16 logits, which the loss may keep)
  eager             4.0     8.0      12.0
  compiled          0.0     0.1       2.0     (keeps the bf16 logits themselves)
  tp eager          4.1    12.0      16.1
  tp compiled       0.3-4.3 kept over five runs and sizes, fwd peak = kept + 4 in every one
The tp compiled loss keeps an fp32 [tokens, vocab/tp] tensor (saved_tensors_hooks lists it), which
shows in the resident set in some runs only; memory.loss_bytes_per_logit takes the kept 4 from that
list and the forward's 4 more beside it (and the bf16 logits, 2).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

_COMMON = r"""
import sys, torch
def ce(pred, labels):
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
def reset_peak():  # Linux: "5" resets the resident high-water mark (VmHWM), so earlier peaks drop out
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
"""

# One process. No warm-up: compiling traces on fake tensors and allocates no logits, and a warm-up
# would leave its own high-water mark above the measured run's.
_PLAIN = _COMMON + r"""
mode, N, V = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fn = torch.compile(ce) if mode == "compiled" else ce
pred = torch.randn(1, N, V, dtype=torch.bfloat16, requires_grad=True)
labels = torch.randint(0, V, (1, N))
r0 = rss()
reset_peak()
loss = fn(pred, labels)
held, pk_fwd = rss() - r0, peak() - r0
loss.backward()
print(held / (N * V), pk_fwd / (N * V), (peak() - r0) / (N * V))
"""

_TP = _COMMON + r"""
import os
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

def run(rank, world, mode, N, V):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    fn = torch.compile(ce) if mode == "compiled" else ce
    torch.manual_seed(0)
    pred = distribute_tensor(torch.randn(1, N, V, dtype=torch.bfloat16), mesh, [Shard(2)]).detach().requires_grad_(True)
    labels = torch.randint(0, V, (1, N))
    local = N * V // world
    r0 = rss()
    reset_peak()  # the whole logits tensor existed before: its high-water mark must not count
    with loss_parallel():
        loss = fn(pred, labels)
        held, pk_fwd = rss() - r0, peak() - r0
        loss.backward()
    if rank == 0:
        print(held / local, pk_fwd / local, (peak() - r0) / local, flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.start_processes(run, args=(2, sys.argv[1], int(sys.argv[2]), int(sys.argv[3])), nprocs=2, start_method="fork")
"""


def measure(code: str, mode: str, tokens: int, vocab: int) -> tuple[float, float, float]:
    # A fixed mmap threshold: glibc otherwise raises it (up to 32 MiB) as blocks are freed, and freed
    # heap blocks stay resident. The logits here are larger anyway; smaller runs need it.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    out = subprocess.run([sys.executable, "-c", code, mode, str(tokens), str(vocab)],
                         capture_output=True, text=True, check=True, env=env).stdout.split()
    held, fwd, bwd = (float(x) for x in out[-3:])
    return held, fwd, bwd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args()
    print(f"{'loss':12s} {'kept':>6s} {'fwd peak':>9s} {'bwd peak':>9s} {'fwd peak-kept':>14s}"
          "  (bytes a local logit over the bf16 logits)")
    for label, code, tokens in (("eager", _PLAIN, args.tokens), ("compiled", _PLAIN, args.tokens),
                                ("tp eager", _TP, args.tokens // 2), ("tp compiled", _TP, args.tokens // 2)):
        held, fwd, bwd = measure(code, label.split()[-1], tokens, args.vocab)
        print(f"{label:12s} {held:6.2f} {fwd:9.2f} {bwd:9.2f} {fwd - held:14.2f}", flush=True)


if __name__ == "__main__":
    main()
