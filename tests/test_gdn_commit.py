"""The GatedDeltaNet commit after a tree walk: its PyTorch reference against the rule written
out row by row (the caches as vLLM's chain leaves them after the accepted path), and the
one-launch Triton kernel against the reference (bit for bit)."""

import os

import pytest
import torch

from tests.interpreter import run_under_interpreter
from vllm_ddtree.ops.gdn_commit import GDNStateLayers, commit_gdn_states, commit_gdn_states_ref

ON_GPU = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HV, DV, DK, CHANNELS, WIDTH, BUDGET = 3, 4, 8, 12, 4, 6
TOKENS = BUDGET + 1
KEPT = WIDTH - 1


# Where each speculative row's window was read this step (vLLM's num_accepted_tokens - 1).
WINDOW_OFFSETS = [2, 0, 5, 1, 3]


def make_layers(num_layers=3, max_rows=4, device="cpu", conv_dtype=torch.bfloat16, seed=0):
    """GDN layers in vLLM's layouts: SSM states a ``[blocks, Hv, V, K]`` view of a padded
    buffer (block stride past the state), the conv cache window-first ``[blocks, K - 1 + B,
    C]`` seen as ``[blocks, C, K - 1 + B]``; the step's buffers: speculative row ``s``'s
    nodes in blocks ``1 + s * T + t`` (block 0 is the null block), its window read from
    column ``WINDOW_OFFSETS[s]``."""
    gen = torch.Generator().manual_seed(seed)
    blocks = 1 + (max_rows + 1) * TOKENS
    ssm, ssm_blocks, conv, conv_blocks, inputs, offsets = [], [], [], [], [], []
    table = (1 + torch.arange((max_rows + 1) * TOKENS)).view(max_rows + 1, TOKENS)
    for _ in range(num_layers):
        padded = torch.randn(blocks, HV * DV * DK + 5, generator=gen)
        ssm.append(padded[:, : HV * DV * DK].view(blocks, HV, DV, DK))
        cache = torch.randn(blocks, KEPT + BUDGET, CHANNELS, generator=gen).to(conv_dtype)
        conv.append(cache.transpose(1, 2))
        ssm_blocks.append(table.to(torch.int32).clone())
        conv_blocks.append(table[:, 0].to(torch.int32).clone())
        inputs.append(torch.randn(max_rows + 1, TOKENS, CHANNELS, generator=gen).to(conv_dtype))
        offsets.append(torch.tensor(WINDOW_OFFSETS[: max_rows + 1], dtype=torch.int32))
    tensors = (ssm, ssm_blocks, conv, conv_blocks, inputs, offsets)
    moved = [[t.to(device) for t in group] for group in tensors]
    return GDNStateLayers.of(*moved, window=KEPT)


def walked_batch(device="cpu"):
    """Five batch rows: a branch, a chain-shaped path (no SSM copy), a row without drafts,
    a path shorter than the window, and a branch whose node 3 (its boundary node, below) sits
    in the column its leaf is copied to."""
    accepted = torch.tensor(
        [
            [0, 2, 5, 6, -1],
            [0, 1, 2, 3, 4],
            [0, -1, -1, -1, -1],
            [0, -1, -1, -1, -1],
            [0, 3, 4, 5, -1],
        ]
    )
    num_accepted = torch.tensor([3, 4, 0, 0, 3])
    num_draft = torch.tensor([BUDGET, BUDGET, 0, BUDGET, BUDGET - 1])
    return accepted.to(device), num_accepted.to(device), num_draft.to(device)


# Boundary depths (vLLM's align layout): row 0's path crosses a block boundary at its depth 1
# (node 2's state to column 1), row 1 (a chain) at depth 2, row 3 at its root, row 4 at depth
# 1 (node 3's state to column 1, read before the leaf's goes to column 3).
BOUNDARY = [1, 2, -1, 0, 1]


def expected_after(layers: GDNStateLayers, accepted, num_accepted, num_draft, boundary=None):
    """The commit written out per batch row and layer, on copies of the caches: the leaf's
    state in column ``taken``, the boundary node's in column ``depth``; the conv block from
    column 0: the read window's last ``K - 2`` inputs, then the path's inputs."""
    ssm = [t.clone() for t in layers.ssm_states]
    conv = [t.clone() for t in layers.conv_states]
    row = 0
    for r in range(accepted.shape[0]):
        if int(num_draft[r]) == 0:
            continue
        taken = int(num_accepted[r])
        path = [int(n) for n in accepted[r, : taken + 1]]
        copies = [(path[-1], taken)]
        if boundary is not None and int(boundary[r]) >= 0:
            depth = int(boundary[r])
            copies.append((path[depth], depth))
        for n in range(layers.num_layers):
            blocks = layers.ssm_blocks[n][row]
            for node, column in copies:
                ssm[n][int(blocks[column])] = layers.ssm_states[n][int(blocks[node])]
            block = int(layers.conv_blocks[n][row])
            first = int(layers.conv_offsets[n][row])
            window = [layers.conv_states[n][block, :, first + c] for c in range(KEPT)]
            layout = window[1:] + [layers.inputs[n][row, node] for node in path]
            for c, value in enumerate(layout):
                conv[n][block, :, c] = value
        row += 1
    return ssm, conv


