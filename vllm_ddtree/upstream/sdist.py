"""vLLM 0.26.0's source distribution from the package index, checked and extracted.

The series is made and checked against the released sources, not the installed package
(which lacks vLLM's tests and build files). ``fetch_sdist`` finds the sdist through the
index's JSON simple API, checks its sha256 against ``SDIST_SHA256`` and extracts it once.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import urllib.request

VLLM_VERSION = "0.26.0"
SDIST_NAME = f"vllm-{VLLM_VERSION}.tar.gz"
SDIST_SHA256 = "23e9fa19d7e20ce7dcc1c074d41503e2116d23f19e688f5d5ea91b741f958502"
INDEX_URL = "https://pypi.org/simple/vllm/"


def sdist_url(index_url: str = INDEX_URL) -> str:
    """The sdist's download address, from the index's JSON simple API."""
    request = urllib.request.Request(
        index_url, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    for entry in files:
        if entry["filename"] == SDIST_NAME:
            return entry["url"]
    raise FileNotFoundError(f"{index_url} lists no {SDIST_NAME}")


def fetch_sdist(dest: str) -> str:
    """vLLM 0.26.0's source tree under ``dest`` (downloaded and extracted once); its path."""
    tree = os.path.join(dest, f"vllm-{VLLM_VERSION}")
    if os.path.isfile(os.path.join(tree, "pyproject.toml")):
        return tree
    os.makedirs(dest, exist_ok=True)
    archive = os.path.join(dest, SDIST_NAME)
    if not os.path.isfile(archive):
        partial = archive + ".part"
        urllib.request.urlretrieve(sdist_url(), partial)
        os.replace(partial, archive)
    digest = hashlib.sha256()
    with open(archive, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != SDIST_SHA256:
        os.remove(archive)
        raise ValueError(f"{SDIST_NAME}: sha256 {digest.hexdigest()}, expected {SDIST_SHA256}")
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return tree
