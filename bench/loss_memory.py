"""What torchtitan's loss, F.cross_entropy(pred.flatten(0, 1).float(), labels), keeps for its backward
and holds at its peaks, eager and under torch.compile: live bytes per logit over the bf16 logits.

Source of simulator.workload.memory.loss_bytes_per_logit. Runs real torch (CPU; inductor needs a C
compiler): large tensors come from mmap, so the process's resident size follows the live bytes.
torch.compile's partition of forward and backward (what is saved) is made before code generation
and is the same for CPU and CUDA; the code generated for each is not.

    python bench/loss_memory.py [--tokens 16384] [--vocab 32768]

Measured (torch 2.13 CPU, 16,384 x 32,768 logits): eager keeps 4.0 B/logit after forward, peaks
at 8.0 in forward and 12.0 in backward; compiled keeps 0.0 beyond the logits it saves (2), peaks at
0.1 in forward and 2.0 in backward (the bf16 gradient).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

_CHILD = r"""
import resource, sys, torch
mode, N, V = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def ce(pred, labels):
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
fn = torch.compile(ce) if mode == "compiled" else ce
if mode == "compiled":  # compile first, on a smaller batch of the same vocabulary
    p = torch.randn(1, N // 4, V, dtype=torch.bfloat16, requires_grad=True)
    fn(p, torch.randint(0, V, (1, N // 4))).backward()
    del p
pred = torch.randn(1, N, V, dtype=torch.bfloat16, requires_grad=True)
labels = torch.randint(0, V, (1, N))
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
r0 = rss()
loss = fn(pred, labels)
held, pk_fwd = rss() - r0, peak() - r0
loss.backward()
print(held / (N * V), pk_fwd / (N * V), (peak() - r0) / (N * V))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args()
    print(f"{'loss':9s} {'kept after fwd':>15s} {'fwd peak':>9s} {'bwd peak':>9s}  (bytes a logit over the bf16 logits)")
    for mode in ("eager", "compiled"):
        out = subprocess.run([sys.executable, "-c", _CHILD, mode, str(args.tokens), str(args.vocab)],
                             capture_output=True, text=True, check=True).stdout.split()
        held, fwd, bwd = (float(x) for x in out[-3:])
        print(f"{mode:9s} {held:15.2f} {fwd:9.2f} {bwd:9.2f}")


if __name__ == "__main__":
    main()
