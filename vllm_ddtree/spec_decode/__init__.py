"""DDTree inside vLLM's model runners (laid out like vLLM's ``v1/worker/gpu/spec_decode/``).

* ``proposer.py``: ``DDTreeProposer``, the V1 runner's drafter (vLLM's DFlash proposer, then
  one tree per request); ``speculator.py``: ``DDTreeSpeculator``, the same for the V2 runner.
* ``tree_step.py``: the verify step both runners share (``start_tree_step`` before the
  forward, ``walk_tree_step`` after it, ``commit_step_kv``).
* ``tree_sampling.py``: the V1 runner's sampling on a tree's rows (keyed draws, ``min_tokens``,
  thinking budgets); ``draft_source.py``: the draft logits the proposer and speculator are
  given (the drafter's own, or the test kit's oracle).
* ``v1_hooks.py``: the V1 runner's step as plain functions its methods call (the plugin's
  wrappers: ``compat/v1_runner.py``); ``v2_hooks.py``: the V2 runner's (``compat/v2_runner.py``).
* ``step_state.py``: ``StepState``, everything a step hands from one stage to the next, and
  the readers the engine core runs in a worker; ``engine_step.py``: the engine core's step
  loops, where an online ``"auto"`` (``budget/``) refreshes its budgets.
* ``proposal_store.py``: each request's last tree, good for its next scheduled step only.
* ``request_seeds.py``: per-request sampling seeds (V1); ``step_checks.py``: invariant
  checks behind ``VLLM_DDTREE_CHECK_STEPS=1``.
* ``tree_logits_processors.py``, ``tree_thinking_budget.py``, ``tree_logprobs.py``: vLLM's
  request options on a tree's rows, each row continuing its own node's path (V1).
"""
