"""Request options on a tree step's rows for vLLM's V2 sampler: each row's path tokens, the
penalties and bad words that read them (kernels against their references, references against
vLLM's own V1 ops on the same pasts), the stand-in sampler states, and V2-layout logprobs."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.interpreter import run_under_interpreter
from vllm_ddtree.ops.path_tokens import row_path_tokens, row_requests, tree_path_tokens
from vllm_ddtree.ops.tree_bad_words import apply_tree_bad_words_ref
from vllm_ddtree.ops.tree_penalties import apply_tree_penalties_ref
from vllm_ddtree.spec_decode.tree_logits_processors import tree_row_outputs
from vllm_ddtree.tree import build_trees

ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
VOCAB = 40
DEPTH = 5


def step(seed: int, budgets=(12, 7, 0, 12)):
    """A tree step: one tree per request from random drafter logits, cut to ``budgets``
    scheduled nodes (0: a request without drafts), its logits rows' layout, and random outputs
    per request state (states in another order than the batch)."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs, width = len(budgets), max(budgets)
    trees = build_trees(torch.randn(num_reqs, DEPTH, VOCAB, generator=gen) * 2, width)
    trees.num_nodes = torch.minimum(trees.num_nodes, torch.tensor(budgets))
    keep = trees.valid_mask()
    trees.token_ids = torch.where(keep, trees.token_ids, -1)
    counts = [1 + int(n) for n in trees.num_nodes]
    cu_num_logits = torch.tensor(np.cumsum([0, *counts]), dtype=torch.int32)
    states = torch.tensor([3, 0, 5, 1])[:num_reqs]
    outputs = {
        int(s): torch.randint(0, VOCAB, (int(s) + 2,), generator=gen).tolist() for s in states
    }
    return trees, cu_num_logits, states, outputs


