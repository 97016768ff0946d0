"""The one-launch tree walk and ancestor-mask kernels against their PyTorch references."""

import os

import pytest
import torch

from tests.interpreter import run_under_interpreter
from vllm_ddtree.ops.tree_mask import packed_ancestor_mask_ref
from vllm_ddtree.tree import build_trees, empty_batch

ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if ON_GPU else "cpu"

# (requests, depth, vocab, budget): one mask word and several; padding (vocab too small for
# the budget); depth 1; budget 1.
CASES = [(3, 4, 5, 10), (2, 16, 6, 100), (4, 3, 2, 40), (2, 1, 9, 5), (3, 6, 4, 1)]


def walked_batch(num_reqs, depth, vocab, budget, seed):
    """Trees from random logits and target tokens that mostly follow a child (deep walks)."""
    gen = torch.Generator().manual_seed(seed)
    tree = build_trees(torch.randn(num_reqs, depth, vocab, generator=gen) * 2, budget)
    target = torch.randint(0, vocab, (num_reqs, budget + 1), generator=gen)
    valid = tree.valid_mask()
    for r in range(num_reqs):
        for i in range(budget + 1):
            children = ((tree.parents[r] == i) & valid[r]).nonzero().flatten()
            if len(children) and torch.rand(1, generator=gen) < 0.85:
                pick = children[torch.randint(0, len(children), (1,), generator=gen)]
                target[r, i] = tree.token_ids[r, pick]
    return tree, target


def needs_kernel():
    if not (ON_GPU or INTERPRETED):
        pytest.skip("runs in the interpreter subprocess")


def assert_step_inputs_kernel_matches(tree, query_start, num_draft, num_scheduled, positions):
    """Run the step-inputs kernel and its reference on one step; return the reference rows."""
    from vllm_ddtree.ops.tree_inputs import tree_step_inputs_ref, tree_step_inputs_triton

    total = int(num_scheduled.sum())
    want_positions = positions.clone()
    want = tree_step_inputs_ref(tree, query_start, num_draft, num_scheduled, want_positions, total)
    on_device = [t.to(DEVICE) for t in (query_start, num_draft, num_scheduled, positions)]
    got = tree_step_inputs_triton(tree.to(DEVICE), *on_device, total)
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)
    assert torch.equal(on_device[3].cpu(), want_positions)
    return want


def whole_tree_step(tree):
    """Every request verifies its whole tree: 1 + N query tokens each, positions from 50 * r."""
    num_reqs, width = tree.token_ids.shape
    num_scheduled = torch.full((num_reqs,), width + 1)
    num_draft = torch.full((num_reqs,), width)
    query_start = torch.arange(num_reqs) * (width + 1)
    positions = torch.cat([torch.arange(width + 1) + 50 * r for r in range(num_reqs)])
    return query_start, num_draft, num_scheduled, positions


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES)
def test_kernel_whole_tree_rows_match_reference(case):
    needs_kernel()
    tree, _ = walked_batch(*case, seed=1)
    want = assert_step_inputs_kernel_matches(tree, *whole_tree_step(tree))
    # The rows are the packed ancestor matrix, request after request (padding nodes: zero).
    real = torch.arange(tree.tree_budget + 1).unsqueeze(0) <= tree.num_nodes.unsqueeze(1)
    matrix = packed_ancestor_mask_ref(tree) * real.unsqueeze(2)
    assert torch.equal(want, matrix.flatten(0, 1))


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES)
def test_kernel_trees_cut_in_place_match_their_cleaned_selection(case):
    """The V2 proposal store cuts a steady step's trees by their node counts alone, the
    drafted nodes left past the cut: the step-inputs and walk kernels read only each tree's
    first ``num_nodes`` slots, so they give what the references give on the cleaned
    selection (``select_trees``)."""
    needs_kernel()
    from vllm_ddtree.ops.tree_inputs import tree_step_inputs_ref, tree_step_inputs_triton
    from vllm_ddtree.ops.tree_walk import walk_and_emit_ref, walk_and_emit_triton
    from vllm_ddtree.tree import DDTreeBatch, select_trees

    tree, target = walked_batch(*case, seed=4)
    num_reqs, width = tree.token_ids.shape
    cut = (tree.num_nodes + 1) // 2
    in_place = DDTreeBatch(
        token_ids=tree.token_ids,
        parents=tree.parents,
        depths=tree.depths,
        scores=tree.scores,
        num_nodes=torch.minimum(tree.num_nodes, cut),
        max_depth=tree.max_depth,
    )
    cleaned = select_trees(tree, torch.arange(num_reqs), cut)
    num_scheduled = 1 + cut
    query_start = torch.cumsum(num_scheduled, 0) - num_scheduled
    total = int(num_scheduled.sum())
    positions = torch.arange(total) + 50
    want_positions = positions.clone()
    want = tree_step_inputs_ref(cleaned, query_start, cut, num_scheduled, want_positions, total)
    on_device = [t.to(DEVICE) for t in (query_start, cut, num_scheduled, positions)]
    got = tree_step_inputs_triton(in_place.to(DEVICE), *on_device, total)
    assert torch.equal(got.cpu(), want) and torch.equal(on_device[3].cpu(), want_positions)
    chosen = torch.cat([target[r, : 1 + int(cut[r])] for r in range(num_reqs)])
    walked = walk_and_emit_triton(
        in_place.to(DEVICE), chosen.to(DEVICE), on_device[0], on_device[1], width + 1
    )
    reference = walk_and_emit_ref(cleaned, chosen, query_start, cut, width + 1)
    for got_part, want_part in zip(walked, reference, strict=True):
        assert torch.equal(got_part.cpu(), want_part)


