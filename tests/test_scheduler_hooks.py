"""The scheduler's side of a request's own DDTree options
(``requests/scheduler_hooks.py``): its tree statistics, logged and returned."""

import logging
from types import SimpleNamespace

from vllm_ddtree.requests.scheduler_hooks import (
    finish_request_stats,
    install_stats_book,
    stats_book,
)


def params(**extra):
    return SimpleNamespace(extra_args=extra or None)


def test_an_engine_serving_the_chain_says_what_it_served(caplog):
    """ "auto" chose vLLM's DFlash chain: a request's statistics count the chain's verify
    steps, returned and logged saying the chain was served."""
    scheduler = SimpleNamespace()
    install_stats_book(scheduler, serves_chain=True)
    stats_book(scheduler).observe("r", 15, 6)
    request = SimpleNamespace(request_id="r", sampling_params=params(ddtree_stats=True))
    with caplog.at_level(logging.INFO, logger="vllm.ddtree"):
        kv_params = finish_request_stats(scheduler, request, {"connector": 1})
    returned = kv_params["ddtree_stats"]
    assert kv_params["connector"] == 1 and returned["served"] == "dflash_chain"
    assert (returned["verify_steps"], returned["accepted_tokens"]) == (1, 6)
    assert "vLLM's DFlash chain" in caplog.text
