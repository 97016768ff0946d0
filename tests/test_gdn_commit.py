"""The GatedDeltaNet commit after a tree walk: its PyTorch reference against the rule written
out row by row, and the one-launch Triton kernel against the reference (bit for bit)."""

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


def make_layers(num_layers=3, max_rows=4, device="cpu", conv_dtype=torch.bfloat16, seed=0):
    """GDN layers in vLLM's layouts: SSM states a ``[blocks, Hv, V, K]`` view of a padded
    buffer (block stride past the state), the conv cache window-first ``[blocks, K - 1 + B,
    C]`` seen as ``[blocks, C, K - 1 + B]``; the step's buffers: speculative row ``s``'s
    nodes in blocks ``1 + s * T + t`` (block 0 is the null block)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = 1 + (max_rows + 1) * TOKENS
    ssm, ssm_blocks, conv, conv_blocks, inputs = [], [], [], [], []
    table = (1 + torch.arange((max_rows + 1) * TOKENS)).view(max_rows + 1, TOKENS)
    for _ in range(num_layers):
        padded = torch.randn(blocks, HV * DV * DK + 5, generator=gen)
        ssm.append(padded[:, : HV * DV * DK].view(blocks, HV, DV, DK))
        cache = torch.randn(blocks, KEPT + BUDGET, CHANNELS, generator=gen).to(conv_dtype)
        conv.append(cache.transpose(1, 2))
        ssm_blocks.append(table.to(torch.int32).clone())
        conv_blocks.append(table[:, 0].to(torch.int32).clone())
        inputs.append(torch.randn(max_rows + 1, TOKENS, CHANNELS, generator=gen).to(conv_dtype))
    tensors = (ssm, ssm_blocks, conv, conv_blocks, inputs)
    moved = [[t.to(device) for t in group] for group in tensors]
    return GDNStateLayers.of(*moved, window=KEPT)


def walked_batch(device="cpu"):
    """Five batch rows: a branch, a chain-shaped path (no SSM copy), a row without drafts,
    a path shorter than the window (old columns stay), and a one-node branch."""
    accepted = torch.tensor(
        [
            [0, 2, 5, 6, -1],
            [0, 1, 2, 3, 4],
            [0, -1, -1, -1, -1],
            [0, -1, -1, -1, -1],
            [0, 3, -1, -1, -1],
        ]
    )
    num_accepted = torch.tensor([3, 4, 0, 0, 1])
    num_draft = torch.tensor([BUDGET, BUDGET, 0, BUDGET, BUDGET - 2])
    return accepted.to(device), num_accepted.to(device), num_draft.to(device)


def expected_after(layers: GDNStateLayers, accepted, num_accepted, num_draft):
    """The commit written out per batch row and layer, on copies of the caches."""
    ssm = [t.clone() for t in layers.ssm_states]
    conv = [t.clone() for t in layers.conv_states]
    row = 0
    for r in range(accepted.shape[0]):
        if int(num_draft[r]) == 0:
            continue
        taken = int(num_accepted[r])
        path = [int(n) for n in accepted[r, : taken + 1]]
        for n in range(layers.num_layers):
            blocks = layers.ssm_blocks[n][row]
            leaf_block, last_block = int(blocks[path[-1]]), int(blocks[taken])
            ssm[n][last_block] = layers.ssm_states[n][leaf_block]
            block = int(layers.conv_blocks[n][row])
            old = [layers.conv_states[n][block, :, c] for c in range(KEPT)]
            newest = old + [layers.inputs[n][row, node] for node in path]
            for c in range(KEPT):
                conv[n][block, :, c] = newest[len(newest) - KEPT + c]
        row += 1
    return ssm, conv


def assert_same_blocks(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal in every block but vLLM's null block 0 (the reference writes rows without drafts
    there, harmlessly; the kernel skips them)."""
    assert torch.equal(got[1:], want[1:])


def test_reference_commits_the_accepted_leaf_and_the_paths_newest_inputs():
    layers = make_layers()
    batch = walked_batch()
    want_ssm, want_conv = expected_after(layers, *batch)
    commit_gdn_states_ref(layers, *batch)
    for n in range(layers.num_layers):
        assert_same_blocks(layers.ssm_states[n], want_ssm[n])
        assert_same_blocks(layers.conv_states[n], want_conv[n])


def test_layers_with_different_layouts_take_the_reference():
    """No pointer table where the layers' caches differ in layout: the launcher then commits
    through the reference, with the same result."""
    layers = make_layers(num_layers=2)
    assert layers.pointers is not None
    ssm = list(layers.ssm_states)
    ssm[1] = ssm[1].contiguous()  # another block stride
    mixed = GDNStateLayers.of(
        ssm, layers.ssm_blocks, layers.conv_states, layers.conv_blocks, layers.inputs, KEPT
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
def test_kernel_equals_reference(block, conv_dtype):
    """Every layer in one launch, bit for bit the reference: SSM chunks smaller and larger
    than a state, strided caches, a row without drafts, chain-shaped and short paths."""
    if not (ON_GPU or INTERPRETED):
        pytest.skip("needs a GPU or the interpreter")
    device = "cuda" if ON_GPU else "cpu"
    kernel = make_layers(device=device, conv_dtype=conv_dtype)
    reference = make_layers(device=device, conv_dtype=conv_dtype)
    assert kernel.pointers is not None
    batch = walked_batch(device)
    commit_gdn_states(kernel, *batch, block=block)
    commit_gdn_states_ref(reference, *batch)
    for n in range(kernel.num_layers):
        assert_same_blocks(kernel.ssm_states[n], reference.ssm_states[n])
        assert_same_blocks(kernel.conv_states[n], reference.conv_states[n])


@pytest.mark.interpreter
@pytest.mark.skipif(ON_GPU or INTERPRETED, reason="runs the kernel directly")
def test_kernel_under_interpreter():
    run_under_interpreter(__file__, "kernel_equals", expected=4)
