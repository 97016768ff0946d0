"""DDTree through request lifecycles vLLM drives: preemption and aborts (greedy, oracle drafter).

    python run_vllm_lifecycle.py TARGET DRAFTER PROMPTS_JSON MAX_TOKENS NUM_BLOCKS

1. the target alone: reference tokens;
2. DDTree with only NUM_BLOCKS KV blocks, so that the scheduler preempts requests;
3. DDTree again (enough blocks): all prompts started, two aborted mid-generation, the others
   run to the end; then every prompt once more as new requests (no stale tree state).
Prints ``RESULT {json}``.
"""

import gc
import json
import os
import sys
import tempfile


def make_llm(target: str, **kwargs):
    from vllm import LLM

    args = dict(
        model=target,
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=4,
        seed=0,
        dtype="float32",
        disable_log_stats=False,
    )
    return LLM(**{**args, **kwargs})


def counter(llm, name: str) -> int:
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def main() -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    target, drafter, prompts_json, max_tokens, num_blocks = sys.argv[1:6]
    prompts = json.loads(prompts_json)
    params = SamplingParams(temperature=0.0, max_tokens=int(max_tokens), ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    result = {}

    llm = make_llm(target)
    reference = [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params)]
    result["reference"] = reference
    del llm
    gc.collect()

    oracle = os.path.join(tempfile.mkdtemp(), "oracle.json")
    with open(oracle, "w") as f:
        sequences = [p + t for p, t in zip(prompts, reference, strict=True)]
        json.dump({"p_top": 0.8, "seed": 0, "sequences": sequences}, f)
    os.environ["VLLM_DDTREE_TEST_ORACLE"] = oracle
    speculative = {"method": "ddtree", "model": drafter, "tree_budget": 8}

    llm = make_llm(target, speculative_config=speculative, num_gpu_blocks_override=int(num_blocks))
    result["preempted"] = [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params)]
    result["num_preemptions"] = counter(llm, "vllm:num_preemptions")
    result["accepted_tokens"] = counter(llm, "vllm:spec_decode_num_accepted_tokens")
    del llm
    gc.collect()

    llm = make_llm(target, speculative_config=speculative)
    engine = llm.llm_engine
    for i, prompt in enumerate(inputs):
        engine.add_request(f"r{i}", prompt, params)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
        steps += 1
        if steps == 3:
            engine.abort_request(["r1", "r3"])
    result["after_abort"] = finished
    result["again"] = [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params)]
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main()
