"""DDTree's step on vLLM's V2 model runner (``spec_decode/v2_hooks.py``, the speculator) on the
CPU, where vLLM's V2 runner cannot run: its functions on stand-ins for vLLM's runner, sampler
and speculator (PyTorch references), the speculator's draft step with the test oracle, and the
drafts handed to the scheduler. Its end-to-end check is ``benchmarks/lossless_gpu.py --runner
v2`` on a GPU host."""

import pytest
import torch

pytest.importorskip("vllm")


def test_one_v2_step_on_a_stand_in_runner(monkeypatch):
    """prepare_attn -> sample -> propose's row move, with stand-ins for vLLM's runner, sampler
    and speculator (PyTorch references): a prefill chunk and two trees in one batch, requests
    stored at other state slots than their batch rows. Checks the depth positions and masks the
    forward gets, the sampler rows (path + bonus, vLLM's num_sampled / num_rejected), the
    walked step handed to the rank comparison under ``VLLM_DDTREE_CHECK_RANKS=1`` and the
    drafter's context rows afterwards."""
    from types import SimpleNamespace

    import numpy as np

    import vllm_ddtree.spec_decode.tree_step as tree_step
    import vllm_ddtree.spec_decode.v2_hooks as v2_hooks
    from vllm_ddtree.envs import CHECK_RANKS as RANK_CHECK_ENV
    from vllm_ddtree.ops.tree_mask import packed_ancestor_mask_ref
    from vllm_ddtree.spec_decode.proposal_store import ProposalStore
    from vllm_ddtree.spec_decode.step_state import StepState
    from vllm_ddtree.tree import build_trees

    budget, depth, vocab = 6, 4, 40
    gen = torch.Generator().manual_seed(5)
    proposed = build_trees(torch.randn(2, depth, vocab, generator=gen) * 3, budget)
    # State slots: request A (batch row 1) at slot 3, B (row 2) at slot 0; row 0 is a prefill.
    proposals = ProposalStore(4, budget, depth, torch.device("cpu"))
    proposals.write_batch(proposed)
    proposals.proposed(np.array([3, 0]), torch.tensor([3, 0]), ["A", "B"])
    proposals.flush()  # kept per request state, as after a step with other rows
    speculator = SimpleNamespace(
        ddtree=SimpleNamespace(tree_budget=budget, depth=depth),
        proposals=proposals,
        state=StepState(),
    )
    counts = np.array([5, 1 + budget, 1 + 4], dtype=np.int32)  # B's tree cut to 4 nodes
    num_draft = np.array([0, budget, 4], dtype=np.int32)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    total = int(counts.sum())
    positions = torch.cat(
        [torch.arange(5) + 20, torch.arange(1 + budget) + 50, torch.arange(5) + 80]
    )
    batch = SimpleNamespace(
        num_reqs=3,
        num_tokens=total,
        num_draft_tokens=int(num_draft.sum()),
        num_draft_tokens_per_req=num_draft,
        num_scheduled_tokens=counts,
        query_start_loc_np=starts,
        idx_mapping=torch.tensor([1, 3, 0], dtype=torch.int32),
        idx_mapping_np=np.array([1, 3, 0]),
        req_ids=["prefill", "A", "B"],
        positions=positions.clone(),
        input_ids=torch.arange(total, dtype=torch.int32),
        # logits rows: the prefill's last token, then every tree token
        logits_indices=torch.tensor([4, *range(5, total)]),
        cu_num_logits=torch.tensor([0, 1, 2 + budget, 2 + budget + 5]),
        expanded_idx_mapping=None,
        expanded_local_pos=None,
        seq_lens=torch.tensor([30, 60, 90]),
    )
    slot_mapping = torch.arange(total) + 1000
    runner = SimpleNamespace(speculator=speculator, attn_groups=[])
    v2_hooks.after_prepare_attn(runner, batch, slot_mapping[None])

    step = speculator.state.step
    assert step.root_row.tolist() == [4, 5, 5 + 1 + budget]
    assert step.trees.num_nodes.tolist() == [0, int(proposed.num_nodes[0]), 4]
    assert step.widest == budget  # where an "auto" drafter stops its next search
    # The forward's positions: root + depth for every node, sequential elsewhere.
    want = positions.clone()
    for r, root in ((0, 5), (1, 5 + 1 + budget)):
        n = int(step.trees.num_nodes[r + 1])
        want[root + 1 : root + 1 + n] = positions[root] + proposed.depths[r, :n]
    assert torch.equal(batch.positions, want)
    published = speculator.state.published_trees()
    assert published.is_tree.tolist() == [0, 1, 1]
    masks = packed_ancestor_mask_ref(step.trees)
    assert torch.equal(published.tree_mask[5 : 5 + 1 + budget], masks[1])

    # The target's choices: follow each tree to a leaf where possible, then a fresh token.
    chosen = torch.full((total,), 7)
    rows = {}
    for r, root in ((1, 5), (2, 5 + 1 + budget)):
        tree, node, path = step.trees, 0, []
        while True:
            kids = [i for i in range(int(tree.num_nodes[r])) if int(tree.parents[r, i]) == node]
            if not kids:
                break
            child = kids[-1]
            chosen[root + node] = tree.token_ids[r, child]
            path.append(child + 1)
            node = child + 1
        chosen[root + node] = 3  # the bonus
        rows[r] = [int(tree.token_ids[r, i - 1]) for i in path] + [3]
    logit_rows = chosen[batch.logits_indices]

    def get_num_sampled_and_rejected(num_sampled, seq_lens, cu, idx, prefill):
        return num_sampled, (cu[1:] - cu[:-1]) - num_sampled  # no chunked prefill here

    monkeypatch.setattr(
        "vllm.v1.worker.gpu.input_batch.get_num_sampled_and_rejected",
        get_num_sampled_and_rejected,
    )
    runner.model = SimpleNamespace(compute_logits=lambda h: h)
    runner.sampler = SimpleNamespace(
        sample=lambda logits, *a, **options: (logits, None),
        req_states=SimpleNamespace(prefill_len=SimpleNamespace(gpu=None)),
        returns_logprobs=lambda idx_mapping_np: False,
        # No request has penalties or bad words.
        penalties_state=SimpleNamespace(use_penalty=np.zeros(4, dtype=bool)),
        bad_words_state=SimpleNamespace(num_bad_words=SimpleNamespace(np=np.zeros(4, np.int32))),
    )
    runner.compilation_config = SimpleNamespace(static_forward_context={})  # no KV layers
    hidden = torch.zeros(total, dtype=torch.long)
    hidden[batch.logits_indices] = logit_rows
    checked = []  # tensor parallel: the walked trees go to the rank comparison
    monkeypatch.setenv(RANK_CHECK_ENV, "1")
    monkeypatch.setattr(tree_step, "check_ranks_agree", checked.append)
    sampled = v2_hooks.sample(runner, hidden, batch, None)
    assert sampled is not None  # the tree path ran, not vLLM's sampler
    output, num_sampled, num_rejected = sampled
    assert checked == [step] and step.accepted is not None
    assert num_sampled.tolist() == [1, len(rows[1]), len(rows[2])]
    assert num_rejected.tolist() == [0, 1 + budget - len(rows[1]), 5 - len(rows[2])]
    assert output.sampled_token_ids[0, 0] == 7  # the prefill's next token
    for r in (1, 2):
        assert output.sampled_token_ids[r, : len(rows[r])].tolist() == rows[r]
    assert min(len(rows[1]), len(rows[2])) >= 2  # both walks accepted nodes


