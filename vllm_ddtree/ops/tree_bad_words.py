"""Bad words on a tree step's rows: Triton kernel, launcher and PyTorch reference.

A bad word's last token is banned at a row whose past ends with the word's other tokens. A
tree row's past is its request's outputs (``all_token_ids[state, prompt_len:total_len]``, the
root's token the last of them) followed by the row's path tokens (``path_tokens.py``): what
target-alone decoding has seen when it reaches that node. The words are vLLM's V2 layout
(``BadWordsState``): per request state the words' tokens back to back and their offsets.

Shapes: ``logits`` ``[rows, V]`` (changed in place), ``row_state`` int ``[rows]``,
``path_tokens`` long ``[rows, L]``, ``path_len`` long ``[rows]``; vLLM's state:
``word_tokens`` int32 ``[S, T]``, ``word_offsets`` int32 ``[S, W + 1]``, ``num_words`` int32
``[S]``, ``all_token_ids`` ``[S, max_model_len]``, ``prompt_len`` / ``total_len`` ``[S]``.
"""

from __future__ import annotations

import torch

from vllm_ddtree.ops import use_triton

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False


def apply_tree_bad_words_ref(
    logits: torch.Tensor,
    row_state: torch.Tensor,
    path_tokens: torch.Tensor,
    path_len: torch.Tensor,
    word_tokens: torch.Tensor,
    word_offsets: torch.Tensor,
    num_words: torch.Tensor,
    all_token_ids: torch.Tensor,
    prompt_len: torch.Tensor,
    total_len: torch.Tensor,
    max_num_words: int,
) -> None:
    """PyTorch reference (reads everything on the host, row by row)."""
    for row, state in enumerate(row_state.tolist()):
        count = min(int(num_words[state]), max_num_words)
        if count == 0:
            continue
        outputs = all_token_ids[state, int(prompt_len[state]) : int(total_len[state])].tolist()
        past = outputs + path_tokens[row, : int(path_len[row])].tolist()
        offsets = word_offsets[state].tolist()
        for word in range(count):
            tokens = word_tokens[state, offsets[word] : offsets[word + 1]].tolist()
            prefix = tokens[:-1]
            if len(prefix) <= len(past) and past[len(past) - len(prefix) :] == prefix:
                logits[row, tokens[-1]] = float("-inf")


if HAS_TRITON:

    @triton.jit
    def _tree_bad_words_kernel(
        logits_ptr,
        logits_stride,
        row_state_ptr,
        path_ptr,
        path_stride,
        path_len_ptr,
        word_tokens_ptr,
        word_tokens_stride,
        word_offsets_ptr,
        word_offsets_stride,
        num_words_ptr,
        all_token_ids_ptr,
        all_token_ids_stride,
        prompt_len_ptr,
        total_len_ptr,
    ):
        row = tl.program_id(0).to(tl.int64)
        word = tl.program_id(1)
        state = tl.load(row_state_ptr + row).to(tl.int64)
        if word >= tl.load(num_words_ptr + state):
            return
        prompt_len = tl.load(prompt_len_ptr + state)
        num_outputs = tl.load(total_len_ptr + state) - prompt_len
        past_len = num_outputs + tl.load(path_len_ptr + row)
        first = tl.load(word_offsets_ptr + state * word_offsets_stride + word)
        end = tl.load(word_offsets_ptr + state * word_offsets_stride + word + 1)
        prefix_len = end - first - 1
        if prefix_len > past_len:
            return
        words = word_tokens_ptr + state * word_tokens_stride
        outputs = all_token_ids_ptr + state * all_token_ids_stride + prompt_len
        matched = prefix_len >= 0  # a scalar of Triton's bool type, true here
        for i in range(prefix_len):
            at = past_len - prefix_len + i  # index into outputs, then the path
            on_path = at >= num_outputs
            from_path = tl.load(path_ptr + row * path_stride + (at - num_outputs), mask=on_path)
            from_outputs = tl.load(outputs + at, mask=at < num_outputs)
            past = tl.where(on_path, from_path, from_outputs.to(tl.int64))
            matched = matched & (past == tl.load(words + first + i).to(tl.int64))
        if matched:
            banned = tl.load(words + end - 1)
            tl.store(logits_ptr + row * logits_stride + banned, float("-inf"))


def apply_tree_bad_words_triton(
    logits: torch.Tensor,
    row_state: torch.Tensor,
    path_tokens: torch.Tensor,
    path_len: torch.Tensor,
    word_tokens: torch.Tensor,
    word_offsets: torch.Tensor,
    num_words: torch.Tensor,
    all_token_ids: torch.Tensor,
    prompt_len: torch.Tensor,
    total_len: torch.Tensor,
    max_num_words: int,
) -> None:
    """Launcher: one program per row and word (``max_num_words``: the most any row's request
    has)."""
    num_rows = logits.shape[0]
    if num_rows == 0 or max_num_words == 0:
        return
    path_tokens = path_tokens.contiguous()
    _tree_bad_words_kernel[(num_rows, max_num_words)](
        logits,
        logits.stride(0),
        row_state,
        path_tokens,
        path_tokens.stride(0),
        path_len,
        word_tokens,
        word_tokens.stride(0),
        word_offsets,
        word_offsets.stride(0),
        num_words,
        all_token_ids,
        all_token_ids.stride(0),
        prompt_len,
        total_len,
    )


def apply_tree_bad_words(logits: torch.Tensor, *args) -> None:
    """``apply_tree_bad_words_triton`` on CUDA, ``apply_tree_bad_words_ref`` elsewhere (same
    arguments)."""
    if use_triton(logits.device):
        apply_tree_bad_words_triton(logits, *args)
    else:
        apply_tree_bad_words_ref(logits, *args)
