#!/usr/bin/env bash
# One prepared device check for issue 14's last item: capture a real training step of a small
# Llama on the device's GPU(s), calibrate a profile from it, and validate the simulator against
# it with both the calibrated and the spec profile. Everything it makes lands under $OUT (the
# device tool's folder; at most 8 files come back), so a session lent a GPU runs, from here:
#
#   bench/device/fetch_wheels.sh            # once, here: the wheels the device image lacks
#   run(command="bash bench/device/capture_h200.sh", carry=[".whl"], timeout_s=540)
#
# and then calibrates and validates from the returned bundles here (no GPU needed), and ships the
# profile as simulator/data/profiles/<gpu>-captured.json with its provenance. Dry run on a CPU (gloo, tiny sizes, no
# wheels): DRY=1 OUT=/tmp/dev-out bash bench/device/capture_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder the results go to}"
mkdir -p "$OUT"
LOG="$OUT/log.txt"
WORK=$(mktemp -d)
exec > >(tee -a "$LOG") 2>&1
if [ -z "${DRY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed: run bench/device/fetch_wheels.sh here and carry .whl"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi --query-gpu=name,memory.total,power.limit,clocks.max.sm,driver_version --format=csv > "$OUT/gpu.csv" || true
  BACKEND=nccl
  NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
  # A small Llama (SwiGLU, RMSNorm, GQA) big enough that kernels are not launch-bound.
  MODEL="--num-layers 8 --hidden-size 2048 --num-heads 16 --num-kv-heads 4 --ffn-hidden-size 5632 --vocab-size 32000 --mlp swiglu"
  BATCH="--seq-length 2048 --micro-batch-size 4"
  DTYPE=bf16; STEPS=3; WARM=2
  COMPUTE="--hidden-sizes 1024,2048,4096 --tokens 2048,8192 --min-time-s 0.05"
else
  export PYTHONPATH=$PWD
  BACKEND=gloo; NGPU=1
  MODEL="--num-layers 2 --hidden-size 64 --num-heads 4 --num-kv-heads 2 --ffn-hidden-size 128 --vocab-size 256 --mlp swiglu"
  BATCH="--seq-length 32 --micro-batch-size 2"
  DTYPE=fp32; STEPS=2; WARM=1
  COMPUTE="--hidden-sizes 64 --tokens 64 --tp-sizes 1 --vocab-sizes 256 --adamw-numels 4096 --min-time-s 0.01 --max-repeats 3"
fi
C="python3 -m simulator.cli"
date -u; echo "backend $BACKEND, $NGPU device(s)"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

step() {  # name, seconds, command...: one stage, time-limited, logged; the script goes on after a failure
  local name=$1 limit=$2; shift 2
  echo "== $name"; local t0=$(date +%s)
  timeout "$limit" "$@"; local rc=$?
  echo "== $name: exit $rc in $(( $(date +%s) - t0 )) s"
  return $rc
}

# 1. One GPU: the step's kernels (no collectives), a small Llama and Llama-3-8B's layer shapes
#    (8 of its 32 layers, 2 x 8192 tokens: torchtitan's 8B rows' local batch, without FSDP).
step train-1gpu 150 $C capture train --backend $BACKEND --nproc 1 --dtype $DTYPE $MODEL $BATCH \
  --global-batch-size 8 --steps $STEPS --warmup-steps $WARM --out "$WORK/train-1gpu"
if [ -z "${DRY:-}" ]; then
  step train-8b-layers 150 $C capture train --backend $BACKEND --nproc 1 --dtype $DTYPE \
    --num-layers 8 --hidden-size 4096 --num-heads 32 --num-kv-heads 8 --ffn-hidden-size 14336 \
    --vocab-size 128256 --mlp swiglu --seq-length 8192 --micro-batch-size 2 --global-batch-size 2 \
    --steps $STEPS --warmup-steps $WARM --out "$WORK/train-8b-layers"
fi
# 2. The op-level compute table (GEMM, attention, norms, optimizer) for the kernel model.
step compute 120 $C capture compute --backend $BACKEND --nproc 1 --dtype $DTYPE $COMPUTE --out "$WORK/compute"
# 3. NCCL collectives and a data-parallel step where the machine has several GPUs.
if [ "$NGPU" -ge 2 ]; then
  step collectives 120 $C capture collectives --backend $BACKEND --nproc "$NGPU" --out "$WORK/collectives"
  step train-dp 150 $C capture train --backend $BACKEND --nproc "$NGPU" --dtype $DTYPE $MODEL $BATCH \
    --steps $STEPS --warmup-steps $WARM --out "$WORK/train-dp"
fi
# 4. What the capture workloads do not take: FP8 against BF16 GEMMs, attention backends, the HBM
#    ceiling, and GEMM slowdown while a resident kernel holds N SMs (kernels_h200.py).
[ -z "${DRY:-}" ] && step kernels 180 python3 bench/device/kernels_h200.py "$OUT"
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv >> "$OUT/gpu.csv" 2>/dev/null || true
# 5. Calibration and validation need no GPU: they run afterwards from the bundles, anywhere:
#    clustersim calibrate <bundles> --out profile.json; clustersim validate <bundle> --profile ...
#    Each bundle is its own archive (16 MiB at most comes back per file; bigger ones are split).
for b in "$WORK"/*/; do
  name=$(basename "$b")
  tar czf "$OUT/$name.tgz" -C "$WORK" "$name"
  if [ "$(stat -c %s "$OUT/$name.tgz")" -gt 15000000 ]; then
    split -b 15000000 -d "$OUT/$name.tgz" "$OUT/$name.tgz.part" && rm "$OUT/$name.tgz"
  fi
done
ls -la "$OUT"; date -u
