"""The patch series: one reviewable step per patch, in the order a reviewer reads them.

Each ``PatchStep`` lists the project modules it generates (their in-tree paths from
``layout.MODULES``), the project tests it brings (``layout.TESTS``), data files, new package
markers, the hand-written ``edits`` and its commit message: what, why, how tested.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_ddtree.upstream.edits import (
    COST_PROFILES_DATA,
    DDTREE_ENVIRONMENT,
    DDTREE_REQUEST_CHECK,
    DFLASH_CPU_K_NORM,
    GDN_TREE_EDITS,
    INTERPRETER_MARKER,
    METRICS_EDITS,
    ONLINE_BUDGET_EDITS,
    REQUEST_SCHEDULING_EDITS,
    SPEC_CONFIG_EDITS,
    STRUCTURED_OUTPUT_EDITS,
    TREE_ATTN_MEMBER,
    V1_RUNNER_EDITS,
    V2_RUNNER_EDITS,
    Edit,
)


@dataclass(frozen=True)
class PatchStep:
    subject: str
    body: str
    modules: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    # Project data files (paths from the project's root), copied to ``layout.data_target``.
    data: tuple[str, ...] = ()
    # New packages: in-tree path of the ``__init__.py`` -> its docstring.
    packages: dict[str, str] = field(default_factory=dict)
    edits: tuple[Edit, ...] = ()


SERIES: tuple[PatchStep, ...] = (
    PatchStep(
        subject="[Spec Decode] DDTree: best-first draft trees from per-depth distributions",
        body="""\
DDTree (Diffusion Draft Tree, Ringel & Romano 2026) turns a block-diffusion drafter's
per-position distributions (DFlash) into a tree of the `budget` most probable prefixes,
found best-first, which the target verifies in one forward. This adds the tree itself:
construction from each depth's top candidates, ancestor masks, and the walk's helpers as
PyTorch references, plus the module of its environment variables, which vLLM's
`vllm/envs.py` lists so that it does not warn about them.

Nothing calls it yet; the TREE_ATTN backend and the proposer follow in this series.

Tests: tests/v1/spec_decode/ddtree/test_tree.py checks the best-first construction against
brute-force enumeration of every prefix, the masks against the parents, and the candidates'
log-probabilities against a float32 log-softmax (CPU).""",
        modules=("vllm_ddtree.envs", "vllm_ddtree.tree"),
        tests=("tests/test_tree.py",),
        edits=(DDTREE_ENVIRONMENT,),
        packages={
            "vllm/v1/spec_decode/ddtree/__init__.py": "DDTree speculative decoding.",
            "tests/v1/spec_decode/ddtree/__init__.py": "",
        },
    ),
    PatchStep(
        subject="[Attention] TREE_ATTN: tree attention over paged KV as Triton kernels",
        body="""\
A tree verify's query tokens see their request's whole committed context and, inside the
request's own tokens, only their ancestors. TREE_ATTN serves such batches (mixed with
prefills and decodes, which attend causally) from vLLM's paged KV cache: a Triton kernel
with the tree structure bit-packed per query row, split-KV for small batches, sliding
windows by position, and, on CUDA in half precision, the committed context through vLLM's
FlashAttention with its log-sum-exp, merged by the tree kernel over the in-block keys. A
PyTorch reference serves the CPU platform. The builder copies each step's trees into
persistent buffers, so FULL CUDA graphs replay with fresh trees.

vLLM removed its earlier TREE_ATTN backend; DDTree's verify needs one. The backend takes
`AttentionBackendEnum.TREE_ATTN`.

Tests: tests/v1/attention/test_tree_attention.py checks the kernel against the float32
reference over mixed batches (GQA, head sizes 32-128, windows, empty trees, split-KV, a
context merged from elsewhere, tiles of several mask words, capture-shaped batches), natively
on CUDA and under TRITON_INTERPRET=1 on CPU machines; FlashAttention's context path against
the reference and inside a CUDA graph on GPUs.""",
        modules=(
            "tree_attn_backend.ops.tree_attention",
            "tree_attn_backend.ops.context_attention",
            "tree_attn_backend.tree_verify",
            "tree_attn_backend.backend",
            "tree_attn_backend.testing",
            "tests.interpreter",
        ),
        tests=("tests/test_tree_attention_kernel.py",),
        edits=(TREE_ATTN_MEMBER, INTERPRETER_MARKER),
    ),
    PatchStep(
        subject="[Spec Decode] DDTree: the tree step's ops as Triton kernels with references",
        body="""\
