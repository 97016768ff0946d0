"""``thinking_token_budget`` on tree rows (spec_decode/tree_thinking_budget.py) against vLLM's
own holder driven as target-alone decoding drives it: one sampler call per position, the
request's outputs growing by one token each."""

import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.sample.logits_processor.interface import BatchUpdate  # noqa: E402
from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder  # noqa: E402

from vllm_ddtree.spec_decode.tree_thinking_budget import (  # noqa: E402
    BudgetedRequest,
    TreeThinkingBudget,
)

VOCAB = 12
START, END = [10], [8, 9]  # a one-token start marker, a two-token end marker


def target_alone_forcing(prompt, budget, outputs):
    """Per position 0..len(outputs): the token vLLM's holder forces there in decoding without
    speculation (None: none), given the tokens ``outputs`` produced before it."""
    markers = SimpleNamespace(reasoning_start_token_ids=START, reasoning_end_token_ids=END)
    holder = ThinkingBudgetStateHolder(markers, 1, 0, torch.device("cpu"), False)
    running: list[int] = []
    params = SimpleNamespace(thinking_token_budget=budget)
    holder.sync_batch(BatchUpdate(1, [], [(0, params, prompt, running)], []))
    forced = []
    for position in range(len(outputs) + 1):
        holder.update_state([running], None)
        logits = holder.apply_to_logits(torch.zeros(1, VOCAB), False, None)
        forced.append(int(logits.argmax()) if logits.max() > 1 else None)
        if position < len(outputs):
            running.append(outputs[position])
    return forced


def random_tree(rng, num_nodes):
    """Tokens and parents (tree index, 0 the root; every parent before its children)."""
    parents = [rng.randrange(0, i + 1) for i in range(num_nodes)]
    return [rng.randrange(VOCAB) for _ in range(num_nodes)], parents


def forced_rows(logits):
    return [int(row.argmax()) if row.max() > 1 else None for row in logits]


@pytest.mark.parametrize("seed", range(12))
def test_every_tree_row_forces_what_target_alone_decoding_forces_after_its_path(seed):
    """Random prompts (in or out of thinking), budgets 0-6, trees of 1-12 nodes over several
    steps whose committed tokens follow one path of the previous tree: each row's forced token
    is the one vLLM's holder forces without speculation after the row's outputs and path."""
    rng = random.Random(seed)
    prompts = [[1, 2, 10, 3], [4, 5], [10], None]
    requests = [BudgetedRequest(r, f"req{r}", prompts[r], rng.randrange(0, 7)) for r in range(4)]
    outputs = [decode_more(q, [], rng.randrange(0, 5), rng) for q in requests]
    budget = TreeThinkingBudget(START, END)
    forced_anywhere = 0
    for _step in range(6):
        trees = [random_tree(rng, rng.randrange(0, 13)) for _ in requests]
        token_ids = [t for t, _ in trees]
        parents = [p for _, p in trees]
        num_draft = [len(t) for t in token_ids]
        rows = sum(1 + n for n in num_draft)
        logits = budget.apply(
            torch.zeros(rows, VOCAB), requests, outputs, token_ids, parents, num_draft
        )
        got = forced_rows(logits)
        row = 0
        for q in requests:
            r = q.index
            paths = [[]]
            for i in range(num_draft[r]):
                paths.append(paths[parents[r][i]] + [token_ids[r][i]])
            for path in paths:
                expected = target_alone_forcing(
                    q.prompt_token_ids, q.thinking_token_budget, outputs[r] + path
                )
                # A node whose own token the target alone would not have produced (a forced
                # position with another token) is never reached by the walk; only rows on
                # decodable paths are compared.
                decodable = all(f is None or f == t for f, t in zip(expected, path, strict=False))
                if decodable:
                    assert got[row] == expected[-1], (q, outputs[r], path)
                    forced_anywhere += expected[-1] is not None
                row += 1
        # Commit: 1-4 tokens target-alone decoding could produce (an accepted path and the
        # bonus), so kept states advance by several positions a step.
        for q in requests:
            outputs[q.index] += decode_more(q, outputs[q.index], rng.randrange(1, 5), rng)
    assert forced_anywhere > 0


def decode_more(request, outputs, count, rng):
    """``count`` more tokens of target-alone decoding after ``outputs``."""
    more: list[int] = []
    for _ in range(count):
        forced = target_alone_forcing(
            request.prompt_token_ids, request.thinking_token_budget, outputs + more
        )[-1]
        more.append(forced if forced is not None else rng.randrange(VOCAB))
    return more


def test_a_request_whose_outputs_shrink_or_whose_budget_changes_starts_over():
    """Kept states are only reused for the same request, budget and growing outputs."""
    budget = TreeThinkingBudget(START, END)
    request = BudgetedRequest(0, "a", [10], 2)
    for outputs, expected in (([3, 4], 8), ([3], None), ([3, 4], 8)):
        logits = budget.apply(torch.zeros(1, VOCAB), [request], [outputs], None, None, [0])
        assert forced_rows(logits) == [expected]
        assert target_alone_forcing([10], 2, outputs)[-1] == expected
    request = BudgetedRequest(0, "a", [10], 3)
    logits = budget.apply(torch.zeros(1, VOCAB), [request], [[3, 4]], None, None, [0])
    assert forced_rows(logits) == [None]
    budget.retain(set())
    assert not budget._committed
