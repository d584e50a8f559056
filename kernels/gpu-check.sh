#!/usr/bin/env bash
# Runs on a lent GPU machine with the binaries built here (carried in target/; no cargo
# there): every kernel test against its CPU reference, then the benchmark table (decode
# attention and FP4 GEMV GB/s next to the measured copy bandwidth, NVFP4 GEMM TFLOP/s).
#   build here:  cargo test -p kernels --features cuda --release --no-run
#                cargo build -p kernels --features cuda --release --bins
#   stage here:  kernels/gpu-check.sh --stage gpu-bin   (stripped copies, about 12 MB, and
#                gpu-bin.tar.gz, about 4 MB: the device tool carries at most 64 MiB; every
#                test binary embeds every fatbin, so the GPU tests are one binary, tests/gpu)
#   run there:   kernels/gpu-check.sh gpu-bin.tar.gz    (or a folder: gpu-bin, target/release)
# Exits non-zero when any test fails, when nvidia-smi fails, and when a test binary finds no GPU
# (PDSERVE_REQUIRE_GPU=1: a run without a working GPU cannot pass; `scripts/test` checks that
# it fails on a machine without one). Where the full run fails, each test that did not pass
# runs again alone and a summary tells the two apart. Takes a few minutes (the bench about one).
set -uo pipefail
TESTS="gpu"
if [ "${1:-}" = "--stage" ]; then
  OUT="${2:-gpu-bin}"
  rm -rf "$OUT" && mkdir -p "$OUT/deps" || exit 1
  for name in $TESTS; do
    # The newest build of each test binary (cargo keeps older hashes around).
    bin=$(ls -t target/release/deps/"$name"-* 2>/dev/null | grep -v '\.d$' | head -1)
    [ -n "$bin" ] || { echo "missing: target/release/deps/$name-*" >&2; exit 1; }
    cp "$bin" "$OUT/deps/" && strip "$OUT/deps/$(basename "$bin")"
  done
  cp target/release/kernel-bench "$OUT/" && strip "$OUT/kernel-bench" || exit 1
  tar -czf "$OUT.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")" || exit 1
  du -sh "$OUT" "$OUT.tar.gz"
  exit 0
fi
DIR="${1:-target/release}"
if [ -f "$DIR" ] && [ "${DIR%.tar.gz}" != "$DIR" ]; then
  # A staged archive: unpack it beside a temporary folder and run from there.
  unpacked=$(mktemp -d) || exit 1
  trap 'rm -rf "$unpacked"' EXIT
  tar -xzf "$DIR" -C "$unpacked" || { echo "cannot unpack $DIR" >&2; exit 1; }
  DIR="$unpacked/$(basename "${DIR%.tar.gz}")"
fi
export PDSERVE_REQUIRE_GPU=1
# The decode step on V4-Flash's dimensions (4 layers generated on the spot, about 3.6 GB).
export PDSERVE_GPU_FLASH=1
status=0
if ! nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader; then
  echo "nvidia-smi failed: no working GPU or driver here" >&2
  status=1
fi
# Each binary runs once with every test; where it fails, each test that did not pass (or
# never reported: the process died, as on a sticky CUDA error or an abort) runs again alone,
# so one fault does not hide the other tests' results.
# Reruns stop at a deadline that leaves the bench its time (the device runs a command for at
# most 600 s).
deadline=$((SECONDS + ${PDSERVE_GPU_RERUN_UNTIL:-480}))
summary=""
for name in $TESTS; do
  found=0
  for bin in "$DIR"/deps/"$name"-*; do
    [ -x "$bin" ] && [ -f "$bin" ] || continue
    found=1
    echo "== $name"
    log=$(mktemp)
    if ! timeout 420 "$bin" --nocapture --test-threads 1 --logfile "$log"; then
      status=1
      for t in $("$bin" --list --format terse 2>/dev/null | sed -n 's/: test$//p'); do
        grep -qx "ok $t" "$log" && continue
        left=$((deadline - SECONDS))
        if [ "$left" -lt 5 ]; then
          summary="$summary\n  not run alone (out of time): $t"
          continue
        fi
        echo "== $name: $t alone"
        if timeout $((left < 240 ? left : 240)) "$bin" --exact "$t" --nocapture --test-threads 1; then
          summary="$summary\n  passed alone (failed or unreported in the full run): $t"
        else
          summary="$summary\n  FAILED alone: $t"
        fi
      done
    fi
    rm -f "$log"
  done
  [ "$found" = 1 ] || { echo "== $name: test binary missing in $DIR/deps"; status=1; }
done
[ -z "$summary" ] || printf "== tests that did not pass in the full run:%b\n" "$summary"
echo "== bench"
timeout 240 "$DIR"/kernel-bench || status=1
exit $status
