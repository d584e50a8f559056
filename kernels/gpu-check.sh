#!/usr/bin/env bash
# Runs on a lent GPU machine: the kernel test binaries built here (carried in target/), no
# cargo needed there. Prints each kernel's comparison against its CPU reference.
#   build here:  cargo test -p kernels --features cuda --release --no-run
#   run there:   kernels/gpu-check.sh [target/release/deps]
set -uo pipefail
DIR="${1:-target/release/deps}"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader || true
status=0
for bin in "$DIR"/nvfp4_quant-* "$DIR"/nvfp4_gemv-* "$DIR"/attn_decode-* "$DIR"/indexer-*; do
  [ -x "$bin" ] && [ -f "$bin" ] || continue
  echo "== $(basename "$bin")"
  "$bin" --nocapture --test-threads 1 || status=1
done
exit $status
