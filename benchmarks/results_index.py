"""The index of ``benchmarks/results/``, generated from the runs themselves.

Every run is a folder ``<date>_<commit>_<kind>/`` with a README whose first heading says what it
measured; the JSON files a run wrote record the GPU they ran on. ``python -m benchmarks
results-index`` rewrites ``benchmarks/results/README.md`` from them (``--check`` only compares,
exiting 1 when the committed index is stale).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from benchmarks.common import ROOT

RESULTS = os.path.join(ROOT, "benchmarks", "results")
RUN_NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})_([0-9a-f]{7})_([a-z0-9-]+)$")

HEADER = """# Results

One folder per run, named `<date>_<commit>_<kind>`: the date it was committed, the commit it
measured and what kind of run it is. Each folder's README says what was measured, with the
commands as run; the files beside it are what the run wrote. GPU runs ran on an air-gapped
H200 host (an H100 where the device column says so); `coupled-cpu` runs on the 2-core CPU
machine. Runs that did not complete are not kept (git has them). The history of what the
runs showed is in `CHANGELOG.md`.

This index is generated: `python -m benchmarks results-index` (a test keeps it current).

| run | commit | kind | device | what |
| --- | --- | --- | --- | --- |
"""


def devices_of(folder: str) -> list[str]:
    """The GPUs (``"gpu"`` / ``"device"`` fields) named by the run's JSON files."""
    found: set[str] = set()
    for path, _, files in os.walk(folder):
        for name in files:
            if not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(path, name)) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                continue
            if isinstance(data, dict):
                for key in ("gpu", "device"):
                    if isinstance(data.get(key), str):
                        found.add(data[key])
    return sorted(found)


def title_of(folder: str) -> str:
    with open(os.path.join(folder, "README.md")) as f:
        for line in f:
            if line.startswith("# "):
                return line[2:].strip()
    raise ValueError(f"{folder}/README.md has no heading")


def runs() -> list[str]:
    return sorted(
        name for name in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, name))
    )


def render() -> str:
    lines = []
    for name in runs():
        match = RUN_NAME.match(name)
        if match is None:
            raise ValueError(f"benchmarks/results/{name}: not a <date>_<commit>_<kind> name")
        _, commit, kind = match.groups()
        folder = os.path.join(RESULTS, name)
        devices = ", ".join(devices_of(folder)) or "—"
        what = title_of(folder).replace("|", "\\|")
        lines.append(f"| [{name}]({name}/) | {commit} | {kind} | {devices} | {what} |")
    return HEADER + "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only")
    args = parser.parse_args()
    path = os.path.join(RESULTS, "README.md")
    text = render()
    if args.check:
        with open(path) as f:
            return 0 if f.read() == text else 1
    with open(path, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