def row_pasts(trees, cu_num_logits, states, outputs):
    """Each row's past by vLLM V1's rule for trees (``tree_row_outputs``): the request's
    outputs, then the row's path."""
    num_draft = [int(n) for n in trees.num_nodes]
    request_outputs = [outputs[int(s)] for s in states]
    return tree_row_outputs(
        request_outputs, trees.token_ids.tolist(), trees.parents.tolist(), num_draft
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_rows_path_tokens_are_its_nodes_path(seed):
    trees, cu_num_logits, states, outputs = step(seed)
    num_rows = int(cu_num_logits[-1])
    tokens, lengths = row_path_tokens(trees, cu_num_logits, num_rows, DEPTH)
    empty = {int(s): [] for s in states}
    want = row_pasts(trees, cu_num_logits, states, empty)
    got = [row[: int(n)] for row, n in zip(tokens.tolist(), lengths.tolist(), strict=True)]
    assert got == want
    assert (tokens[torch.arange(DEPTH) >= lengths.unsqueeze(1)] == -1).all()
    assert row_requests(cu_num_logits, num_rows).tolist() == [
        r for r, n in enumerate(trees.num_nodes.tolist()) for _ in range(1 + n)
    ]
    # Tree index 0 (the root) and padding nodes have empty paths.
    paths = tree_path_tokens(trees, DEPTH)
    assert (paths[:, 0] == -1).all()


def vllm_state(states, outputs, prompts, num_states=6):
    """vLLM V2's penalty state layout for these request states: per-state penalties, packed
    prompt bits and output counts."""
    words = (VOCAB + 31) // 32
    prompt_bin_mask = torch.zeros(num_states, words, dtype=torch.int32)
    output_bin_counts = torch.zeros(num_states, VOCAB, dtype=torch.int32)
    for state, prompt in prompts.items():
        for token in set(prompt):
            prompt_bin_mask[state, token // 32] |= 1 << (token % 32)
        for token in outputs[state]:
            output_bin_counts[state, token] += 1
    repetition = torch.ones(num_states)
    frequency = torch.zeros(num_states)
    presence = torch.zeros(num_states)
    penalised = [int(s) for s in states[:-1]]  # the last request has none
    repetition[penalised] = torch.tensor([1.6, 1.0, 0.7][: len(penalised)])
    frequency[penalised] = torch.tensor([0.5, 0.0, 1.5][: len(penalised)])
    presence[penalised] = torch.tensor([0.6, 1.1, 0.0][: len(penalised)])
    return repetition, frequency, presence, prompt_bin_mask, output_bin_counts


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_penalties_are_vllms_on_each_rows_own_past(seed):
    """The reference equals vLLM V1's ``apply_all_penalties`` given each row's past (its
    request's outputs and its path): the penalties of target-alone decoding at that node.
    Rows of the request without penalties are untouched."""
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    trees, cu_num_logits, states, outputs = step(seed)
    gen = torch.Generator().manual_seed(seed + 10)
    prompts = {int(s): torch.randint(0, VOCAB, (5,), generator=gen).tolist() for s in states}
    state = vllm_state(states, outputs, prompts)
    num_rows = int(cu_num_logits[-1])
    requests = row_requests(cu_num_logits, num_rows)
    row_state = states[requests].int()
    tokens, _ = row_path_tokens(trees, cu_num_logits, num_rows, DEPTH)
    logits = torch.randn(num_rows, VOCAB, generator=gen) * 3
    got = logits.clone()
    apply_tree_penalties_ref(got, row_state, tokens, *state)

    repetition, frequency, presence = (t[row_state.long()] for t in state[:3])
    prompt_ids = torch.tensor([prompts[int(s)] for s in row_state])
    want = apply_all_penalties(
        logits.clone(),
        prompt_ids,
        presence,
        frequency,
        repetition,
        row_pasts(trees, cu_num_logits, states, outputs),
    )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    plain = requests == len(states) - 1
    assert torch.equal(got[plain], logits[plain])
    assert not torch.equal(got[~plain], logits[~plain])


def bad_words_state(states, words_by_state, num_states=6):
    width = 16
    word_tokens = torch.zeros(num_states, width, dtype=torch.int32)
    word_offsets = torch.zeros(num_states, 9, dtype=torch.int32)
    num_words = torch.zeros(num_states, dtype=torch.int32)
    for state, words in words_by_state.items():
        flat = [t for w in words for t in w]
        word_tokens[state, : len(flat)] = torch.tensor(flat)
        word_offsets[state, : len(words) + 1] = torch.tensor(np.cumsum([0, *map(len, words)]))
        num_words[state] = len(words)
    return word_tokens, word_offsets, num_words


def bad_words_case(seed):
    """Per request state: words made from its rows' own pasts (so that they match on some
    paths and not on others), and the sequence buffers vLLM V2 keeps."""
    trees, cu_num_logits, states, outputs = step(seed)
    pasts = row_pasts(trees, cu_num_logits, states, outputs)
    num_rows = int(cu_num_logits[-1])
    requests = row_requests(cu_num_logits, num_rows).tolist()
    words_by_state = {}
    for r, state in enumerate(states.tolist()[:-1]):  # the last request has none
        rows = [t for t in range(num_rows) if requests[t] == r]
        deep = pasts[rows[-1]]
        words = [[deep[-1] + 1 if deep[-1] + 1 < VOCAB else 0], deep[-2:] + [7], deep[-3:] + [9]]
        words_by_state[state] = words
    prompt_len = torch.tensor([4] * 6)
    all_token_ids = torch.zeros(6, 40, dtype=torch.int32)
    total_len = torch.zeros(6, dtype=torch.int32)
    for state, out in outputs.items():
        all_token_ids[state, 4 : 4 + len(out)] = torch.tensor(out)
        total_len[state] = 4 + len(out)
    return trees, cu_num_logits, states, pasts, words_by_state, all_token_ids, prompt_len, total_len


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_bad_words_are_vllms_on_each_rows_own_past(seed):
    from vllm.v1.sample.ops.bad_words import apply_bad_words

    trees, cu_num_logits, states, pasts, words_by_state, all_ids, prompt_len, total_len = (
        bad_words_case(seed)
    )
    num_rows = int(cu_num_logits[-1])
    requests = row_requests(cu_num_logits, num_rows)
    row_state = states[requests].int()
    tokens, lengths = row_path_tokens(trees, cu_num_logits, num_rows, DEPTH)
    words = bad_words_state(states, words_by_state)
    logits = torch.randn(num_rows, VOCAB)
    got = logits.clone()
    apply_tree_bad_words_ref(
        got, row_state, tokens, lengths, *words, all_ids, prompt_len, total_len, 3
    )
    want = logits.clone()
    by_row = {
        t: words_by_state[int(row_state[t])]
        for t in range(num_rows)
        if int(row_state[t]) in words_by_state
    }
    apply_bad_words(want, by_row, pasts)
    assert torch.equal(got, want)
    assert torch.isinf(got).sum() > torch.isinf(logits).sum()  # some words bite


def needs_kernel():
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_tree_penalties_match_the_reference_bit_for_bit(seed):
    needs_kernel()
    from vllm_ddtree.ops.tree_penalties import apply_tree_penalties_triton

    device = "cuda" if ON_GPU else "cpu"
    trees, cu_num_logits, states, outputs = step(seed)
    gen = torch.Generator().manual_seed(seed + 10)
    prompts = {int(s): torch.randint(0, VOCAB, (5,), generator=gen).tolist() for s in states}
    state = [t.to(device) for t in vllm_state(states, outputs, prompts)]
    num_rows = int(cu_num_logits[-1])
    row_state = states[row_requests(cu_num_logits, num_rows)].int().to(device)
    tokens, _ = row_path_tokens(trees, cu_num_logits, num_rows, DEPTH)
    logits = (torch.randn(num_rows, VOCAB, generator=gen) * 3).to(device)
    want = logits.clone()
    apply_tree_penalties_ref(want, row_state, tokens.to(device), *state)
    apply_tree_penalties_triton(logits, row_state, tokens.to(device), *state)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_tree_bad_words_match_the_reference(seed):
    needs_kernel()
    from vllm_ddtree.ops.tree_bad_words import apply_tree_bad_words_triton

    device = "cuda" if ON_GPU else "cpu"
    trees, cu_num_logits, states, _, words_by_state, all_ids, prompt_len, total_len = (
        bad_words_case(seed)
    )
    num_rows = int(cu_num_logits[-1])
    row_state = states[row_requests(cu_num_logits, num_rows)].int()
    tokens, lengths = row_path_tokens(trees, cu_num_logits, num_rows, DEPTH)
    args = [row_state, tokens, lengths, *bad_words_state(states, words_by_state)]
    args += [all_ids, prompt_len, total_len]
    logits = torch.randn(num_rows, VOCAB)
    want = logits.clone()
    apply_tree_bad_words_ref(want, *args, 3)
    got = logits.to(device)
    apply_tree_bad_words_triton(got, *(a.to(device) for a in args), 3)
    assert torch.equal(got.cpu(), want)


def test_tree_row_kernels_under_the_interpreter():
    if ON_GPU or INTERPRETED:
        pytest.skip("the kernel tests run directly here")
    run_under_interpreter(__file__, "kernel_", expected=5)


@pytest.mark.skipif(not ON_GPU, reason="vLLM's V2 penalty kernel needs a GPU")
def test_on_a_chain_the_tree_penalties_are_vllm_v2s_bit_for_bit():
    """A chain's rows, whose paths are the drafts before them: the tree kernel gives what
    vLLM's own V2 kernel gives."""
    from vllm.v1.worker.gpu.sample.penalties import apply_penalties

    from vllm_ddtree.ops.tree_penalties import apply_tree_penalties_triton

    gen = torch.Generator().manual_seed(0)
    vocab, states = 151936, torch.tensor([2, 0], dtype=torch.int32)
    drafts = torch.randint(0, vocab, (2, DEPTH), generator=gen)
    roots = torch.randint(0, vocab, (2, 1), generator=gen)
    input_ids = torch.cat([roots, drafts], dim=1).flatten()  # each request: root, drafts
    num_rows = input_ids.numel()
    row_state = states.repeat_interleave(1 + DEPTH)
    local = torch.arange(1 + DEPTH).repeat(2)
    paths = torch.full((num_rows, DEPTH), -1, dtype=torch.long)
    for t in range(num_rows):
        r, k = divmod(t, 1 + DEPTH)
        paths[t, :k] = drafts[r, :k]
    repetition = torch.tensor([1.3, 1.0, 0.8])
    frequency = torch.tensor([0.4, 0.0, 0.2])
    presence = torch.tensor([0.0, 0.0, 0.9])
    prompt_bin_mask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    counts = torch.randint(0, 3, (3, vocab), dtype=torch.int32)
    logits = torch.randn(num_rows, vocab, generator=gen) * 4
    cuda = [
        t.cuda()
        for t in (row_state, input_ids, local, repetition, frequency, presence, prompt_bin_mask)
    ]
    row_state_c, input_ids_c, local_c, rep_c, freq_c, pres_c, mask_c = cuda
    want = logits.cuda()
    apply_penalties(
        want, row_state_c, input_ids_c, local_c, rep_c, freq_c, pres_c, mask_c, counts.cuda()
    )
    got = logits.cuda()
    apply_tree_penalties_triton(
        got, row_state_c, paths.cuda(), rep_c, freq_c, pres_c, mask_c, counts.cuda()
    )
    assert torch.equal(got, want)


class _Staged:
    """A vLLM V2 host/device pair (``.np`` / ``.gpu``)."""

    def __init__(self, values):
        self.gpu = torch.as_tensor(values)
        self.np = self.gpu.numpy()


def test_the_stand_in_states_read_paths_only_inside_a_tree_step():
    """Outside ``tree_rows`` vLLM's own methods run; inside, the path-aware ops, with vLLM's
    tensors; every other attribute is the state's own."""
    from vllm_ddtree.spec_decode.tree_rows_v2 import (
        PathBadWords,
        PathPenalties,
        RowPaths,
        reads_row_paths,
        tree_rows,
    )

    calls = []
    penalties = SimpleNamespace(
        use_penalty=np.array([False, True]),
        repetition_penalty=_Staged([1.0, 1.5]),
        frequency_penalty=_Staged([0.0, 0.0]),
        presence_penalty=_Staged([0.0, 0.0]),
        prompt_bin_mask=torch.zeros(2, 2, dtype=torch.int32),
        output_bin_counts=torch.zeros(2, VOCAB, dtype=torch.int32),
        apply_penalties=lambda *a: calls.append("vllm penalties"),
    )
    bad_words = SimpleNamespace(
        num_bad_words=_Staged(np.array([0, 0], dtype=np.int32)),
        apply_bad_words=lambda *a: calls.append("vllm bad words"),
    )
    sampler = SimpleNamespace(penalties_state=penalties, bad_words_state=bad_words)
    logits = torch.ones(3, VOCAB)
    row_state = torch.tensor([1, 1, 1], dtype=torch.int32)
    args = (logits, row_state, np.array([1]), None, None)
    with tree_rows(sampler, None):
        sampler.penalties_state.apply_penalties(*args)
    assert calls == ["vllm penalties"]
    assert isinstance(sampler.penalties_state, PathPenalties)
    assert isinstance(sampler.bad_words_state, PathBadWords)
    assert sampler.penalties_state.output_bin_counts is penalties.output_bin_counts
    assert reads_row_paths(sampler, np.array([1]))
    assert not reads_row_paths(sampler, np.array([0]))
    paths = torch.tensor([[-1, -1], [4, -1], [4, 5]])
    rows = RowPaths(paths, (paths >= 0).sum(1))
    with tree_rows(sampler, rows):
        sampler.penalties_state.apply_penalties(*args)
        sampler.bad_words_state.apply_bad_words(*args)  # no request has words: nothing
    assert calls == ["vllm penalties"]
    # Repetition 1.5 on the tokens of each row's path: token 4 from row 1, 5 from row 2.
    assert logits[0].eq(1.0).all()
    assert logits[1, 4] == pytest.approx(1 / 1.5) and logits[1, 5] == 1.0
    assert logits[2, 4] == pytest.approx(1 / 1.5) and logits[2, 5] == pytest.approx(1 / 1.5)
    assert sampler.penalties_state.rows is None  # cleared after the step


def test_v2_logprobs_come_from_the_rows_of_the_accepted_path(monkeypatch):
    """vLLM's V2 layout: request r's j-th emitted token at row cu_num_logits[r] + j, scored
    from the row that chose it, by vLLM's own ``compute_topk_scores`` (a Triton kernel: its
    arguments are checked here, its scores on the GPU host)."""
    from vllm.v1.worker.gpu.sample import logprob

    from vllm_ddtree.spec_decode.tree_logprobs import emitted_logit_rows, tree_step_logprobs_v2

    first_row = torch.tensor([0, 5])
    accepted = torch.tensor([[0, 2, 4, -1], [0, -1, -1, -1]])
    num_accepted = torch.tensor([2, 0])
    requests = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1])
    local = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])
    rows = emitted_logit_rows(first_row, accepted, num_accepted, requests, local)
    assert rows.tolist() == [0, 2, 4, 0, 0, 5, 5, 5]

    def scores(logits, num_logprobs, tokens, cu_num_logits, **kwargs):
        return SimpleNamespace(
            logits=logits, num_logprobs=num_logprobs, tokens=tokens, cu=cu_num_logits, **kwargs
        )

    monkeypatch.setattr(logprob, "compute_topk_scores", scores)
    raw, processed = torch.randn(8, VOCAB), torch.randn(8, VOCAB)
    sampled = torch.tensor([[11, 12, 13, -1, -1], [21, -1, -1, -1, -1]])
    sampler = SimpleNamespace(
        logprobs_mode="raw_logprobs",
        returns_logprobs=lambda idx: True,
        sampling_states=SimpleNamespace(max_num_logprobs=lambda idx: 2),
        logprob_token_ids_state=SimpleNamespace(max_num_token_ids=lambda idx: 0),
    )
    batch = SimpleNamespace(
        idx_mapping_np=np.array([0, 1]),
        cu_num_logits_np=np.array([0, 5, 8]),
        expanded_idx_mapping=torch.tensor([0] * 5 + [1] * 3),
    )
    args = (batch, requests, local, first_row, accepted, num_accepted, sampled)
    got = tree_step_logprobs_v2(sampler, raw, processed, *args)
    assert torch.equal(got.logits, raw[rows])
    assert got.tokens.tolist() == [11, 12, 13, 0, 0, 21, 0, 0]
    assert got.cu == [0, 5, 8] and got.num_logprobs == 2 and not got.logits_mode
    sampler.logprobs_mode = "processed_logits"
    got = tree_step_logprobs_v2(sampler, raw, processed, *args)
    assert torch.equal(got.logits, processed[rows]) and got.logits_mode
    sampler.returns_logprobs = lambda idx: False
    assert tree_step_logprobs_v2(sampler, raw, processed, *args) is None


