"""vLLM's speculative-decoding counters, by tree depth instead of by draft token.

vLLM counts accepted tokens per draft position, one position per speculative token: for a
DDTree engine that is the tree budget (64 positions for budget 64), though an accepted path is
at most as deep as a tree can be, ``min(tree_budget, depth)``, so every later position always
reads 0. Here a DDTree engine's per-position counters have one position per depth a tree can
reach (``tree_positions``): the scheduler's statistics (engine core), the Prometheus counter
``vllm:spec_decode_num_accepted_tokens_per_pos`` and the periodic ``SpecDecoding metrics`` log
line (front end). Position ``i`` counts the steps whose accepted path reached depth ``i + 1``;
the totals (drafts, draft tokens = tree nodes, accepted tokens) are vLLM's own (the plugin's
wrappers, ``compat/metrics_hooks.py``, count each request's own verified trees there too,
``requests.options.RequestStatsBook``). The periodic log
line also says how many tree nodes a verify step checked per request on average
(``TreeSpecDecodingLogging``): the budget the engine served, after per-batch-size schedules
("auto" on V2) and requests' own budgets cut the trees.
"""

from __future__ import annotations

import functools

from vllm_ddtree.config import get_ddtree_config


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


def observe_tree_step(spec_decoding_stats, ddtree, num_draft_tokens: int, num_accepted_tokens: int):
    """The scheduler's ``make_spec_decoding_stats`` in a DDTree engine that logs statistics:
    one verified tree of ``num_draft_tokens`` valid nodes (vLLM's invalid drafts already
    taken off) counted in ``spec_decoding_stats`` (made with one position per tree depth
    when None); a tree whose drafts were all invalid leaves the other requests' counts."""
    if not num_draft_tokens:
        return spec_decoding_stats
    positions = tree_positions(ddtree)
    stats = tree_stats(spec_decoding_stats, positions)
    observe_tree(stats, num_draft_tokens, num_accepted_tokens, positions)
    return stats


def accepted_positions(speculative_config) -> int:
    """The per-position counters of an engine's acceptance (vLLM's Prometheus counter): one
    per tree depth in a DDTree engine, vLLM's one per speculative token otherwise."""
    ddtree = get_ddtree_config(speculative_config)
    if ddtree is not None:
        return tree_positions(ddtree)
    return speculative_config.num_speculative_tokens


@functools.cache
def tree_logging_class():
    """``TreeSpecDecodingLogging``, built once on vLLM's ``SpecDecodingLogging`` when first
    needed (vLLM's metrics module loads only with an engine): a DDTree engine's
    ``LoggingStatLogger.spec_decoding_logging``."""
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
