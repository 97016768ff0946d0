"""DDTree draft trees: build, mask, walk, summarize, check.

Everything here is batched over requests (leading dim ``R``) and runs on CPU or CUDA tensors
without per-request Python loops or host synchronisation on the hot path (``build_trees``,
``ancestor_mask``, ``follow_tree``). Nothing in this module knows about vLLM.

Tree layout (per request, ``N`` = the tensor width = the budget):

* index 0 is the root, i.e. the bonus token the previous step committed; it is not stored in the
  node tensors and does not count against the budget;
* node ``i`` (0-based in the ``[R, N]`` tensors) has tree index ``i + 1``;
* ``parents`` holds tree indices (0 = root); a parent always has a smaller index than its child;
* nodes come in non-increasing score order; slots ``num_nodes[r] .. N-1`` are padding:
  every reader reads a tree's first ``num_nodes`` slots only. A tree built here or selected
  (``select_trees``) holds parent 0, depth 0, token -1 and score -inf there; a tree cut in
  place (the V2 proposal store's steady step) keeps the drafted nodes past its cut.

Construction (Ringel & Romano 2026, Prop. 2 and Lemma 1): the optimal tree under the drafter's
factorised distribution is the set of the ``budget`` prefixes with the highest product of
per-depth probabilities, restricted to each depth's ``top_k`` most probable tokens. Instead of the
paper's sequential best-first heap, we run a per-depth beam of width ``budget``: the ``budget``
best prefixes of depth ``d`` are always extensions of the ``budget`` best prefixes of depth
``d - 1`` (any other depth-``d`` prefix is beaten by the ``budget`` rank-0 extensions of better
parents), so the beams contain the global optimum, and one stable sort over all beams picks it.
Ties are broken towards shallower prefixes, which keeps the chosen set prefix-closed even when a
token has probability 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROOT = 0
PAD_TOKEN = -1


@dataclass
class DDTreeBatch:
    """A batch of draft trees, one per request.

    Attributes:
        token_ids: long ``[R, N]``, drafted token of each node (``-1`` in padding).
        parents: long ``[R, N]``, tree index of each node's parent (0 = root, node i = i + 1).
        depths: long ``[R, N]``, depth of each node (1..L; 0 in padding).
        scores: float32 ``[R, N]``, cumulative draft log-probability (``-inf`` in padding).
        num_nodes: long ``[R]``, number of real nodes per request (<= N).
        max_depth: depth limit ``L`` the tree was built for (rows of the drafter's logits);
            ``None`` means "the deepest node present".
    """

    token_ids: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    num_nodes: torch.Tensor
    max_depth: int | None = None

    @property
    def num_requests(self) -> int:
        return self.token_ids.shape[0]

    @property
    def tree_budget(self) -> int:
        """``N``: node slots per request (the tree budget the trees were built for)."""
        return self.token_ids.shape[1]

    @property
    def depth_limit(self) -> int:
        """``L``: the deepest depth any node may have."""
        if self.max_depth is not None:
            return self.max_depth
        return int(self.depths.max().item()) if self.depths.numel() else 0

    def valid_mask(self) -> torch.Tensor:
        """bool ``[R, N]``: True for real nodes, False for padding."""
        slots = torch.arange(self.tree_budget, device=self.token_ids.device)
        return slots.unsqueeze(0) < self.num_nodes.unsqueeze(1)

    def to(self, device: torch.device | str) -> DDTreeBatch:
        return DDTreeBatch(
            token_ids=self.token_ids.to(device),
            parents=self.parents.to(device),
            depths=self.depths.to(device),
            scores=self.scores.to(device),
            num_nodes=self.num_nodes.to(device),
            max_depth=self.max_depth,
        )


def _check_budget(tree_budget: int, top_k: int | None) -> None:
    if isinstance(tree_budget, bool) or not isinstance(tree_budget, int) or tree_budget < 1:
        raise ValueError(f"budget must be an int >= 1, got {tree_budget!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")


def token_log_probs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., K]``: the log-softmax of ``logits`` (``[..., V]``, any float dtype) over
    its last dim, read at ``token_ids`` (long ``[..., K]``), in float32. The reference of
    ``ops.tree_build``'s device path, which reads the logits in their own dtype and writes
    only the ``K`` values."""
    log_norm = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    return logits.gather(-1, token_ids).float() - log_norm


def candidate_cap(draft_logits: torch.Tensor, tree_budget: int, top_k: int | None) -> int | None:
    """Validate a tree build's arguments; the candidates per depth, ``K = min(top_k, budget,
    V)``, or ``None`` when there is nothing to build (no requests or no depths)."""
    if draft_logits.dim() != 3 or not draft_logits.is_floating_point():
        raise ValueError(
            f"draft_logits must be a float tensor [R, L, V], got {tuple(draft_logits.shape)} "
            f"{draft_logits.dtype}"
        )
    _check_budget(tree_budget, top_k)
    num_reqs, depth_limit, vocab = draft_logits.shape
    if num_reqs == 0 or depth_limit == 0:
        return None
    return min(tree_budget, vocab) if top_k is None else min(top_k, tree_budget, vocab)


def depth_candidates(
    draft_logits: torch.Tensor,
    tree_budget: int,
    top_k: int | None,
    log_probs_at=token_log_probs,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validate a tree build's arguments and rank each depth's tokens.

    Returns float32 ``[R, L, K]`` log-probabilities (non-increasing along ``K``) and long
    ``[R, L, K]`` token ids of each depth's ``K = min(top_k, budget, V)`` most probable tokens,
    or ``None`` when there is nothing to build (no requests or no depths). The tokens are the
    top-``K`` of the logits themselves (softmax keeps their order), and ``log_probs_at``
    (``token_log_probs``'s arguments and result) normalises only those: no float32
    log-softmax of the whole vocabulary is written and sorted.
    """
    cap = candidate_cap(draft_logits, tree_budget, top_k)
    if cap is None:
        return None
    top_tokens = torch.topk(draft_logits, cap, dim=-1).indices
    return log_probs_at(draft_logits, top_tokens), top_tokens


def build_trees(
    draft_logits: torch.Tensor, tree_budget: int, top_k: int | None = None
) -> DDTreeBatch:
    """Build one optimal DDTree per request from the drafter's per-depth logits.

    Args:
        draft_logits: float ``[R, L, V]``; row ``d`` holds the drafter's logits for the token at
            depth ``d + 1`` below the root (one row per masked position of the DFlash block).
        budget: number of nodes per tree (root excluded), ``N``.
        top_k: per-depth candidate cap (the ``top_k`` most probable tokens of each depth);
            ``None`` means no cap beyond the budget.

    Returns:
        A ``DDTreeBatch`` of width ``N = budget``. A request gets fewer than ``budget`` nodes
        only when fewer prefixes with non-zero probability exist. Prefixes through tokens of
        probability 0 (logit ``-inf``) are never drafted.
    """
    candidates = depth_candidates(draft_logits, tree_budget, top_k)
    if candidates is None:
        num_reqs, depth_limit, _ = draft_logits.shape
        return empty_batch(num_reqs, tree_budget, depth_limit, draft_logits.device)
    top_log_probs, top_tokens = candidates  # [R, L, K]
    num_reqs, depth_limit, cap = top_log_probs.shape
    device = draft_logits.device

    # Per-depth beams of width `budget`: score, parent slot in the previous beam, token.
    # Only the score top-k runs per depth (few launches); parents and tokens come after the loop.
    beam_scores = torch.full((num_reqs, tree_budget), float("-inf"), device=device)
    n_first = min(cap, tree_budget)
    beam_scores[:, :n_first] = top_log_probs[:, 0, :n_first]
    first_tokens = torch.full((num_reqs, tree_budget), PAD_TOKEN, dtype=torch.long, device=device)
    first_tokens[:, :n_first] = top_tokens[:, 0, :n_first]
    all_scores = [beam_scores]
    all_flat_idx = []
    for depth in range(1, depth_limit):
        # [R, budget * K] candidate extensions of every beam entry (-inf stays -inf).
        flat = (beam_scores.unsqueeze(2) + top_log_probs[:, depth].unsqueeze(1)).view(
            num_reqs, tree_budget * cap
        )
        beam_scores, flat_idx = torch.topk(flat, tree_budget, dim=-1)
        all_scores.append(beam_scores)
        all_flat_idx.append(flat_idx)
    all_tokens = [first_tokens]
    all_parent_slots = [torch.zeros((num_reqs, tree_budget), dtype=torch.long, device=device)]
    if all_flat_idx:
        flat_idx = torch.stack(all_flat_idx, dim=1)  # [R, L - 1, budget]
        all_parent_slots.append((flat_idx // cap).flatten(1))
        all_tokens.append(torch.gather(top_tokens[:, 1:], 2, flat_idx % cap).flatten(1))

    # Candidates laid out depth-major, so a stable sort breaks score ties towards shallow nodes.
    cand_scores = torch.cat(all_scores, dim=1)  # [R, L * budget]
    cand_tokens = torch.cat(all_tokens, dim=1)
    cand_parent_slots = torch.cat(all_parent_slots, dim=1)
    cand_depths = (
        torch.arange(1, depth_limit + 1, device=device)
        .repeat_interleave(tree_budget)
        .expand(num_reqs, -1)
    )
    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices
    chosen = order[:, :tree_budget]  # [R, N] candidate index of each node, in node order

    scores = torch.gather(cand_scores, 1, chosen)
    valid = torch.isfinite(scores)
    depths = torch.gather(cand_depths, 1, chosen)
    token_ids = torch.gather(cand_tokens, 1, chosen)

    # Tree index of every candidate (node position + 1; candidates left out map past the end).
    num_cands = cand_scores.shape[1]
    tree_index = torch.empty((num_reqs, num_cands), dtype=torch.long, device=device)
    tree_index.scatter_(
        1, order, torch.arange(1, num_cands + 1, device=device).expand(num_reqs, -1)
    )
    parent_cand = (depths - 2).clamp(min=0) * tree_budget + torch.gather(
        cand_parent_slots, 1, chosen
    )
    parents = torch.where(depths > 1, torch.gather(tree_index, 1, parent_cand), ROOT)

    parents = torch.where(valid, parents, ROOT)
    depths = torch.where(valid, depths, 0)
    token_ids = torch.where(valid, token_ids, PAD_TOKEN)
    scores = torch.where(valid, scores, float("-inf"))
    return DDTreeBatch(
        token_ids=token_ids,
        parents=parents,
        depths=depths,
        scores=scores,
        num_nodes=valid.sum(dim=1),
        max_depth=depth_limit,
    )


def empty_batch(num_reqs: int, width: int, depth_limit: int, device) -> DDTreeBatch:
    """A batch of ``num_reqs`` trees with no nodes (all ``width`` slots padding)."""
    return DDTreeBatch(
        token_ids=torch.full((num_reqs, width), PAD_TOKEN, dtype=torch.long, device=device),
        parents=torch.zeros((num_reqs, width), dtype=torch.long, device=device),
        depths=torch.zeros((num_reqs, width), dtype=torch.long, device=device),
        scores=torch.full((num_reqs, width), float("-inf"), device=device),
        num_nodes=torch.zeros((num_reqs,), dtype=torch.long, device=device),
        max_depth=depth_limit,
    )


def select_trees(trees: DDTreeBatch, index: torch.Tensor, max_nodes: torch.Tensor) -> DDTreeBatch:
    """The trees of rows ``index`` (long ``[R']``), each cut to its first ``max_nodes[r]``
    nodes (long ``[R']``; best-first order keeps a cut tree a tree). No host synchronisation."""
    num_nodes = torch.minimum(trees.num_nodes.index_select(0, index), max_nodes)
    slots = torch.arange(trees.tree_budget, device=index.device).unsqueeze(0)
    keep = slots < num_nodes.unsqueeze(1)
    return DDTreeBatch(
        token_ids=torch.where(keep, trees.token_ids.index_select(0, index), PAD_TOKEN),
        parents=torch.where(keep, trees.parents.index_select(0, index), 0),
        depths=torch.where(keep, trees.depths.index_select(0, index), 0),
        scores=torch.where(keep, trees.scores.index_select(0, index), float("-inf")),
        num_nodes=num_nodes,
        max_depth=trees.max_depth,
    )


def ancestor_mask(tree: DDTreeBatch) -> torch.Tensor:
    """Ancestor-only visibility inside each tree.

    Returns:
        bool ``[R, N + 1, N + 1]``: entry ``[r, i, j]`` is True iff tree index ``j`` is ``i`` or
        an ancestor of ``i`` (the root, index 0, is an ancestor of every node). Padding rows see
        only themselves and are seen by nobody.
    """
    num_reqs, width = tree.token_ids.shape
    device = tree.token_ids.device
    size = width + 1
    valid = torch.cat(
        [torch.ones((num_reqs, 1), dtype=torch.bool, device=device), tree.valid_mask()], dim=1
    )
    # parent_of[r, i] for tree index i; the root and padding point at themselves.
    self_index = torch.arange(size, device=device).expand(num_reqs, -1)
    parent_of = torch.cat(
        [torch.zeros((num_reqs, 1), dtype=torch.long, device=device), tree.parents], 1
    )
    parent_of = torch.where(valid, parent_of, self_index)
    parent_of[:, 0] = 0
    visible = torch.eye(size, dtype=torch.bool, device=device).expand(num_reqs, -1, -1).clone()
    visible |= torch.nn.functional.one_hot(parent_of, size).bool() & valid.unsqueeze(2)
    # Row i inherits its parent's row; depth L needs L - 1 rounds (parents precede children).
    for _ in range(max(tree.depth_limit - 1, 0)):
        inherited = torch.gather(visible, 1, parent_of.unsqueeze(2).expand(-1, -1, size))
        visible = visible | (inherited & valid.unsqueeze(2))
    return visible


def follow_tree(
    tree: DDTreeBatch, target_tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Walk each tree along the target's choices.

    Starting at the root, move to the child whose token equals the target's token at the
    current node, until no child matches.

    Args:
        tree: the verified trees, width ``N``, depth limit ``L``.
        target_tokens: long ``[R, N + 1]``, the target's chosen (argmax or sampled) token at
            every tree index (index 0 = root).

    Returns:
        ``accepted`` long ``[R, L + 1]``: accepted tree indices, root first, padded with -1;
        ``num_accepted`` long ``[R]``: accepted drafted nodes (0..L);
        ``bonus`` long ``[R]``: the target's token at the last accepted node.
    """
    num_reqs, width = tree.token_ids.shape
    if target_tokens.shape != (num_reqs, width + 1):
        raise ValueError(
            f"target_tokens must have shape [R, N + 1] = {[num_reqs, width + 1]}, "
            f"got {list(target_tokens.shape)}"
        )
    device = tree.token_ids.device
    target_tokens = target_tokens.to(device=device, dtype=torch.long)
    depth_limit = tree.depth_limit
    valid = tree.valid_mask()
    node_index = torch.arange(1, width + 1, device=device).expand(num_reqs, -1)

    accepted = torch.full((num_reqs, depth_limit + 1), -1, dtype=torch.long, device=device)
    accepted[:, 0] = ROOT
    current = torch.zeros(num_reqs, dtype=torch.long, device=device)
    alive = torch.ones(num_reqs, dtype=torch.bool, device=device)
    for depth in range(1, depth_limit + 1):
        wanted = torch.gather(target_tokens, 1, current.unsqueeze(1))  # [R, 1]
        is_child = valid & (tree.parents == current.unsqueeze(1)) & (tree.token_ids == wanted)
        found = is_child.any(dim=1) & alive
        child = torch.where(is_child, node_index, width + 1).min(dim=1).values
        current = torch.where(found, child, current)
        accepted[:, depth] = torch.where(found, child, -1)
        alive = found
    num_accepted = (accepted[:, 1:] >= 0).sum(dim=1)
    bonus = torch.gather(target_tokens, 1, current.unsqueeze(1)).squeeze(1)
    return accepted, num_accepted, bonus


def summarize(tree: DDTreeBatch, num_accepted: torch.Tensor | None = None) -> list[dict]:
    """Per-request debug metrics (host side; not for the hot path).

    Returns one dict per request with ``budget`` (slots), ``nodes``, ``max_depth``, ``leaves``,
    ``branching`` (nodes per depth, index 0 = depth 1) and ``accepted`` (when given).
    """
    token_ids = tree.token_ids.cpu()
    parents = tree.parents.cpu()
    depths = tree.depths.cpu()
    num_nodes = tree.num_nodes.cpu()
    out = []
    for r in range(tree.num_requests):
        n = int(num_nodes[r])
        node_depths = depths[r, :n]
        has_child = torch.zeros(n + 1, dtype=torch.bool)
        if n:
            has_child[parents[r, :n]] = True
        max_depth = int(node_depths.max()) if n else 0
        info = {
            "budget": tree.tree_budget,
            "nodes": n,
            "max_depth": max_depth,
            "leaves": int((~has_child[1:]).sum()),
            "branching": torch.bincount(node_depths, minlength=max_depth + 1)[1:].tolist(),
            "first_tokens": token_ids[r, : min(n, 8)].tolist(),
        }
        if num_accepted is not None:
            info["accepted"] = int(num_accepted[r])
        out.append(info)
    return out


def check_tree(tree: DDTreeBatch) -> None:
    """Raise ``ValueError`` naming the request and node of the first inconsistency found.

    Checks shapes and dtypes, ``num_nodes`` range, parent order (parent index < own index,
    parent a real node), depths (parent depth + 1, within 1..L), token ids (>= 0 for nodes,
    unique among siblings), padding values and non-increasing scores.
    """
    fields = ("token_ids", "parents", "depths", "scores")
    shape = tuple(tree.token_ids.shape)
    if len(shape) != 2:
        raise ValueError(f"token_ids must be [R, N], got shape {shape}")
    for name in fields:
        t = getattr(tree, name)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    for name in ("token_ids", "parents", "depths", "num_nodes"):
        if getattr(tree, name).dtype != torch.long:
            raise ValueError(f"{name} must be torch.long, got {getattr(tree, name).dtype}")
    if not tree.scores.is_floating_point():
        raise ValueError(f"scores must be floating point, got {tree.scores.dtype}")
    num_reqs, width = shape
    if tuple(tree.num_nodes.shape) != (num_reqs,):
        raise ValueError(f"num_nodes must be [R] = [{num_reqs}], got {tuple(tree.num_nodes.shape)}")
    token_ids, parents = tree.token_ids.cpu(), tree.parents.cpu()
    depths, scores, num_nodes = tree.depths.cpu(), tree.scores.cpu(), tree.num_nodes.cpu()
    limit = tree.max_depth
    for r in range(num_reqs):
        n = int(num_nodes[r])
        if not 0 <= n <= width:
            raise ValueError(f"request {r}: num_nodes {n} outside 0..{width}")
        seen: set[tuple[int, int]] = set()
        for i in range(n):
            where = f"request {r}, node {i} (tree index {i + 1})"
            parent, depth, token = int(parents[r, i]), int(depths[r, i]), int(token_ids[r, i])
            if not 0 <= parent <= i:
                raise ValueError(f"{where}: parent {parent} must be in 0..{i} (smaller index)")
            parent_depth = 0 if parent == 0 else int(depths[r, parent - 1])
            if depth != parent_depth + 1:
                raise ValueError(
                    f"{where}: depth {depth} != parent {parent}'s depth {parent_depth} + 1"
                )
            if limit is not None and depth > limit:
                raise ValueError(f"{where}: depth {depth} exceeds the depth limit {limit}")
            if token < 0:
                raise ValueError(f"{where}: token id {token} must be >= 0")
            if (parent, token) in seen:
                raise ValueError(f"{where}: token {token} repeats a sibling under parent {parent}")
            seen.add((parent, token))
            score = float(scores[r, i])
            if score != score:
                raise ValueError(f"{where}: score is NaN")
            if i and score > float(scores[r, i - 1]):
                raise ValueError(
                    f"{where}: score {score} exceeds the previous node's {float(scores[r, i - 1])}"
                    " (nodes must be in non-increasing score order)"
                )
        for i in range(n, width):
            where = f"request {r}, padding slot {i}"
            if int(parents[r, i]) != 0 or int(depths[r, i]) != 0 or int(token_ids[r, i]) != -1:
                raise ValueError(
                    f"{where}: padding must be parent 0, depth 0, token -1; got parent "
                    f"{int(parents[r, i])}, depth {int(depths[r, i])}, token {int(token_ids[r, i])}"
                )
