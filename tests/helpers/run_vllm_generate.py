"""Generate with vLLM: the target alone, then with a speculative config; print JSON.

Runs as its own process (vLLM engines keep process-global state):
    python run_vllm_generate.py TARGET SPEC_JSON PROMPTS_JSON MAX_TOKENS
"""

import gc
import json
import os
import sys


def generate(target: str, spec: dict | None, prompts: list[list[int]], max_tokens: int):
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=target,
        speculative_config=spec,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=512,
        max_num_seqs=4,
        seed=0,
        disable_log_stats=False,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    metrics = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            metrics[metric.name] = getattr(metric, "value", None)
    speculative_config = llm.llm_engine.vllm_config.speculative_config
    ddtree = getattr(speculative_config, "ddtree_config", None)
    del llm
    gc.collect()
    return tokens, metrics, (ddtree.to_dict() if ddtree else None)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    target, spec_json, prompts_json, max_tokens = sys.argv[1:5]
    prompts = json.loads(prompts_json)
    plain, _, _ = generate(target, None, prompts, int(max_tokens))
    spec, metrics, ddtree = generate(target, json.loads(spec_json), prompts, int(max_tokens))
    print(
        "RESULT " + json.dumps({"plain": plain, "spec": spec, "metrics": metrics, "ddtree": ddtree})
    )
