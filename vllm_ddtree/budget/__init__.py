"""``"tree_budget": "auto"``: how many tree nodes a DDTree engine verifies per request and step.

Owns the step-cost model and the packaged cost profiles (``cost_model``, ``cost_profiles/``),
the budget chosen at config time, the acceptance an engine learns online (``acceptance``), its
step costs measured at start (``step_costs``), the engine core's online controller (``online``)
and what it predicted, for the log line and ``/metrics`` (``metrics``). It may import
``config``, ``compat`` and ``envs``, never ``spec_decode``: the step hands it what it needs
(``online.WorkerReaders``, ``spec_decode/engine_step.py``).
"""