@pytest.mark.interpreter
def test_kernel_empty_trees_walk_nowhere():
    needs_kernel()
    from vllm_ddtree.ops.tree_walk import walk_and_emit_triton

    tree = empty_batch(2, 40, 5, DEVICE)
    chosen = torch.arange(82, device=DEVICE)
    first_row = torch.tensor([0, 41], device=DEVICE)
    num_draft = torch.tensor([40, 40], device=DEVICE)
    accepted, num_accepted, bonus, sampled = walk_and_emit_triton(
        tree, chosen, first_row, num_draft, 41
    )
    assert accepted.cpu().tolist() == [[0, -1, -1, -1, -1, -1]] * 2
    assert num_accepted.cpu().tolist() == [0, 0] and bonus.cpu().tolist() == [0, 41]
    assert sampled.cpu()[:, 0].tolist() == [0, 41] and bool((sampled.cpu()[:, 1:] == -1).all())


@pytest.mark.interpreter
@pytest.mark.skipif(ON_GPU or INTERPRETED, reason="already native or interpreted")
def test_kernels_under_interpreter():
    """This module's kernel tests, again, under Triton's interpreter."""
    run_under_interpreter(
        __file__,
        "kernel_",
        expected=8 * len(CASES)
        + 3
        + len(BUILD_CASES)
        + len(MAX_NODES_CASES)
        + len(TOP_CANDIDATE_CASES)
        + 1,
    )


def step_layout(seed):
    """A mixed step: a prefill request, a full tree, a chain-shaped tree shorter than its
    scheduled drafts (padding nodes), and a plain decode."""
    from vllm_ddtree.tree import DDTreeBatch

    gen = torch.Generator().manual_seed(seed)
    depth, budget = 5, 40
    full = build_trees(torch.randn(1, depth, 9, generator=gen), budget)
    chain = build_trees(torch.randn(1, depth, 9, generator=gen), budget, top_k=1)
    empty = empty_batch(1, budget, depth, "cpu")
    parts = [empty, full, chain, empty]
    trees = DDTreeBatch(
        *[torch.cat([getattr(p, f) for p in parts]) for f in ("token_ids", "parents", "depths")],
        scores=torch.cat([p.scores for p in parts]),
        num_nodes=torch.cat([p.num_nodes for p in parts]),
        max_depth=depth,
    )
    num_scheduled = torch.tensor([7, budget + 1, budget + 1, 1])
    num_draft = torch.tensor([0, budget, budget, 0])
    starts = torch.cumsum(num_scheduled, 0) - num_scheduled
    query_start = starts + num_scheduled - 1 - num_draft
    positions = torch.cat(
        [torch.arange(int(n)) + 100 * r for r, n in enumerate(num_scheduled.tolist())]
    )
    positions = torch.cat([positions, torch.full((5,), -7)])  # buffer longer than the step
    return trees, query_start, num_draft, num_scheduled, positions


