"""One DDTree engine on this machine, batch 1 and 2 under torch.profiler: the bench's step split.

    python run_step_split.py TARGET DRAFTER BUDGET MAX_TOKENS

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), as in
``benchmarks/bench_e2e.py``. Prints ``RESULT {"profiled": [step split at batch 1, at batch 2],
"host": the unprofiled host phases at batch 1}``.
"""

import json
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, root)
    from vllm import LLM

    from benchmarks.bench_e2e import metric_values
    from benchmarks.step_split import host_phase_split, profiled_step_split

    target, drafter, budget, max_tokens = sys.argv[1:5]
    llm = LLM(
        model=target,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=512,
        max_num_seqs=2,
        seed=0,
        disable_log_stats=False,
        speculative_config={"method": "ddtree", "model": drafter, "tree_budget": int(budget)},
    )
    llm.generate([{"prompt_token_ids": list(range(10, 26))}], use_tqdm=False)  # warm-up
    prompts = [list(range(10, 26)), list(range(40, 52))]
    splits = [
        profiled_step_split(llm, prompts[:batch], int(max_tokens), metric_values)
        for batch in (1, 2)
    ]
    host = host_phase_split(llm, prompts[:1], int(max_tokens), metric_values)
    print("RESULT " + json.dumps({"profiled": splits, "host": host}))