def test_the_speculators_draft_step_ranks_the_oracles_future(tmp_path):
    """``DDTreeSpeculator.sample_draft`` with the test oracle: vLLM passes each mask row's
    predicted position minus 2 and its request state; the tree's first path must be the bound
    sequence's next tokens."""
    import json
    from types import SimpleNamespace

    from vllm_ddtree.spec_decode.proposal_store import ProposalStore
    from vllm_ddtree.spec_decode.speculator import ddtree_speculator_class
    from vllm_ddtree.testing.oracle import OracleDraftSource

    depth, budget, vocab = 3, 6, 50
    sequence = [1, 2, 3, 4, 5, 11, 12, 13, 14]
    path = tmp_path / "oracle.json"
    path.write_text(json.dumps({"p_top": 1.0, "sequences": [sequence]}))
    source = OracleDraftSource(str(path), vocab, max_num_reqs=4, device=torch.device("cpu"))
    source.oracle.bind([2], ["a"], lambda s: sequence[:5])
    heads = []  # the drafter's output head still runs under the oracle (its cost)
    speculator = SimpleNamespace(
        ddtree=SimpleNamespace(depth=depth, tree_budget=budget, tree_top_k=budget),
        draft_source=source,
        proposals=ProposalStore(4, budget, depth, torch.device("cpu")),
        model=SimpleNamespace(compute_logits=lambda h: heads.append(h.shape) or h),
        search_nodes=None,
    )
    bonus = 4  # the bonus token's position; mask d predicts position bonus + 1 + d
    keys = torch.tensor([bonus + 1 + d for d in range(depth)]) - 2
    draft = ddtree_speculator_class().sample_draft
    hidden = torch.zeros(depth, 8)
    greedy = torch.zeros(4)  # temperature by request state: the tree keeps the oracle's ranks
    seeds = torch.zeros(4, dtype=torch.long)
    states = torch.tensor([2, 2, 2], dtype=torch.int32)
    placeholder = draft(speculator, hidden, keys, states, greedy, seeds)
    assert placeholder.shape == (depth,)
    assert heads == [hidden.shape]
    trees = speculator.proposals.batch
    assert trees.token_ids[0, :depth].tolist() == sequence[5 : 5 + depth]
    assert trees.parents[0, :depth].tolist() == list(range(depth))


