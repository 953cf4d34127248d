#!/usr/bin/env bash
# Wheels the device machine's image lacks (its python3 3.12 holds torch, numpy, pandas, scipy,
# pyarrow, typer, rich, pyyaml; /work/.library/device/KINDS.md lists them), saved to .whl/
# (git-ignored) for `run`'s carry. Run here, in the repository root, before the device call.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl simpy==4.1.2 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
  typing-inspection==0.4.2 plotly==7.1.0
ls -la .whl
du -sh .whl
