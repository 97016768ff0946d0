"""Chat-template switches reach the template as the client sent them, as in vLLM without the
plugin: the string "false" is a string (which a Jinja ``if`` reads as true), the JSON boolean
false is false. DDTree's documented way to turn thinking off is the boolean."""

import pytest

pytest.importorskip("vllm")

from transformers import PreTrainedTokenizerFast  # noqa: E402

import vllm_ddtree  # noqa: E402

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


def test_the_boolean_false_turns_thinking_off(tokenizer):
    assert render(tokenizer, enable_thinking=False).endswith("<no-think>")


@pytest.mark.parametrize("value", ["false", "true", True])
def test_other_values_reach_the_template_unchanged(tokenizer, value):
    assert render(tokenizer, enable_thinking=value).endswith("<think>")
