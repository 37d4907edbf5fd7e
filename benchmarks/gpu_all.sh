#!/bin/bash
# Every GPU figure and GPU-only test of pagedkv in one run (~10 minutes on an H100/H200), results in OUTDIR.
# Usage (repository root, one CUDA GPU; torch >= 2.5, triton >= 3.2, transformers >= 5):
#   bash benchmarks/gpu_all.sh OUTDIR [NUM_REQUESTS]
# Stages (each with its own time limit; a failing stage does not stop the next; the exit status is the
# number of failed stages):
#   1. env.txt            GPU, driver, library versions
#   2. tests_gpu.txt      pytest -m gpu tests/ops/test_gpu.py: compiled kernels vs reference, bit-exact
#                         write, engine greedy == transformers generate on CUDA
#   3. attention.json     benchmarks/gpu_attention.py: checks, copy bandwidth, decode table vs SDPA flash,
#                         prefill 2k-8k, launch sweep
#   4. serving/           benchmarks/gpu_serving.py: Llama-2-7B shape, A100-40GB KV budget, first
#                         NUM_REQUESTS (default 100) Azure conv requests, four allocators, with the
#                         simulator's predictions
set -uo pipefail
OUT=${1:?usage: bash benchmarks/gpu_all.sh OUTDIR [NUM_REQUESTS]}
NREQ=${2:-100}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 TRITON_DEFAULT_FP_FUSION=1
failed=0
stage() {  # stage NAME SECONDS LOG command...
  local name=$1 limit=$2 log=$3; shift 3
  echo "== $name (limit ${limit}s): $*" | tee -a "$OUT/summary.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$log" 2>&1
  local rc=$?
  echo "   rc=$rc, $((SECONDS - t0)) s, log $log" | tee -a "$OUT/summary.txt"
  tail -n 25 "$log"
  [ $rc -eq 0 ] || failed=$((failed + 1))
}
{
  date -u
  nvidia-smi || true
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda); print('triton', triton.__version__); print('transformers', transformers.__version__); print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
  git rev-parse HEAD 2>/dev/null || true
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
stage "gpu tests" 110 "$OUT/tests_gpu.txt" $PY -m pytest -q -p no:cacheprovider -m gpu tests/ops/test_gpu.py
stage "attention benchmark" 180 "$OUT/attention.txt" $PY benchmarks/gpu_attention.py --json "$OUT/attention.json"
stage "serving benchmark" 270 "$OUT/serving.txt" $PY benchmarks/gpu_serving.py --out "$OUT/serving" --num-requests "$NREQ"
echo "failed stages: $failed" | tee -a "$OUT/summary.txt"
exit $failed