def test_v1_tree_sampler_draws_each_sampled_row_with_its_own_keyed_noise():
    """In a batch mixing greedy and sampled requests, each sampled row is the Gumbel-max
    sample with its own (seed, key) noise and each greedy row the argmax: the rows are not
    picked out on the host, every row is computed and the greedy ones put back."""
    from vllm_ddtree.ops.keyed_gumbel import keyed_gumbel_noise
    from vllm_ddtree.spec_decode.tree_sampling import target_tokens

    gen = torch.Generator().manual_seed(5)
    num_rows = 16
    logits = torch.randn(num_rows, VOCAB, generator=gen) * 0.3  # the noise decides most rows
    rows = torch.arange(num_rows) % 4  # four requests, four rows each
    metadata = SimpleNamespace(
        all_greedy=False,
        temperature=torch.tensor([0.0, 1.0, 0.0, 0.7]),
        top_k=None,
        top_p=None,
    )
    seeds = torch.tensor([3, 5, 7, 11])[rows]
    keys = torch.arange(num_rows) + 40
    chosen, _ = target_tokens(logits, metadata, lambda: rows, lambda r: (seeds, keys))
    temperature = metadata.temperature[rows]
    noise = keyed_gumbel_noise(seeds, keys.unsqueeze(1), VOCAB).squeeze(1)
    sampled = (logits / temperature.clamp(min=1e-9).unsqueeze(1) + noise).argmax(-1)
    want = torch.where(temperature > 0, sampled, logits.argmax(-1))
    assert torch.equal(chosen, want)
    assert not torch.equal(want, logits.argmax(-1))  # the noise moved some sampled rows