def test_an_auto_speculator_searches_its_trees_to_the_widest_tree_just_verified(tmp_path):
    """An online "auto" engine's ``search_nodes``: the most nodes a request was scheduled in
    the step just verified (the budget served at this batch size), the budget after a step
    without trees; ``sample_draft`` stops each tree's search there (padding after)."""
    import json
    from types import SimpleNamespace

    from vllm_ddtree.spec_decode.proposal_store import ProposalStore
    from vllm_ddtree.spec_decode.speculator import ddtree_speculator_class
    from vllm_ddtree.testing.oracle import OracleDraftSource

    depth, budget, vocab = 3, 6, 50
    cls = ddtree_speculator_class()
    speculator = SimpleNamespace(
        ddtree=SimpleNamespace(depth=depth, tree_budget=budget, tree_top_k=budget),
        search_nodes=torch.full((1,), budget),
        searched=budget,
    )
    for widest, searched in ((4, 4), (0, budget), (None, budget)):
        cls._set_search_nodes(speculator, SimpleNamespace(widest=widest))
        assert speculator.search_nodes.tolist() == [searched], widest
    cls._set_search_nodes(speculator, None)  # a step without trees
    assert speculator.search_nodes.tolist() == [budget]

    sequence = [1, 2, 3, 4, 5, 11, 12, 13, 14]
    path = tmp_path / "oracle.json"
    path.write_text(json.dumps({"p_top": 1.0, "sequences": [sequence]}))
    source = OracleDraftSource(str(path), vocab, max_num_reqs=4, device=torch.device("cpu"))
    source.oracle.bind([2], ["a"], lambda s: sequence[:5])
    speculator.draft_source = source
    speculator.proposals = ProposalStore(4, budget, depth, torch.device("cpu"))
    speculator.model = SimpleNamespace(compute_logits=lambda h: h)
    speculator.search_nodes = torch.tensor([2])
    keys = torch.tensor([4 + 1 + d for d in range(depth)]) - 2
    states = torch.tensor([2, 2, 2], dtype=torch.int32)
    seeds = torch.zeros(4, dtype=torch.long)
    cls.sample_draft(speculator, torch.zeros(depth, 8), keys, states, torch.zeros(4), seeds)
    trees = speculator.proposals.batch
    assert int(trees.num_nodes[0]) == 2
    assert trees.token_ids[0, :2].tolist() == sequence[5:7]
    assert trees.token_ids[0, 2:].tolist() == [-1] * (budget - 2)


