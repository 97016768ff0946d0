"""Chat mode switches: a client's string "false" means false (thinking stays off)."""

import pytest

pytest.importorskip("vllm")

from transformers import PreTrainedTokenizerFast  # noqa: E402

import vllm_ddtree  # noqa: E402
from vllm_ddtree.vllm_patches import coerce_template_switches  # noqa: E402

vllm_ddtree.register()

TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if enable_thinking %}<think>{% else %}<no-think>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hi": 1}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.chat_template = TEMPLATE
    return tok


def render(tokenizer, **template_kwargs) -> str:
    from vllm.renderers import hf

    resolved = hf.resolve_chat_template_kwargs(
        tokenizer=tokenizer, chat_template=TEMPLATE, chat_template_kwargs=template_kwargs
    )
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], chat_template=TEMPLATE, tokenize=False, **resolved
    )


@pytest.mark.parametrize("value", ["false", "False", " FALSE ", False])
def test_string_false_turns_thinking_off(tokenizer, value):
    assert render(tokenizer, enable_thinking=value).endswith("<no-think>")


@pytest.mark.parametrize("value", ["true", "True", True])
def test_string_true_turns_thinking_on(tokenizer, value):
    assert render(tokenizer, enable_thinking=value).endswith("<think>")


def test_other_strings_are_left_alone():
    assert coerce_template_switches({"mode": "fast", "n": 3, "flag": "no"}) == {
        "mode": "fast",
        "n": 3,
        "flag": "no",
    }
