#!/usr/bin/env bash
# Second device call of round 28: the op-level compute table with device-only timing (a sleep
# kernel holds the GPU while the host queues the repeats) and torch's AdamW foreach against fused.
# run(command="bash bench/device/recapture_compute.sh", carry=[".whl"], timeout_s=300)
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?OUT must name the folder the results go to}"
exec > >(tee -a "$OUT/log2.txt") 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
timeout 150 python3 -m simulator.cli capture compute --backend nccl --nproc 1 --dtype bf16 \
  --hidden-sizes 1024,2048,4096 --tokens 2048,8192 --min-time-s 0.05 --out "$WORK/compute"
echo "compute exit $?"
timeout 60 python3 bench/device/optimizer_h200.py "$OUT"; echo "optimizer exit $?"
python3 -c "import pandas as pd; d=pd.read_parquet('$WORK/compute/compute.parquet'); print(d[d.op!='gemm'][['op','shape','pass','bytes','time_us','repeats']].to_string())"
tar czf "$OUT/compute2.tgz" -C "$WORK" compute; ls -la "$OUT"
