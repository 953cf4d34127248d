#!/usr/bin/env bash
# One prepared device check for issue 14's last item: capture a real training step of a small
# Llama on the device's GPU(s), calibrate a profile from it, and validate the simulator against
# it with both the calibrated and the spec profile. Everything it makes lands under $OUT (the
# device tool's folder; at most 8 files come back), so a session lent a GPU runs, from here:
#
#   bench/device/fetch_wheels.sh            # once, here: the wheels the device image lacks
#   run(command="bash bench/device/capture_h200.sh", carry=[".whl"], timeout_s=540)
#
# and then ships $OUT/profile.json as simulator/data/profiles/<gpu>-captured.json with its
# provenance, and the reports in the closing note. Dry run on a CPU (gloo, tiny sizes, no
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

# 1. One GPU: the step's kernels (no collectives).
step train-1gpu 150 $C capture train --backend $BACKEND --nproc 1 --dtype $DTYPE $MODEL $BATCH \
  --global-batch-size 8 --steps $STEPS --warmup-steps $WARM --out "$WORK/train-1gpu"
# 2. The op-level compute table (GEMM, attention, norms, optimizer) for the kernel model.
step compute 120 $C capture compute --backend $BACKEND --nproc 1 --dtype $DTYPE $COMPUTE --out "$WORK/compute"
# 3. NCCL collectives and a data-parallel step where the machine has several GPUs.
if [ "$NGPU" -ge 2 ]; then
  step collectives 120 $C capture collectives --backend $BACKEND --nproc "$NGPU" --out "$WORK/collectives"
  step train-dp 150 $C capture train --backend $BACKEND --nproc "$NGPU" --dtype $DTYPE $MODEL $BATCH \
    --steps $STEPS --warmup-steps $WARM --out "$WORK/train-dp"
fi
BUNDLES=$(ls -d "$WORK"/*/ 2>/dev/null | tr '\n' ' ')
# 4. Calibrate from every bundle captured (the physics checks refuse an impossible fit), then
#    validate the one-GPU step with the captured profile (self-consistency) and the spec one.
step calibrate 120 $C calibrate $BUNDLES --out "$OUT/profile.json" && \
  $C trace info "$WORK/train-1gpu" --json > "$OUT/trace-info.json"
step validate-captured 60 sh -c "$C validate '$WORK/train-1gpu' --profile '$OUT/profile.json' --json > '$OUT/validate-captured.json'"
SPEC=$([ -n "${DRY:-}" ] && echo cpu-gloo-host || echo h200-sxm-141gb)
step validate-spec 60 sh -c "$C validate '$WORK/train-1gpu' --profile $SPEC --json > '$OUT/validate-spec.json'"
tar czf "$OUT/bundles.tgz" -C "$WORK" . && ls -la "$OUT"
