"""``"tree_budget": "auto"``: how many tree nodes a DDTree engine verifies per request and step.

Two entry points: ``choice.choose(BudgetQuestion)`` at config time (the installer asks it what an
engine serves: the chain, or a budget with the budgets it may move between), and, per engine,
``online.OnlineBudget``, which the engine core feeds with what each step verified. Behind them:
the step-cost model and the packaged cost profiles (``cost_model``, ``cost_profiles/``), the
acceptance an engine learns online (``acceptance``), its step costs measured at start
(``step_costs``) and what "auto" predicted, for the log line and ``/metrics`` (``metrics``). It
may import ``config``, ``compat`` and ``envs``, never ``spec_decode``: the step hands it what it
needs (``online.WorkerReaders``, ``spec_decode/engine_step.py``).
"""