def test_reference_step_inputs_move_node_positions_by_depth():
    from vllm_ddtree.ops.tree_inputs import tree_step_inputs_ref

    trees, query_start, num_draft, num_scheduled, positions = step_layout(0)
    total = int(num_scheduled.sum())
    before = positions.clone()
    mask = tree_step_inputs_ref(trees, query_start, num_draft, num_scheduled, positions, total)
    assert mask.shape == (total, 2)
    root = int(query_start[1])
    for i in range(1, 41):
        assert int(positions[root + i]) == int(before[root]) + int(trees.depths[1, i - 1])
    chain_root, chain_nodes = int(query_start[2]), int(trees.num_nodes[2])
    assert chain_nodes < 40  # padding nodes were scheduled
    assert torch.equal(
        positions[chain_root + chain_nodes + 1 : chain_root + 41],
        before[chain_root + chain_nodes + 1 : chain_root + 41],
    )
    assert torch.equal(positions[:7], before[:7]) and torch.equal(positions[total:], before[total:])
    assert not mask[:7].any() and not mask[chain_root + chain_nodes + 1 :].any()


@pytest.mark.interpreter
@pytest.mark.parametrize("seed", range(2))
def test_kernel_step_inputs_match_reference(seed):
    needs_kernel()
    assert_step_inputs_kernel_matches(*step_layout(seed))


