#!/bin/bash
# Every pagedkv-only allocator figure of docs/benchmarks.md in one run (about 5 minutes on 2 cores).
# Usage: bash benchmarks/allocator_sweep.sh [OUT_DIR]   (default out/alloc; needs .venv from `make` and the
# Mooncake trace under $PAGEDKV_DATA, default ../shared/data). Ratios against the peers come only from
# benchmarks/allocator_vs_peers.py, which runs them side by side in one invocation.
set -euo pipefail
OUT=${1:-out/alloc}
MC=${PAGEDKV_DATA:-../shared/data}/mooncake-fast25/synthetic_trace.jsonl
mkdir -p "$OUT"
PK=.venv/bin/pagedkv
run() { name=$1; shift; echo "== $name: pagedkv bench allocator $*" >&2; "$PK" bench allocator "$@" --json > "$OUT/$name.json"; }
for trace in az mc; do
  args=(); [ $trace = mc ] && args=(--trace "$MC" --limit 1000)
  run ${trace}_sha "${args[@]}" --repeat 3
  run ${trace}_fast "${args[@]}" --hash fast --repeat 3
  run ${trace}_nopc "${args[@]}" --no-prefix-caching --repeat 3
  run ${trace}_contig "${args[@]}" --allocator contiguous --repeat 3
  PAGEDKV_NATIVE=0 run ${trace}_py "${args[@]}" --repeat 3
  run ${trace}_wall "${args[@]}" --clock wall --repeat 3
done
