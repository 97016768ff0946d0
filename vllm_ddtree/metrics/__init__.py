"""What a DDTree engine reports: vLLM's speculative-decoding counters and the step's ranges.

Owns vLLM's counters and log line by tree depth (``spec_counters``: accepted tokens per depth,
not per draft token, with the requests' own statistics and ``"auto"``'s predictions) and the
``ddtree::*`` ranges of a tree step (``step_ranges``: profiler ranges, host timers for the
benchmarks, or free). It may import ``config``, ``envs``, ``compat``, ``requests`` and
``budget.metrics``; never ``spec_decode`` or ``hybrid``.
"""