def test_the_chain_oracle_speculator_drafts_the_oracles_future(tmp_path):
    """Test switch (scale models): vLLM's V2 DFlash chain speculator drafting from the oracle's
    logits; with a rank model that always ranks the future first, its greedy drafts are the
    bound sequence's next tokens, one per mask row."""
    import json
    from types import SimpleNamespace

    from vllm_ddtree.testing.oracle import OracleDraftSource, chain_oracle_speculator_class

    depth, vocab = 3, 128
    sequence = [1, 2, 3, 4, 5, 11, 12, 13, 14]
    model = {"p_top": 1.0, "decay": 1.0, "tail": 0.0, "slope": 3.0, "miss_slope": 1.0}
    path = tmp_path / "oracle.json"
    path.write_text(json.dumps({"seed": 0, "sequences": [sequence], "rank_model": model}))
    source = OracleDraftSource(str(path), vocab, max_num_reqs=4, device=torch.device("cpu"))
    source.oracle.bind([2], ["a"], lambda s: sequence[:5])
    heads = []  # the drafter's output head still runs under the oracle (its cost)
    speculator = SimpleNamespace(
        draft_source=source,
        num_speculative_steps=depth,
        model=SimpleNamespace(compute_logits=lambda h: heads.append(h.shape) or h),
    )
    bonus = 4
    keys = torch.tensor([bonus + 1 + d for d in range(depth)]) - 2
    draft = chain_oracle_speculator_class().sample_draft
    states = torch.tensor([2, 2, 2], dtype=torch.int32)
    drafts = draft(speculator, torch.zeros(depth, 8), keys, states, torch.zeros(4), None, 0, None)
    assert drafts.tolist() == sequence[5 : 5 + depth]
    assert heads == [(depth, 8)]


def test_the_v2_drafts_for_the_scheduler_carry_the_trees_parents():
    """Steps with structured outputs: vLLM's V2 runner hands the scheduler its drafts
    (``take_draft_token_ids``); with DDTree the trees' parents go along, for the grammar
    bitmask of each node's own path, and nothing is attached when none were proposed."""
    from types import SimpleNamespace

    import vllm_ddtree.spec_decode.v2_hooks as v2_hooks
    from vllm_ddtree.requests.structured_outputs import TREE_PARENTS_ATTR, ParentsToHost

    parents = ParentsToHost()
    speculator = SimpleNamespace(ddtree=object(), parents_to_host=parents)
    runner = SimpleNamespace(speculator=speculator)
    drafts = SimpleNamespace(req_ids=["a", "b"], draft_token_ids=[[5, 6, 7], [8, 9, 1]])
    parents.start(torch.tensor([[0, 1, 0], [0, 0, 2], [9, 9, 9]]))
    taken = v2_hooks.with_tree_parents_of(runner, drafts)
    assert getattr(taken, TREE_PARENTS_ATTR) == [[0, 1, 0], [0, 0, 2]]
    parents.clear()
    other = SimpleNamespace(req_ids=["a"], draft_token_ids=[[5]])
    assert not hasattr(v2_hooks.with_tree_parents_of(runner, other), TREE_PARENTS_ATTR)
