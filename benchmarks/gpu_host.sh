#!/usr/bin/env bash
# Provisions an air-gapped GPU host (torch and triton installed, no package registry), then runs
# one command there. It chooses no benchmark: the command does (docs/gpu-host.md has the usual
# ones).
#
#   bash benchmarks/gpu_host.sh [--smollm2] COMMAND [ARGS...]
#   e.g. bash benchmarks/gpu_host.sh timeout 420 python3 -m benchmarks lossless --runner v2 \
#          --modes graphs --out "$OUT/v2"
#
# Provisioning, every call:
#   * vLLM 0.26.0 from the slim bundle parts carried in .vllm-device/part*/ into /tmp/site
#     (CONTRIBUTING.md: "The GPU host"); the plugin's entry-point metadata beside it, so vLLM
#     finds vllm-ddtree in every process it starts; this tree on PYTHONPATH;
#   * the environment the benchmarks expect (offline hub, spawned workers);
#   * VLLM_DDTREE_COMMIT: the commit every result records (set it when the copied tree's git
#     metadata is missing or stale; exit 7 if neither says).
# With --smollm2: the SmolLM2-135M-Instruct checkpoint at /tmp/train/SmolLM2-135M-Instruct,
# made from the GGUF pieces carried in .gguf-*/ (exit 4 if their sha256 differs), once per lease;
# every call keeps the pieces it carries in /tmp (scripts/make-gguf-pieces.sh makes them).
set -uo pipefail
SMOLLM2=0
if [ "${1:-}" = "--smollm2" ]; then SMOLLM2=1; shift; fi
[ $# -gt 0 ] || { sed -n '2,19p' "$0"; exit 2; }
if [ -z "${VLLM_DDTREE_COMMIT:-}" ]; then
  if git diff --quiet HEAD -- 2>/dev/null; then
    VLLM_DDTREE_COMMIT=$(git rev-parse HEAD)
  else
    echo "set VLLM_DDTREE_COMMIT to the commit of this tree (git's HEAD here is missing or" \
      "does not match the files)"; exit 7
  fi
fi
export VLLM_DDTREE_COMMIT
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
for part in .vllm-device/part1 .vllm-device/part2 .vllm-device/part3; do
  if [ -f "$part/setup.sh" ]; then bash "$part/setup.sh"; break; fi
done
mkdir -p /tmp/site/vllm_ddtree-0.0.0.dist-info
printf 'Metadata-Version: 2.1\nName: vllm-ddtree\nVersion: 0.0.0\n' \
  > /tmp/site/vllm_ddtree-0.0.0.dist-info/METADATA
printf '[vllm.general_plugins]\nddtree = vllm_ddtree:register\n' \
  > /tmp/site/vllm_ddtree-0.0.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# What a call carries of the SmolLM2 checkpoint stays on the machine for later calls: GGUF
# pieces, prompts.json and the gguf package (pure Python, which the host's Python lacks).
mkdir -p /tmp/gguf
for piece in .gguf-*/gg.*; do [ -f "$piece" ] && cp "$piece" /tmp/gguf/; done
for extra in .gguf-*/prompts.json; do [ -f "$extra" ] && cp "$extra" /tmp/prompts.json; done
for extra in .gguf-*/site; do [ -d "$extra" ] && cp -r "$extra"/. /tmp/site/; done
if [ "$SMOLLM2" = 1 ] && [ ! -f /tmp/train/SmolLM2-135M-Instruct/model.safetensors ]; then
  GGUF=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
  cat /tmp/gguf/gg.* > "$GGUF"
  echo "$(cat benchmarks/smollm2_gguf.sha256)  $GGUF" | sha256sum -c - || exit 4
  timeout 120 python3 -c "from vllm_ddtree.demo import prepare_smollm2; \
    print(prepare_smollm2('/tmp/train', '$GGUF'))" || exit 5
fi
exec "$@"