def assert_same_blocks(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal in every block but vLLM's null block 0 (the reference writes rows without drafts
    there, harmlessly; the kernel skips them)."""
    assert torch.equal(got[1:], want[1:])


@pytest.mark.parametrize("with_boundary", [False, True])
def test_reference_leaves_the_accepted_path_as_vllms_chain_does(with_boundary):
    layers = make_layers()
    batch = walked_batch()
    boundary = torch.tensor(BOUNDARY) if with_boundary else None
    want_ssm, want_conv = expected_after(layers, *batch, boundary)
    commit_gdn_states_ref(layers, *batch, boundary)
    for n in range(layers.num_layers):
        assert_same_blocks(layers.ssm_states[n], want_ssm[n])
        assert_same_blocks(layers.conv_states[n], want_conv[n])


def test_the_window_after_each_path_depth_is_where_vllm_reads_it():
    """vLLM reads the window after ``j`` accepted tokens from column ``j - 1`` (its next
    step, ``num_accepted_tokens - 1``; its align copies, the boundary's depth): there lie the
    last ``K - 1`` inputs of (the window the step read, the path to depth ``j - 1``)."""
    layers = make_layers(num_layers=1)
    accepted, num_accepted, num_draft = walked_batch()
    before = layers.conv_states[0].clone()
    first = int(layers.conv_offsets[0][0])
    block = int(layers.conv_blocks[0][0])
    commit_gdn_states_ref(layers, accepted, num_accepted, num_draft)
    path = [int(n) for n in accepted[0, : int(num_accepted[0]) + 1]]
    history = [before[block, :, first + c] for c in range(KEPT)]
    for depth in range(len(path)):
        inputs = history + [layers.inputs[0][0, node] for node in path[: depth + 1]]
        for c in range(KEPT):
            got = layers.conv_states[0][block, :, depth + c]
            assert torch.equal(got, inputs[len(inputs) - KEPT + c]), (depth, c)


def test_layers_with_different_layouts_take_the_reference():
    """No pointer table where the layers' caches differ in layout: the launcher then commits
    through the reference, with the same result."""
    layers = make_layers(num_layers=2)
    assert layers.pointers is not None
    ssm = list(layers.ssm_states)
    ssm[1] = ssm[1].contiguous()  # another block stride
    mixed = GDNStateLayers.of(
        ssm,
        layers.ssm_blocks,
        layers.conv_states,
        layers.conv_blocks,
        layers.inputs,
        layers.conv_offsets,
        KEPT,
    )
    assert mixed.pointers is None
    batch = walked_batch()
    want_ssm, want_conv = expected_after(mixed, *batch)
    commit_gdn_states(mixed, *batch)
    for n in range(2):
        assert_same_blocks(mixed.ssm_states[n], want_ssm[n])
        assert_same_blocks(mixed.conv_states[n], want_conv[n])


@pytest.mark.interpreter
@pytest.mark.parametrize("block", [16, 2048])
@pytest.mark.parametrize("conv_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_boundary", [False, True])
def test_kernel_equals_reference(block, conv_dtype, with_boundary):
    """Every layer in one launch, bit for bit the reference: SSM chunks smaller and larger
    than a state, strided caches, a row without drafts, chain-shaped and short paths, with and
    without boundary copies (vLLM's align layout)."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs a GPU or the interpreter")
    device = "cuda" if ON_GPU else "cpu"
    kernel = make_layers(device=device, conv_dtype=conv_dtype)
    reference = make_layers(device=device, conv_dtype=conv_dtype)
    assert kernel.pointers is not None
    batch = walked_batch(device)
    boundary = torch.tensor(BOUNDARY, device=device) if with_boundary else None
    commit_gdn_states(kernel, *batch, boundary, block=block)
    commit_gdn_states_ref(reference, *batch, boundary)
    for n in range(kernel.num_layers):
        assert_same_blocks(kernel.ssm_states[n], reference.ssm_states[n])
        assert_same_blocks(kernel.conv_states[n], reference.conv_states[n])


@pytest.mark.interpreter
@pytest.mark.skipif(ON_GPU or INTERPRETED, reason="runs the kernel directly")
def test_kernel_under_interpreter():
    run_under_interpreter(__file__, "kernel_equals", expected=8, strict_scalars=True)
