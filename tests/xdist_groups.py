"""How ``pytest -n 2 --dist loadgroup`` (the README's command) deals the suite to its workers.

Tests go to the workers one by one, so that a file's slow tests run side by side; tests that
use a module- or class-scoped fixture (an engine's outputs, a built tree, a fetched source tree)
stay together on one worker, which builds the fixture once. The conftest imports the hook.
"""

from __future__ import annotations

import pytest

# The longest group runs first (vLLM patched with the upstream series and the end-to-end tests
# run against it), so that its worker does not finish last.
LONGEST_GROUP = "tests.test_upstream"


# pytest-xdist's worker reads the groups in its own ``pytest_collection_modifyitems``: the
# markers must be there before it runs.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        fixture_info = getattr(item, "_fixtureinfo", None)
        if fixture_info is None:
            continue
        scopes = {defs[-1].scope for defs in fixture_info.name2fixturedefs.values() if defs}
        if scopes & {"module", "class"}:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items.sort(key=lambda item: getattr(item.module, "__name__", "") != LONGEST_GROUP)