def test_v1_processed_logits_are_vllms_sampler_ones():
    """V1's tree sampler hands back the rows' processed logits as vLLM's V1 sampler reports
    them in a processed logprobs mode: the logits themselves in a greedy batch; in a batch
    that samples, every row after temperature (1 for a greedy row) and its top-k."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from vllm_ddtree.spec_decode.tree_sampling import target_tokens

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, VOCAB, generator=gen) * 3
    rows = torch.tensor([0, 0, 1, 1])
    greedy = SimpleNamespace(all_greedy=True)
    chosen, processed = target_tokens(logits, greedy, lambda: rows, None)
    assert processed is logits and torch.equal(chosen, logits.argmax(-1))

    mixed = SimpleNamespace(
        all_greedy=False,
        temperature=torch.tensor([0.0, 0.5]),
        top_k=torch.tensor([VOCAB, 5]),
        top_p=None,
    )

    def seeds_and_keys(request_of_row):
        return torch.tensor([7, 7, 9, 9]), torch.tensor([10, 11, 10, 11])

    chosen, processed = target_tokens(logits, mixed, lambda: rows, seeds_and_keys)
    temperature = torch.tensor([1.0, 1.0, 0.5, 0.5]).unsqueeze(1)
    want = apply_top_k_top_p(logits / temperature, torch.tensor([VOCAB, VOCAB, 5, 5]), None)
    assert torch.equal(processed, want)
    assert torch.equal(chosen[:2], logits[:2].argmax(-1))  # greedy rows
    assert torch.isfinite(processed[2:]).sum(1).tolist() == [5, 5]


def test_tree_row_outputs_count_the_outputs_and_each_nodes_own_path():
    from vllm_ddtree.spec_decode.tree_logits_processors import tree_row_outputs

    # Request 0: nodes 1 (under the root), 2 (under 1), 3 (under the root); request 1: no
    # drafts; request 2: drafts vLLM padded in without a tree (parents -1).
    rows = tree_row_outputs(
        outputs=[[5, 6], [7], [8]],
        token_ids=[[10, 11, 12], [0, 0, 0], [-1, -1, -1]],
        parents=[[0, 1, 0], [0, 0, 0], [-1, -1, -1]],
        num_draft=[3, 0, 2],
    )
    assert rows == [
        [5, 6],
        [5, 6, 10],
        [5, 6, 10, 11],
        [5, 6, 12],
        [7],
        [8],
        [8, -1],
        [8, -1],
    ]


def test_an_emitted_tokens_logprobs_come_from_its_path_nodes_row():
    """Request 0 (rows 0-4): path root -> node 2 -> node 4, bonus at node 4's row; request 1
    (rows 5-7): nothing accepted, the bonus at its root's row. Rows past a path repeat the
    root's (vLLM drops them with their -1 tokens)."""
    from vllm_ddtree.spec_decode.tree_logprobs import path_logit_rows

    first_row = torch.tensor([0, 5])
    accepted = torch.tensor([[0, 2, 4, -1], [0, -1, -1, -1]])
    num_accepted = torch.tensor([2, 0])
    rows = path_logit_rows(first_row, accepted, num_accepted, width=5)
    assert rows.tolist() == [0, 2, 4, 0, 0, 5, 5, 5, 5, 5]
    # A narrower output than the path's columns: the first ``width`` path nodes.
    assert path_logit_rows(first_row, accepted, num_accepted, width=2).tolist() == [0, 2, 5, 5]
