"""vLLM's speculative-decoding counters, by tree depth instead of by draft token.

vLLM counts accepted tokens per draft position, one position per speculative token: for a
DDTree engine that is the tree budget (64 positions for budget 64), though an accepted path is
at most as deep as a tree can be, ``min(tree_budget, depth)``, so every later position always
reads 0. Here a DDTree engine's per-position counters have one position per depth a tree can
reach (``tree_positions``): the scheduler's statistics (engine core), the Prometheus counter
``vllm:spec_decode_num_accepted_tokens_per_pos`` and the periodic ``SpecDecoding metrics`` log
line (front end). Position ``i`` counts the steps whose accepted path reached depth ``i + 1``;
the totals (drafts, draft tokens = tree nodes, accepted tokens) are vLLM's own. Each request's
own verified trees are counted too (``requests.options.RequestStatsBook``). The periodic log
line also says how many tree nodes a verify step checked per request on average
(``TreeSpecDecodingLogging``): the budget the engine served, after per-batch-size schedules
("auto" on V2) and requests' own budgets cut the trees.
"""

from __future__ import annotations

import functools

from vllm_ddtree.budget import metrics as budget_metrics
from vllm_ddtree.compat import bind_arguments
from vllm_ddtree.config import get_ddtree_config
from vllm_ddtree.requests.scheduler_hooks import stats_book


def tree_positions(ddtree) -> int:
    """The depths a tree of this engine can reach: ``min(tree_budget, depth)``."""
    return min(ddtree.tree_budget, ddtree.depth)


def tree_stats(spec_decoding_stats, depth: int):
    """A fresh ``SpecDecodingStats`` with ``depth`` positions (or ``spec_decoding_stats``)."""
    if spec_decoding_stats is not None:
        return spec_decoding_stats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    return SpecDecodingStats.new(depth)


def observe_tree(stats, num_draft_tokens: int, num_accepted_tokens: int, depth: int) -> None:
    """One verified tree of ``num_draft_tokens`` nodes whose accepted path is
    ``num_accepted_tokens`` long; the tree reaches at most ``min(nodes, depth)`` depths."""
    stats.num_drafts += 1
    stats.num_draft_tokens += num_draft_tokens
    stats.num_accepted_tokens += num_accepted_tokens
    for i in range(min(num_accepted_tokens, depth)):
        stats.num_accepted_tokens_per_pos[i] += 1
    for i in range(min(num_draft_tokens, depth)):
        stats.num_draft_tokens_per_pos[i] += 1


def _wrap_make_spec_decoding_stats(original):
    """``Scheduler.make_spec_decoding_stats`` (engine core): a DDTree engine's statistics have
    one position per tree depth."""

    def make_spec_decoding_stats(self, *args, **kwargs):
        ddtree = get_ddtree_config(self.vllm_config.speculative_config)
        book = stats_book(self)  # the requests' own statistics (requests/options.py)
        if ddtree is None and book is None:
            return original(self, *args, **kwargs)
        bound = bind_arguments(original, self, *args, **kwargs).arguments
        num_draft_tokens = bound["num_draft_tokens"]
        invalid = bound.get("num_invalid_spec_tokens")
        if invalid:
            num_draft_tokens -= invalid.get(bound["request_id"], 0)
        if book is not None:
            book.observe(bound["request_id"], num_draft_tokens, bound["num_accepted_tokens"])
        if ddtree is None:  # "auto" chose the chain: vLLM's counters
            return original(self, *args, **kwargs)
        if not self.log_stats:
            return None
        if not num_draft_tokens:  # every draft invalid: the other requests' counts stay
            return bound["spec_decoding_stats"]
        budget_metrics.observe(self, num_draft_tokens)  # what "auto" predicted for it
        positions = tree_positions(ddtree)
        stats = tree_stats(bound["spec_decoding_stats"], positions)
        observe_tree(stats, num_draft_tokens, bound["num_accepted_tokens"], positions)
        return stats

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
            bound.arguments["speculative_config"] = _DepthView(config, tree_positions(ddtree))
        return original(*bound.args, **bound.kwargs)

    return __init__


@functools.cache
def _tree_logging_class():
    """``TreeSpecDecodingLogging``, built once on vLLM's ``SpecDecodingLogging`` when first
    needed (this module loads at plugin registration; vLLM's metrics module only with an
    engine)."""
    from vllm.v1.spec_decode.metrics import SpecDecodingLogging

    class TreeSpecDecodingLogging(SpecDecodingLogging):
        """vLLM's periodic ``SpecDecoding metrics`` line, ending with the mean tree nodes
        verified per request and step (draft tokens over drafts) in the interval and, where
        "auto" moved its budget, the tokens per verify step it predicted (beside vLLM's mean
        acceptance length, the realised ones; ``budget/metrics.py``)."""

        predicted_tokens = 0.0
        predicted_steps = 0

        def observe_predicted(self, tokens: float, steps: int) -> None:
            self.predicted_tokens += tokens
            self.predicted_steps += steps

        def log(self, log_fn=None):
            from vllm.v1.spec_decode.metrics import logger as vllm_logger

            log_fn = log_fn or vllm_logger.info
            drafts, nodes = sum(self.num_drafts), sum(self.num_draft_tokens)
            predicted, predicted_steps = self.predicted_tokens, self.predicted_steps
            self.predicted_tokens, self.predicted_steps = 0.0, 0

            def with_nodes(message, *args):
                if drafts and message.startswith("SpecDecoding metrics"):
                    message += ", Mean tree nodes verified: %.1f"
                    args = (*args, nodes / drafts)
                    if predicted_steps:
                        message += ", Predicted acceptance length ('auto'): %.2f"
                        args = (*args, predicted / predicted_steps)
                log_fn(message, *args)

            return super().log(log_fn=with_nodes)

    return TreeSpecDecodingLogging


def _wrap_logging_stat_logger_init(original):
    """``LoggingStatLogger.__init__`` (front end): a DDTree engine's spec-decode log line
    says the mean tree nodes verified (``TreeSpecDecodingLogging``)."""

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        config = getattr(self.vllm_config, "speculative_config", None)
        if get_ddtree_config(config) is not None and not self.spec_decoding_logging.is_diffusion:
            self.spec_decoding_logging = _tree_logging_class()()

    return __init__