What a DDTree step does on the device besides the target's forward, each a Triton kernel
beside its PyTorch reference: each depth's top candidates in one read of the drafter's
logits and the best-first search in one launch (tree_build, top_candidates), the verify's
inputs and ancestor masks (tree_inputs, tree_mask), the walk that accepts the longest path
the target agrees with (tree_walk), the accepted path's K/V moved to contiguous slots in
every layer in one launch (kv_commit), the drafter's context rows (drafter_rows), request
options on tree rows (path_tokens, tree_penalties, tree_bad_words) and keyed Gumbel noise
for sampling (keyed_gumbel). The references serve CPUs and the test of every kernel.

Nothing calls them yet; the proposer and the speculator follow in this series.

Tests: tests/v1/spec_decode/ddtree/test_tree_ops.py, test_kv_commit.py and
test_keyed_gumbel.py check every kernel against its reference (natively on CUDA, under
TRITON_INTERPRET=1 on CPU machines) and the keyed noise's distribution (chi-square).""",
        modules=(
            "vllm_ddtree.ops",
            "vllm_ddtree.ops.packed_rows",
            "vllm_ddtree.ops.top_candidates",
            "vllm_ddtree.ops.tree_build",
            "vllm_ddtree.ops.tree_mask",
            "vllm_ddtree.ops.tree_inputs",
            "vllm_ddtree.ops.tree_walk",
            "vllm_ddtree.ops.kv_commit",
            "vllm_ddtree.ops.drafter_rows",
            "vllm_ddtree.ops.path_tokens",
            "vllm_ddtree.ops.tree_penalties",
            "vllm_ddtree.ops.tree_bad_words",
            "vllm_ddtree.ops.keyed_gumbel",
            "tests.stats",
        ),
        tests=(
            "tests/test_tree_ops.py",
            "tests/test_kv_commit.py",
            "tests/test_keyed_gumbel.py",
        ),
    ),
    PatchStep(
        subject="[Spec Decode] DDTree: GatedDeltaNet over a draft tree, a state per node",
        body="""\
A tree cannot share one recurrent state among its branches: in a GatedDeltaNet layer each
tree node must start from its parent's state, not from the previous token's. This adds the
hybrid target's tree ops, each a Triton kernel beside its PyTorch reference: the gated delta
rule with a parent pointer in place of "the previous token" (tree_gated_delta; node states
in float32 or bfloat16 pools addressed like vLLM's ssm_state_indices, rounded where
token-by-token decoding with that cache dtype rounds them), the depthwise causal conv1d over
each node's ancestor window (tree_causal_conv; the committed window read where vLLM's
speculative layout keeps it), and the commit after the walk (gdn_commit: every GDN layer in
one launch leaves the SSM and conv caches as vLLM's chain step would have after verifying the
accepted path, the `align` layout's boundary state included).

Nothing calls them yet; the GatedDeltaNet layer's tree path follows in this series.

Tests: tests/v1/spec_decode/ddtree/test_tree_gated_delta.py, test_tree_causal_conv.py and
test_gdn_commit.py check each kernel against its reference and the references against
token-by-token recurrence along every root-to-leaf path (a leaf's state is the state
target-alone decoding reaches), natively on CUDA and under TRITON_INTERPRET=1 on CPU
machines.""",
        modules=(
            "vllm_ddtree.ops.tree_gated_delta",
            "vllm_ddtree.ops.tree_causal_conv",
            "vllm_ddtree.ops.gdn_commit",
        ),
        tests=(
            "tests/test_tree_gated_delta.py",
            "tests/test_tree_causal_conv.py",
            "tests/test_gdn_commit.py",
        ),
    ),
    PatchStep(
        subject='[Spec Decode] DDTree: its speculative-config keys and the "auto" budget',
        body="""\
`"method": "ddtree"` takes a DFlash drafter and three keys of its own: `tree_budget` (tree
nodes verified per request and step, 1..1024, or "auto"), `tree_top_k` (candidates per
depth) and `cost_profile` (what "auto" reads). This adds their validation, each error
naming the key and its allowed values, and what the request becomes: vLLM's DFlash request
(the drafter, `num_speculative_tokens` = the tree budget, the verify width) with the tree's
settings beside it (`DDTreeConfig`: budget, top-k, the drafter's depth). "auto" (the
default) chooses from a measured step-cost profile: the DFlash chain where no tree is
predicted at least 10% faster, else the fastest budget at the engine's `max_num_seqs` and,
on the V2 runner, a budget per batch size that fits the FULL CUDA graphs. The packaged
profiles ship as package data.

Nothing calls it yet; the engine's arguments reach it with the proposer, later in this
series.

Tests: tests/v1/spec_decode/ddtree/test_config.py checks the split, every refusal, the depth
from the drafter's block size, "auto" on the packaged profiles (the chain where it is
measured faster; a tree where a profile of another target is read), the runner choice and
the sampling parameters the tree sampler refuses (CPU).""",
        modules=(
            "vllm_ddtree.config",
            "vllm_ddtree.budget",
            "vllm_ddtree.budget.cost_model",
            "vllm_ddtree.budget.choice",
        ),
        tests=("tests/test_config.py",),
        data=(
            "vllm_ddtree/budget/cost_profiles/h200_smollm2.json",
            "vllm_ddtree/budget/cost_profiles/h200_smollm2_v2.json",
        ),
        edits=(COST_PROFILES_DATA,),
    ),
    PatchStep(
        subject="[Spec Decode] DDTree: CUDA-graph sizes for tree verifies",
        body="""\
vLLM sizes an engine's CUDA graphs for `1 + num_speculative_tokens` tokens a request, at
most 512 tokens, and its V2 graph manager captures one FULL graph per size rounded up to a
multiple of the verify width. For DDTree `num_speculative_tokens` is the tree budget, so a
verify batch of 16 trees of budget 32 (528 tokens) has no FULL graph and runs piecewise, and
a verify width below 16 can fall between two of vLLM's default sizes. This adds what a tree
engine's graphs need: the largest graph holding the whole verify batch (up to 2048 tokens)
and the drafter's batch, the sizes to add so that every uniform verify batch of each width
the engine serves has a FULL graph, and, where the user chose the sizes, the budget per
batch size whose verify one of them holds.

Nothing calls it yet; the engine's arguments reach it with the proposer, later in this
series.

Tests: tests/v1/spec_decode/ddtree/test_graph_sizes.py runs vLLM's own size rule, V2 graph
manager and V1 dispatcher on stand-in configs (CPU): with vLLM's defaults 16 trees of budget
32 have no FULL graph; with the added sizes every verify batch of budgets 4-256 at 1-256
requests within the largest graph has one; the schedule fitted to given sizes.""",
        modules=("vllm_ddtree.graph_sizes", "tests.vllm_graphs"),
        tests=("tests/test_graph_sizes.py",),
    ),
    PatchStep(
        subject='[Spec Decode] DDTree: method "ddtree" in the engine arguments',
        body="""\
A user asks for DDTree as for any method, `--speculative-config '{"method": "ddtree",
"model": DFLASH_DRAFTER, "tree_budget": 32}'` (or `--spec-method ddtree`). DDTree drafts
with vLLM's DFlash drafter, so the request becomes vLLM's DFlash one with the verify width
`num_speculative_tokens` = the tree budget, and the tree's settings ride on the
SpeculativeConfig as `ddtree_config` (from patch 5's keys; `tree_budget: "auto"` may choose
the DFlash chain instead, marked `ddtree_served_chain`). EngineArgs checks the target and
the engine before any process starts, selects TREE_ATTN for the target (refusing a backend
that cannot do tree attention; vLLM-CPU answers it when selected), sizes the CUDA graphs for
the verify (patch 6) and, once vLLM has made the capture sizes, completes them for every
verify width. On a GatedDeltaNet target the tree keeps `budget + 1` recurrent states a
request: an engine whose states cannot fit the memory vLLM may use is refused, naming a
`tree_budget` and a `max_num_seqs` that fit (gdn_state). The config also answers for the
tree engine: the drafter's new slots follow its depth, not the budget, the scheduler's KV
lookahead covers every slot the drafter writes after the longest committed path, and the
engine runs the model runner DDTree chose.

An engine that does not ask for DDTree is made exactly as before: every hunk is behind
`method == "ddtree"`, `ddtree_config` or the TREE_ATTN backend.

Tests: tests/v1/spec_decode/ddtree/test_engine_config.py makes engine configs from
EngineArgs with tiny random checkpoints (CPU): vLLM's DFlash config carrying the tree, the
same config from the same arguments twice, TREE_ATTN selected for the target's layers, the
scheduler's lookahead, the `--spec-*` flags, plain DFlash unchanged, and clear errors naming
the field for bad DDTree keys, DDTree keys under another method, a target backend without
tree attention, a drafter that is not DFlash and hybrid tree states that cannot fit;
tests/v1/spec_decode/ddtree/test_gdn_state.py checks the state layouts' sizes on Qwen3-Next
and Qwen3.5 configs and the budget the check names.""",
        modules=(
            "vllm_ddtree.spec_request",
            "vllm_ddtree.hybrid.gdn_state",
            "vllm_ddtree.dflash_drafter",
            "vllm_ddtree.testing",
        ),
        tests=("tests/test_ddtree_engine_config.py", "tests/test_gdn_state.py"),
        edits=SPEC_CONFIG_EDITS,
    ),
    PatchStep(
        subject="[Spec Decode] DDTree: requests checked against the tree engine",
        body="""\
A request may ask DDTree for its own tree budget (`extra_args` / the OpenAI server's
`vllm_xargs` "tree_budget": an int up to the engine's budget, or "auto") and for its tree
statistics ("ddtree_stats"). Where vLLM validates a request against the engine's speculative
config, a DDTree engine now refuses a bad value of either, naming the key and the values
allowed (the OpenAI server's 400), and a request asking for what the tree sampler cannot
apply (on the V2 runner: a thinking token budget); an engine where "auto" chose the chain
checks the options too. The scheduler's use of the options (each request's cut, its
statistics) follows with the proposer.

Tests: tests/v1/spec_decode/ddtree/test_request_options.py checks the options' values as the
OpenAI server passes them, the scheduler's cut and the statistics' counts (CPU);
test_engine_config.py's validation tests run vLLM's SamplingParams.verify against tree, V2
tree and chain engines.""",
        modules=("vllm_ddtree.requests.options",),
        tests=("tests/test_request_options.py",),
        edits=(DDTREE_REQUEST_CHECK,),
    ),
    PatchStep(
        subject="[Spec Decode] DDTree: draft trees verified in the V1 model runner",
        body="""\
A DDTree engine's V1 drafter is `DDTreeProposer`: vLLM's DFlash proposer runs its one
drafter pass at the drafter's depth, and the mask rows' logits become a best-first tree per
request on the device (patch 3's ops); the tree's nodes are the drafts vLLM schedules, its
parents kept for the request's next step. The model runner then verifies each tree in one
forward, through plain functions (v1_runner.py) called where its own methods prepare the
inputs (node positions at root + depth, the ancestor masks published to TREE_ATTN), sample
(the target's token at every node, argmax or keyed Gumbel draws shared with the drafts,
the walk that commits the longest path the target agrees with plus a bonus token, written
in vLLM's rejection-sampler row format, and the accepted nodes' K/V moved to contiguous
slots), and propose (the accepted paths' rows first, so the drafter's context is the
committed tokens in order). Request options apply on each tree row along its own node's
path: penalties, bad words, allowed tokens, min_tokens, thinking budgets, logprobs in every
mode. A step whose batch holds a request without a tree never replays a FULL CUDA graph
sized for verifies. vLLM-CPU zeroes new TREE_ATTN blocks along the backend's block dim.

Every call is a no-op unless the runner's drafter is a DDTreeProposer. Hybrid
(GatedDeltaNet) targets are refused where the runner makes the drafter, until their layers
verify trees; the scheduler's use of
the per-request options, structured outputs, the V2 runner's speculator and "auto"'s
online moves follow in this series. The oracle drafter (`VLLM_DDTREE_TEST_ORACLE`,
synthetic drafts ranking the target's own future tokens) serves the tests.

Tests: tests/v1/spec_decode/ddtree/test_tree_step.py, test_step_upload.py,
test_proposal_store.py, test_request_seeds.py, test_tree_thinking_budget.py,
test_synthetic_acceptance.py and test_oracle.py check the step's parts on CPU: the step's
tables, each request's proposal good for its next step only, seeds, thinking budgets along
tree paths, and the oracle drafter's host and device forms alike. The project's CPU
end-to-end tests run vLLM-CPU patched with this series, the plugin not loaded: greedy and
sampled outputs, logprobs and request options equal the target alone's, trees accepted
deeply, through preemption and aborts.""",
        modules=(
            "vllm_ddtree.handles",
            "vllm_ddtree.budget.acceptance",
            "vllm_ddtree.budget.step_costs",
            "vllm_ddtree.hybrid.gdn_layer",
            "vllm_ddtree.hybrid.cpu_mamba_align",
            "vllm_ddtree.metrics.step_ranges",
            "vllm_ddtree.requests.structured_outputs",
            "vllm_ddtree.spec_decode.step_state",
            "vllm_ddtree.spec_decode.step_checks",
            "vllm_ddtree.spec_decode.draft_source",
            "vllm_ddtree.spec_decode.proposal_store",
            "vllm_ddtree.spec_decode.request_seeds",
            "vllm_ddtree.spec_decode.tree_step",
            "vllm_ddtree.spec_decode.tree_logits_processors",
            "vllm_ddtree.spec_decode.tree_logprobs",
            "vllm_ddtree.spec_decode.tree_thinking_budget",
            "vllm_ddtree.spec_decode.tree_sampling",
            "vllm_ddtree.spec_decode.proposer",
            "vllm_ddtree.spec_decode.v1_hooks",
            "vllm_ddtree.testing.synthetic_acceptance",
            "vllm_ddtree.testing.oracle",
        ),
        tests=(
            "tests/test_tree_step.py",
            "tests/test_step_upload.py",
            "tests/test_proposal_store.py",
            "tests/test_request_seeds.py",
            "tests/test_tree_thinking_budget.py",
            "tests/test_synthetic_acceptance.py",
            "tests/test_oracle.py",
        ),
        edits=V1_RUNNER_EDITS,
    ),
    PatchStep(
        subject="[Spec Decode] DDTree: structured outputs on draft trees",
        body="""\
vLLM fills a structured-output request's `1 + k` grammar rows along its drafts as one chain,
and the scheduler first cuts the drafts at the first token the grammar refuses as a chain.
A DDTree request's drafts are its tree's nodes in best-first order, each with a parent, so
its row `i` must be the grammar after the path from the root to node `i`. The runner hands
the trees' parents to the scheduler beside their tokens (patch 9); here the scheduler keeps
a structured-output request's tree whole, with its parents, where vLLM's chain check would
cut it (synchronous and asynchronous scheduling), and the structured-output manager fills
each request's rows by one walk of its tree: a node's token is accepted on the way down and
rolled back on the way up; a node its parent's row refuses, and its subtree, get
unconstrained rows the walk never reaches. Reasoning parsers keep vLLM's rule per path.

Every hunk is behind a DDTree engine's `ddtree_config`.

Tests: tests/v1/spec_decode/ddtree/test_structured_outputs.py fills the rows of trees
against a grammar and compares each with the grammar after its node's own path (several
requests, a request without parents read as a chain, a reasoning end marker) on CPU; the
project's CPU end-to-end tests of grammars (greedy, and seeded sampling whatever the tree)
run against vLLM-CPU patched with the series, the plugin not loaded.""",
        tests=("tests/test_structured_outputs.py",),
        edits=STRUCTURED_OUTPUT_EDITS,
    ),
    PatchStep(
        subject="[Spec Decode] DDTree: acceptance counters by tree depth",
        body="""\
vLLM counts accepted tokens per draft position, one position per speculative token: for a
DDTree engine that is the tree budget (64 positions at budget 64), though an accepted path
is at most `min(tree_budget, depth)` deep, so every later position always reads 0. A DDTree
engine's statistics, its Prometheus counter `vllm:spec_decode_num_accepted_tokens_per_pos`
and its periodic `SpecDecoding metrics` line get one position per depth a tree can reach:
position `i` counts the verify steps whose accepted path reached depth `i + 1`; drafts,
draft tokens (tree nodes) and accepted tokens stay vLLM's totals. The log line also says the
mean tree nodes verified per request and step: the budget served after batch-size schedules
cut the trees.

Every hunk is behind a DDTree engine's `ddtree_config`.

Tests: tests/v1/spec_decode/ddtree/test_spec_counters.py checks one tree's statistics, a tree
cut by a schedule, trees whose drafts were all invalid, the counters an engine has and the
log line (CPU); the project's CPU end-to-end test of the counters (budgets 4 and 32: one
position per reachable depth, counts falling with depth, their sum the accepted tokens) runs
against vLLM-CPU patched with the series, the plugin not loaded.""",
        modules=("vllm_ddtree.metrics.spec_counters",),
        tests=("tests/test_tree_counters.py",),
        edits=METRICS_EDITS,
    ),
    PatchStep(
        subject="[Spec Decode] DDTree: a request's own tree budget and statistics",
        body="""\
Patch 8 checks a request's own DDTree options; here the scheduler serves them. Before each
step is planned, a running request that asked for a smaller `tree_budget` (an int, or
"auto" for the engine's) has its drafts cut to that many nodes: best-first order makes the
first `k` nodes of a tree the budget-`k` tree, so the cut tree is verified as such. Each
request's verified trees are counted where vLLM counts its drafts (whether or not the
engine logs statistics), and when it finishes its statistics (verify steps, tree nodes, the
most nodes in a step, accepted tokens, acceptance length) are logged, at INFO when it asked
for them with `"ddtree_stats": true`, and returned in its final output's
`kv_transfer_params` (the OpenAI server's response). An engine where `"auto"` chose the
DFlash chain keeps and returns them too, saying so.

Every hunk is behind an engine asked for DDTree (its `ddtree_config`, or
`ddtree_served_chain`); the scheduler's statistics live on one attribute of the scheduler.

Tests: tests/v1/spec_decode/ddtree/test_scheduler_hooks.py checks the statistics returned
and logged by an engine serving the chain (CPU); the project's CPU end-to-end test of
requests' own budgets (1, 3, the engine's 8 and "auto" in one batch: every output the
target alone's, none verifying more nodes in a step than it asked, each asking for its
statistics getting them logged and returned) runs against vLLM-CPU patched with the
series, the plugin not loaded.""",
        modules=("vllm_ddtree.scheduler_state", "vllm_ddtree.requests.scheduler_hooks"),
        tests=("tests/test_scheduler_hooks.py",),
        edits=REQUEST_SCHEDULING_EDITS,
    ),
    PatchStep(
        subject="[Spec Decode] DDTree: draft trees verified in the V2 model runner",
        body="""\
vLLM runs dense GPU targets on its V2 model runner, where the DFlash chain's step costs
about half the V1 one: its drafter runs in a FULL CUDA graph and its step state stays on the
GPU. A DDTree engine's V2 speculator is `DDTreeSpeculator`: vLLM's DFlash speculator at the
drafter's depth, whose `sample_draft` builds a best-first tree per request from the mask
rows' full-vocabulary logits inside the speculator's CUDA graph (patch 3's ops, no host
synchronisation), and whose `propose` first moves the accepted path's rows first with fresh
positions, then returns the node tokens `[R, budget]` the scheduler schedules next. The
runner reaches the step through plain functions (v2_runner.py) called where its methods
prepare attention (node positions at root + depth after the slot mappings are computed from
sequential positions, one KV slot per node; the ancestor masks published to TREE_ATTN before
the metadata builders run), sample (the target's token at every node from vLLM's own
sampler, one keyed draw per row, penalties and bad words along each row's own path; the
walk; vLLM's `SamplerOutput` with `num_sampled = accepted + 1`; the accepted nodes' K/V moved
to contiguous slots) and capture graphs (the drafter's input kernel compiled for every block
size it takes). The runner choice of patch 7 keeps V1 where DDTree chose it; hybrid targets
are refused where the V2 speculator is made, as on V1.

Every call is a no-op unless the runner's speculator is DDTree's. An engine without CUDA
graphs compiles the drafter's input kernel at its first steps rather than at start.

Tests: tests/v1/spec_decode/ddtree/test_v2_runner.py runs one V2 step through these functions
on stand-ins for the runner, sampler and speculator (a prefill and two trees in one batch:
depth positions, masks, sampler rows, num_sampled / num_rejected, the drafter's rows after),
the speculator's draft step with the oracle drafter, an "auto" speculator's search width,
and the trees' parents handed to the scheduler (CPU). On a GPU, the dense oracle grid
(greedy at budgets 1 to 256, eager and CUDA graphs, batch 16 and 1, and the sampling
check) passes on vLLM patched with the series, the plugin not loaded:
benchmarks/upstream_gpu.py.""",
        modules=(
            "vllm_ddtree.spec_decode.tree_rows_v2",
            "vllm_ddtree.spec_decode.drafter_warmup",
            "vllm_ddtree.spec_decode.speculator",
            "vllm_ddtree.spec_decode.v2_hooks",
        ),
        tests=("tests/test_v2_step.py",),
        packages={
            "vllm/v1/worker/gpu/spec_decode/ddtree/__init__.py": "DDTree on the V2 model runner.",
        },
        edits=V2_RUNNER_EDITS,
    ),
    PatchStep(
        subject="[Spec Decode] DDTree: GatedDeltaNet targets verify draft trees",
        body="""\
Qwen3-Next and Qwen3.5/3.6 interleave GatedDeltaNet (recurrent) layers with attention. A
tree verify needs a recurrent state per tree node: node `t` starts from its parent's state,
not from the token before it in the batch. vLLM's GDN layer sends its speculative rows
through two chain-shaped calls, the depthwise conv update and the gated delta rule's
recurrence; in a forward that verifies trees (found through the TREE_ATTN metadata of the
same forward) those two calls now go to patch 4's tree ops, with each step's parent
pointers (`gdn_layer.HybridTreeStep`, which takes vLLM's calls as they are), on vLLM-CPU its
`_spec_forward`. States live in vLLM's speculative layout (`1 + budget` blocks per request),
and after the walk (patch 9) the accepted path's are left where vLLM's chain would have left
them, so vLLM's own state bookkeeping, prefix caching's `align` copies included, serves
trees unchanged.

Also: the GDN metadata builder makes a DDTree tree step with slices where its host boolean
masks would wait for the device (`gdn_metadata.tree_step_build`; every field equal to
vLLM's build), and its state indices reach vLLM-CPU's kernels unit-strided (a step of plain
decodes beside speculation stopped vLLM-CPU's decode kernel, vLLM's DFlash chain too); both
runners' KV-cache specs give every attention layer one block-stride flag in a DDTree engine,
so the drafter's layers share the target's TREE_ATTN group (`kv_cache_specs`; the DFlash
proposer refused split groups at start-up); vLLM-CPU makes the `align` layout's state copies
on the host for DDTree engines (vLLM's fused postprocess is a Triton kernel); the V2 runner
makes the layers' tree buffers before it profiles memory, as V1 does (patch 9). The two
refusals of hybrid targets (patches 9 and 13) go.

Every hunk is behind a forward verifying trees or a DDTree engine, but the unit-strided
state indices on the CPU.

Tests: tests/v1/spec_decode/ddtree/test_gdn_layer.py checks two tree steps of a GDN layer
through the calls vLLM makes, then the commit, against decoding the accepted tokens one by
one (states and outputs), the `align` layout's boundary states, graph-padded batches, the
buffers made before capture and the index checks; test_gdn_metadata.py compares a tree
step's metadata with vLLM's build field for field; test_kv_cache_specs.py the KV-cache
groups vLLM makes of a hybrid engine's specs (CPU). The project's CPU end-to-end tests of
hybrid targets (Qwen3-Next, Qwen3.5 dense and MoE: deep trees give exactly what single-token
steps give, requests near max_model_len, prefix caching's next turns and chunked prefills)
run against vLLM-CPU patched with the series, the plugin not loaded.""",
        modules=(
            "vllm_ddtree.hybrid.gdn_metadata",
            "vllm_ddtree.hybrid.kv_cache_specs",
        ),
        tests=(
            "tests/test_gdn_layer.py",
            "tests/test_gdn_metadata.py",
            "tests/test_kv_cache_specs.py",
        ),
        edits=GDN_TREE_EDITS,
    ),
    PatchStep(
        subject='[Spec Decode] DDTree: "auto" moves its tree budgets online',
        body="""\
Patch 5's `"tree_budget": "auto"` picks a budget per batch size from a cost profile measured
on another pair. Once trees run, every verified tree tells what each smaller budget would
have accepted (patch 9's acceptance tracker, kept by each worker). Here the engine core,
before every step, refreshes the scheduler's per-batch-size budget lookup every 32 steps:
it reads the first worker's acceptance and the step costs timed as graphs were captured
(through `collective_rpc`), predicts the tokens per second of each candidate budget at each
batch size, keeps a batch size's budget while it is predicted within a margin of the fastest,
and now and then serves the next larger budget to learn it. Every move is logged. What it
predicted rides to the front end with the scheduler's stats: the spec-decode log line says
the predicted acceptance length beside vLLM's realised one, and `/metrics` gets
`vllm:ddtree_predicted_tokens`, `vllm:ddtree_predicted_verify_steps` and
`vllm:ddtree_tree_nodes_per_verify`. The predictions travel in `kv_connector_stats` (the one
free-form field vLLM sends from the engine core) and are taken out before any stat logger
runs, so custom loggers and the KV-connector metrics see the connector's stats as sent.

Every call is a no-op outside an engine whose "auto" moves online (a fixed budget, or "auto"
with one candidate).

Tests: tests/v1/spec_decode/ddtree/test_online_budget.py drives the engine core's refreshes
on stand-ins (budgets following the worker's acceptance, exploration, trees cut near
max_model_len, step costs realised) and test_budget_metrics.py the predictions' trip to the
log line and the metrics (CPU); the project's CPU end-to-end tests of "auto" moving online
(budgets moving with the drafts' depth and back, every output the target alone's, the log
line and /metrics) run against vLLM-CPU patched with the series, the plugin not loaded.""",
        modules=(
            "vllm_ddtree.budget.metrics",
            "vllm_ddtree.budget.online",
            "vllm_ddtree.spec_decode.engine_step",
            "tests.profiles",
        ),
        tests=("tests/test_budget_metrics.py", "tests/test_online_budget.py"),
        edits=ONLINE_BUDGET_EDITS,
    ),
    PatchStep(
        subject="[Bugfix][CPU] DFlash: each draft layer's own K-norm on the context keys",
        body="""\
`DFlashQwen3Model._normalize_context_k` normalises the context keys of all draft layers in
one `rms_norm` call, the layers' K-norm weights stacked `[layers, head_dim]`. The CPU build's
`rms_norm` reads the weight as one `[head_dim]` vector, so on vLLM-CPU every layer's context
keys were scaled by layer 0's weight: the drafter computed another function than the network
it was trained as, and proposed other tokens (the DFlash chain and DDTree alike; against a
float32 reference of a trained drafter its log-probabilities were up to 1.5 nats away at the
first round). On the CPU the keys are now normalised in PyTorch with each layer's weight;
other devices keep the fused kernel.

Tests: the project's check runs vLLM's `_normalize_context_k` on the CPU on a stand-in
drafter with a different weight per layer and compares it with each layer's RMSNorm
(tests/helpers/cpu_dflash_k_norm.py; it fails on vLLM 0.26.0 as released).""",
        edits=(DFLASH_CPU_K_NORM,),
    ),
)
