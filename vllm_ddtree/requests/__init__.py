"""What one request may ask of a DDTree engine and what the engine keeps about it.

Owns the per-request options (``options``: ``tree_budget``, ``ddtree_stats`` and the others in
``SamplingParams.extra_args``, validated to a 400 that names the field; each request's tree
statistics in the engine core) and structured outputs on trees (``structured_outputs``: each
tree row's grammar bitmask from its own node's path). It may import ``config``, ``envs`` and
``compat``; never ``spec_decode``, ``hybrid`` or ``budget``.
"""
