"""The plugin's wrappers of vLLM's speculative-decoding statistics (the seam group ``ENGINE``):
in a DDTree engine each counts by tree depth through ``metrics/spec_counters.py``, as vLLM's
tree does from the same places, and also feeds what only the plugin keeps there for now: each
request's own tree statistics (``requests/scheduler_hooks.py``) and what ``"auto"`` predicted
(``budget/metrics.py``)."""

from __future__ import annotations

from vllm_ddtree.budget import metrics as budget_metrics
from vllm_ddtree.compat import bind_arguments
from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.metrics.spec_counters import (
    accepted_positions,
    observe_tree_step,
    tree_logging_class,
)
from vllm_ddtree.requests.scheduler_hooks import observe_request, stats_book


def _wrap_make_spec_decoding_stats(original):
    """``Scheduler.make_spec_decoding_stats`` (engine core): a DDTree engine's statistics have
    one position per tree depth."""

    def make_spec_decoding_stats(self, *args, **kwargs):
        ddtree = get_ddtree_config(self.vllm_config.speculative_config)
        book = stats_book(self)  # the requests' own statistics (requests/options.py)
        if ddtree is None and book is None:
            return original(self, *args, **kwargs)
        bound = bind_arguments(original, self, *args, **kwargs).arguments
        num_draft_tokens = observe_request(  # the valid ones
            self,
            bound["num_draft_tokens"],
            bound["num_accepted_tokens"],
            bound.get("num_invalid_spec_tokens"),
            bound["request_id"],
        )
        if ddtree is None:  # "auto" chose the chain: vLLM's counters
            return original(self, *args, **kwargs)
        if not self.log_stats:
            return None
        if num_draft_tokens:
            budget_metrics.observe(self, num_draft_tokens)  # what "auto" predicted for it
        return observe_tree_step(
            bound["spec_decoding_stats"], ddtree, num_draft_tokens, bound["num_accepted_tokens"]
        )

    return make_spec_decoding_stats


class _DepthView:
    """``speculative_config`` with ``num_speculative_tokens`` read as the tree's depth."""

    def __init__(self, config, depth: int):
        self._config, self.num_speculative_tokens = config, depth

    def __getattr__(self, name):
        return getattr(self._config, name)


def _wrap_spec_decoding_prom_init(original):
    """``SpecDecodingProm.__init__`` (front end): one per-position counter per tree depth."""

    def __init__(self, *args, **kwargs):
        bound = bind_arguments(original, self, *args, **kwargs)
        config = bound.arguments.get("speculative_config")
        ddtree = get_ddtree_config(config) if config is not None else None
        if ddtree is not None:
            bound.arguments["speculative_config"] = _DepthView(config, accepted_positions(config))
        return original(*bound.args, **bound.kwargs)

    return __init__


def _wrap_logging_stat_logger_init(original):
    """``LoggingStatLogger.__init__`` (front end): a DDTree engine's spec-decode log line
    says the mean tree nodes verified (``TreeSpecDecodingLogging``)."""

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        config = getattr(self.vllm_config, "speculative_config", None)
        if get_ddtree_config(config) is not None and not self.spec_decoding_logging.is_diffusion:
            self.spec_decoding_logging = tree_logging_class()()

    return __init__