# (requests, depth, vocab, budget, top_k): deep and wide, capped siblings, fewer prefixes than
# the budget (padding), depth 1, budget 1, and a budget past one frontier block.
BUILD_CASES = [
    (3, 15, 50, 64, None),
    (2, 6, 30, 40, 3),
    (2, 3, 2, 40, None),
    (3, 1, 20, 8, None),
    (2, 5, 10, 1, None),
    (1, 8, 40, 300, None),
    (2, 4, 2500, 24, 16),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", BUILD_CASES)
def test_kernel_build_matches_reference(case):
    needs_kernel()
    from vllm_ddtree.ops.tree_build import build_trees_ref, build_trees_triton

    num_reqs, depth, vocab, budget, top_k = case
    gen = torch.Generator().manual_seed(sum(case[:4]))
    logits = torch.randn(num_reqs, depth, vocab, generator=gen) * 3
    logits[0, 0, :3] = float("-inf")  # probability-0 tokens are never drafted
    want = build_trees_ref(logits, budget, top_k)
    got = build_trees_triton(logits.to(DEVICE), budget, top_k)
    for field in ("token_ids", "parents", "depths", "num_nodes"):
        assert torch.equal(getattr(got, field).cpu(), getattr(want, field)), field
    # Bit-identical under the interpreter; CUDA's exp/log round differently in the last bits.
    torch.testing.assert_close(got.scores.cpu(), want.scores, rtol=1e-5, atol=1e-5)
    assert got.max_depth == want.max_depth


# (rows, depth, vocab, cap, dtype): one segment, several with a partial last one, the cap at
# its largest, bf16 logits, a cap of one.
TOP_CANDIDATE_CASES = [
    (2, 3, 50, 16, torch.float32),
    (2, 4, 2500, 16, torch.float32),
    (1, 2, 1500, 32, torch.float32),
    (3, 2, 2100, 8, torch.bfloat16),
    (1, 1, 700, 1, torch.float32),
    # More segments than the cap: only the cap's first segments by maximum are searched.
    (2, 3, 20000, 4, torch.float32),
    (1, 2, 9000, 2, torch.bfloat16),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", TOP_CANDIDATE_CASES)
def test_kernel_top_candidates_match_reference(case):
    """Each depth's top tokens and their log-probabilities in one read of the logits, against
    ``torch.topk`` and the float32 log-softmax; tokens of probability 0 come last at -inf."""
    needs_kernel()
    from vllm_ddtree.ops.top_candidates import top_candidates_ref, top_candidates_triton

    num_reqs, depth, vocab, cap, dtype = case
    gen = torch.Generator().manual_seed(vocab + cap)
    logits = torch.randn(num_reqs, depth, vocab, generator=gen) * 3
    # The leading logits distinct in bf16 too (torch.topk orders ties its own way).
    leaders = torch.rand(num_reqs, depth, vocab, generator=gen).argsort(-1)[..., :40]
    logits.scatter_(-1, leaders, 20 + 0.25 * torch.arange(40.0).expand(num_reqs, depth, -1))
    logits[0, 0, : vocab - 2] = float("-inf")  # two tokens of non-zero probability
    logits[0, 0, vocab - 2 :] = torch.tensor([1.0, 2.0])
    logits = logits.to(dtype)
    want_lp, want_tokens = top_candidates_ref(logits, cap)
    got_lp, got_tokens = top_candidates_triton(logits.to(DEVICE), cap)
    finite = torch.isfinite(want_lp)
    assert torch.equal(finite, torch.isfinite(got_lp.cpu()))
    assert torch.equal(got_tokens.cpu()[finite], want_tokens[finite])
    torch.testing.assert_close(got_lp.cpu()[finite], want_lp[finite], rtol=1e-5, atol=1e-5)
    assert int(finite[0, 0].sum()) == min(2, cap)


@pytest.mark.interpreter
def test_kernel_top_candidates_take_the_lowest_token_among_equal_logits():
    """Equal logits in several segments, and a segment holding more of the row's top tokens
    than any other: the candidates come by logit, lowest token id first among equals, each
    token once."""
    needs_kernel()
    from vllm_ddtree.ops.top_candidates import SEGMENT, top_candidates_triton

    vocab, cap = 12 * SEGMENT + 100, 8
    logits = torch.full((1, 1, vocab), -5.0)
    logits[0, 0, [5 * SEGMENT + 7, 2 * SEGMENT + 3, 4 * SEGMENT + 1, 9]] = 3.0  # ties
    logits[0, 0, SEGMENT + 10 : SEGMENT + 14] = torch.tensor([4.0, 2.0, 2.5, 1.0])
    log_probs, tokens = top_candidates_triton(logits.to(DEVICE), cap)
    want = [SEGMENT + 10, 9, 2 * SEGMENT + 3, 4 * SEGMENT + 1, 5 * SEGMENT + 7]
    want += [SEGMENT + 12, SEGMENT + 11, SEGMENT + 13]
    assert tokens.flatten().tolist() == want
    expected = torch.log_softmax(logits.double(), -1)[0, 0, want].float()
    torch.testing.assert_close(log_probs.flatten().cpu(), expected, rtol=1e-5, atol=1e-5)


# (case index in BUILD_CASES, max_nodes): a search stopped inside the budget, at it, past it, at 0.
MAX_NODES_CASES = [(0, 5), (0, 64), (1, 100), (2, 3), (5, 0)]


@pytest.mark.interpreter
@pytest.mark.parametrize("case_index, max_nodes", MAX_NODES_CASES)
def test_kernel_build_stops_at_max_nodes(case_index, max_nodes):
    """A search stopped at ``max_nodes`` gives the budget's tree cut to its first nodes, the
    slots past them padding (also where earlier launches wrote nodes there)."""
    needs_kernel()
    from vllm_ddtree.ops.tree_build import build_trees_cut_ref, build_trees_ref, build_trees_triton

    num_reqs, depth, vocab, budget, top_k = BUILD_CASES[case_index]
    gen = torch.Generator().manual_seed(7 + case_index)
    logits = torch.randn(num_reqs, depth, vocab, generator=gen) * 3
    limit = torch.tensor([max_nodes])
    want = build_trees_cut_ref(logits, budget, top_k, limit)
    assert torch.equal(
        want.num_nodes, torch.clamp(build_trees_ref(logits, budget, top_k).num_nodes, max=max_nodes)
    )
    on_device = logits.to(DEVICE)
    build_trees_triton(on_device, budget, top_k)  # fills every slot first
    got = build_trees_triton(on_device, budget, top_k, limit.to(DEVICE))
    for field in ("token_ids", "parents", "depths", "num_nodes"):
        assert torch.equal(getattr(got, field).cpu(), getattr(want, field)), field
    torch.testing.assert_close(got.scores.cpu(), want.scores, rtol=1e-5, atol=1e-5)


def test_a_cut_build_is_the_full_trees_first_nodes():
    """``build_draft_trees`` with ``max_nodes`` (the reference on the CPU): each request's first
    ``max_nodes`` nodes of the budget's tree, then padding."""
    from vllm_ddtree.ops.tree_build import build_draft_trees

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 6, 40, generator=gen) * 2
    full = build_draft_trees(logits, 32, 8)
    cut = build_draft_trees(logits, 32, 8, torch.tensor([10]))
    assert cut.token_ids.shape == full.token_ids.shape
    assert torch.equal(cut.num_nodes, torch.full((3,), 10))
    for field in ("token_ids", "parents", "depths", "scores"):
        assert torch.equal(getattr(cut, field)[:, :10], getattr(full, field)[:, :10]), field
    assert (cut.token_ids[:, 10:] == -1).all() and (cut.parents[:, 10:] == 0).all()
    assert (cut.depths[:, 10:] == 0).all() and torch.isinf(cut.scores[:, 10:]).all()


def test_torch_ops_switch_selects_the_references(monkeypatch):
    from vllm_ddtree.envs import TORCH_OPS as TORCH_OPS_ENV
    from vllm_ddtree.ops import use_triton

    monkeypatch.delenv(TORCH_OPS_ENV, raising=False)
    assert use_triton(torch.device("cuda")) and not use_triton(torch.device("cpu"))
    monkeypatch.setenv(TORCH_OPS_ENV, "1")
    assert not use_triton(torch.device("cuda"))


def cut_tree(tree, keep: list[int]):
    """Each request's first ``keep[r]`` nodes (a prefix of a score-ordered tree is a tree)."""
    from vllm_ddtree.tree import DDTreeBatch

    num_nodes = torch.minimum(tree.num_nodes, torch.tensor(keep))
    real = torch.arange(tree.tree_budget).unsqueeze(0) < num_nodes.unsqueeze(1)
    return DDTreeBatch(
        token_ids=torch.where(real, tree.token_ids, -1),
        parents=torch.where(real, tree.parents, 0),
        depths=torch.where(real, tree.depths, 0),
        scores=torch.where(real, tree.scores, float("-inf")),
        num_nodes=num_nodes,
        max_depth=tree.max_depth,
    )


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sampled_dtype", [torch.int32, torch.int64])
def test_kernel_walk_and_emit_matches_reference(case, sampled_dtype):
    """The sampled rows in vLLM's V1 (int32) and V2 (int64) sampler formats."""
    needs_kernel()
    from vllm_ddtree.ops.tree_walk import walk_and_emit_ref, walk_and_emit_triton

    tree, target = walked_batch(*case, seed=2)
    num_reqs, width = tree.token_ids.shape
    # Request 0 scheduled no drafts, request 1 a cut tree, the rest their whole trees.
    num_draft = [0] + [max(width // 2, 1)] + [width] * (num_reqs - 2)
    tree = cut_tree(tree, num_draft)
    chosen = torch.cat([target[r, : 1 + n] for r, n in enumerate(num_draft)])
    sizes = torch.tensor([1 + n for n in num_draft])
    first_row = torch.cumsum(sizes, 0) - sizes
    num_draft = torch.tensor(num_draft)
    out_width = int(num_draft.max()) + 1
    want = walk_and_emit_ref(tree, chosen, first_row, num_draft, out_width, sampled_dtype)
    got = walk_and_emit_triton(
        tree.to(DEVICE),
        chosen.to(DEVICE),
        first_row.to(DEVICE),
        num_draft.to(DEVICE),
        out_width,
        sampled_dtype,
    )
    for name, w, g in zip(("accepted", "num_accepted", "bonus", "sampled"), want, got, strict=True):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w), name
    if num_reqs > 2:
        assert int(want[1][2:].max()) >= 1  # a whole tree was walked below its root


@pytest.mark.interpreter
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "hidden_widths", [(40, 40, 40), (40,) * 5, (40, 24, 40, 40, 40, 40), (40,) * 9]
)
def test_kernel_path_rows_match_reference(case, hidden_widths):
    """One launch for the ids, the positions and up to eight hidden tensors of a width (a
    DFlash drafter's feature layers: five for z-lab's, four for this project's drafter);
    more tensors, or tensors of other widths, in further launches."""
    needs_kernel()
    from vllm_ddtree.ops.drafter_rows import move_path_rows_ref, move_path_rows_triton
    from vllm_ddtree.tree import follow_tree

    tree, target = walked_batch(*case, seed=3)
    accepted, num_accepted, _ = follow_tree(tree, target)
    num_reqs, width = tree.token_ids.shape
    root = torch.arange(num_reqs) * (width + 1) + 2  # two prefill rows before the first tree
    total = num_reqs * (width + 1) + 2
    num_draft = torch.full((num_reqs,), width)
    num_draft[0] = 0  # a request without drafts: its root row only
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 1000, (total,), generator=gen, dtype=torch.int32)
    positions = torch.randint(0, 1000, (total,), generator=gen)
    hidden = [torch.randn(total, w, generator=gen) for w in hidden_widths]
    want = [t.clone() for t in (input_ids, positions, *hidden)]
    move_path_rows_ref(want[0], want[1], want[2:], root, accepted, num_accepted, num_draft, width)
    if width > 1:
        assert not torch.equal(want[2], hidden[0])  # some path was not contiguous
    got = [t.to(DEVICE) for t in (input_ids, positions, *hidden)]
    move_path_rows_triton(
        got[0],
        got[1],
        got[2:],
        root.to(DEVICE),
        accepted.to(DEVICE),
        num_accepted.to(DEVICE),
        num_draft.to(DEVICE),
        width,
    )
    for w, g in zip(want, got, strict=True):
        assert torch.equal(g.cpu(), w)


