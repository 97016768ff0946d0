"""The documentation stays a quick read and its links resolve: README.md at most 12 KB and
CONTRIBUTING.md at most 20 KB (the details live in docs/), and every relative link of the
README, CONTRIBUTING and docs/ names a file of the repository."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "CONTRIBUTING.md"] + [
    os.path.join("docs", name) for name in sorted(os.listdir(os.path.join(ROOT, "docs")))
]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("name, limit", [("README.md", 12 * 1024), ("CONTRIBUTING.md", 20 * 1024)])
def test_the_front_documents_stay_short(name, limit):
    assert os.path.getsize(os.path.join(ROOT, name)) <= limit


@pytest.mark.parametrize("name", DOCS)
def test_every_relative_link_resolves(name):
    folder = os.path.dirname(os.path.join(ROOT, name))
    broken = []
    for target in LINK.findall(open(os.path.join(ROOT, name)).read()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or an anchor in the same page
        path = os.path.normpath(os.path.join(folder, target.split("#", 1)[0]))
        if not os.path.exists(path):
            broken.append(target)
    assert broken == []
