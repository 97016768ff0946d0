"""vLLM 0.26.0's source distribution from the package index, checked and extracted.

The series is made and checked against the released sources, not the installed package
(which lacks vLLM's tests and build files). ``fetch_sdist`` finds the sdist through the
index's JSON simple API, checks its sha256 against ``SDIST_SHA256`` and extracts it once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
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


def sha256_of(path: str) -> str:
    """The file's sha256, hex (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_sdist(dest: str) -> str:
    """vLLM 0.26.0's source tree under ``dest`` (downloaded and extracted once); its path.

    Processes that fetch at once (two test workers, say) never see a partial tree: each
    downloads to its own file and extracts beside ``dest``'s tree, which appears whole, by a
    rename, or not at all."""
    tree = os.path.join(dest, f"vllm-{VLLM_VERSION}")
    if os.path.isfile(os.path.join(tree, "pyproject.toml")):
        return tree
    os.makedirs(dest, exist_ok=True)
    archive = os.path.join(dest, SDIST_NAME)
    if not os.path.isfile(archive):
        handle, partial = tempfile.mkstemp(dir=dest, prefix=f".{SDIST_NAME}.", suffix=".part")
        os.close(handle)
        try:
            urllib.request.urlretrieve(sdist_url(), partial)
            os.replace(partial, archive)
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    digest = sha256_of(archive)
    if digest != SDIST_SHA256:
        os.remove(archive)
        raise ValueError(f"{SDIST_NAME}: sha256 {digest}, expected {SDIST_SHA256}")
    scratch = tempfile.mkdtemp(dir=dest, prefix=".extract-")
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(scratch, filter="data")
        try:
            os.rename(os.path.join(scratch, f"vllm-{VLLM_VERSION}"), tree)
        except OSError:
            if not os.path.isfile(os.path.join(tree, "pyproject.toml")):
                raise  # not another process's whole tree in the way
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return tree