def test_drafter_context_rows_are_the_path_then_fresh_positions():
    """After the walk each request's rows hold the accepted path in order, and every row from
    the root on has its own position (root, root + 1, ...): other branches' rows, which share
    depths with the path, must not share its positions (the drafter stores context K/V by
    position). Rows of requests without drafts and rows before the first root stay put."""
    from vllm_ddtree.ops.drafter_rows import move_path_rows_ref

    # Request 0: a prefill chunk (rows 0-1) then its root (row 2), no drafts. Request 1: root
    # at row 3 with a tree of 4 nodes in rows 4-7: node 1 and 2 at depth 1, node 3 under 2,
    # node 4 under 1; accepted path root -> 2 -> 3.
    positions = torch.tensor([10, 11, 12, 40, 41, 41, 42, 42])
    hidden = [torch.arange(8.0).unsqueeze(1).repeat(1, 3)]
    input_ids = torch.arange(100, 108, dtype=torch.int32)
    root = torch.tensor([2, 3])
    accepted = torch.tensor([[0, -1, -1], [0, 2, 3]])
    num_accepted = torch.tensor([0, 2])
    num_draft = torch.tensor([0, 4])
    move_path_rows_ref(input_ids, positions, hidden, root, accepted, num_accepted, num_draft, 4)
    assert input_ids.tolist()[:6] == [100, 101, 102, 103, 105, 106]
    assert hidden[0][:, 0].tolist()[:6] == [0, 1, 2, 3, 5, 6]
    assert positions.tolist() == [10, 11, 12, 40, 41, 42, 43, 44]


@pytest.mark.skipif(not ON_GPU, reason="vLLM's kernel needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_device_log_probs_match_the_reference_at_qwen3s_vocabulary(dtype):
    from vllm_ddtree.ops.tree_build import device_log_probs
    from vllm_ddtree.tree import depth_candidates, token_log_probs

    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(4, 15, 151936, generator=gen) * 4).to(DEVICE, dtype)
    logits[1, 2, :100] = float("-inf")
    log_probs, tokens = depth_candidates(logits, 64, None, device_log_probs)
    torch.testing.assert_close(log_probs, token_log_probs(logits, tokens), rtol=0, atol=1e-4)
    want = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(log_probs, torch.topk(want, 64, dim=-1).values, rtol=0, atol=1e-4)
