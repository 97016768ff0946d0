"""vLLM patched with the upstream series, the plugin not loaded, on a GPU: the dense oracle grid
on the V2 model runner (docs/upstream.md).

The series is applied to the installed vLLM's files in a site of its own (``upstream.site``):
``--series PATCHES`` (``python -m vllm_ddtree.upstream export``'s output; needs git), or
``--vllm-src`` to export it here first, or ``--files FILES``, the files it changes already
patched (``export --files``, on a machine with git and vLLM's sources); every
engine of ``lossless_gpu.py --runner v2`` then runs with that site first on ``PYTHONPATH``
and ``VLLM_PLUGINS=""``. Passes when the grid passes (greedy output identical to the target
alone's at every budget, mode and batch size, DDTree on V2 and accepting deeply; the sampling
check) and every engine ran vLLM from the patched site with the plugin not installed and, for
DDTree, the in-tree speculator.

    python -m benchmarks upstream-gpu (--series PATCHES | --vllm-src DIR | --files FILES)
        --out benchmarks/results [grid options]

Other options go to ``lossless_gpu.py`` (e.g. ``--modes graphs --budgets 8,64``).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

from benchmarks.common import ROOT, git_commit, module_command

IN_TREE_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.ddtree.speculator"


def engine_checks(grid: dict, site: str) -> list[dict]:
    """Per engine of the grid's summary (the reference and each DDTree row): where vLLM came
    from, whether the plugin was installed, and the DDTree engines' drafter class module."""
    engines = [("reference", grid.get("reference_engine"))]
    seen = set()
    for row in grid.get("runs", []):
        name = f"b{row['budget']}_{row['mode']}"
        if name not in seen:
            seen.add(name)
            engines.append((name, row.get("engine")))
    checks = []
    for name, engine in engines:
        engine = engine or {}
        # The site's files are symlinks to the installed vLLM's: compare the paths unresolved.
        vllm_file = os.path.abspath(engine.get("vllm_file") or "/")
        check = {
            "engine": name,
            **engine,
            "from_patched_site": vllm_file.startswith(os.path.abspath(site) + os.sep),
        }
        if name != "reference":
            check["in_tree_speculator"] = engine.get("drafter_module") == IN_TREE_SPECULATOR
        check["passed"] = (
            check["from_patched_site"]
            and engine.get("plugin_installed") is False
            and check.get("in_tree_speculator", True)
        )
        checks.append(check)
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks upstream-gpu")
    parser.add_argument("--series", help="the patch series' folder (PATCHES of the export)")
    parser.add_argument("--vllm-src", help="or export the series here against this vLLM tree")
    parser.add_argument("--files", help="or the vllm/ files it changes, patched (export --files)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--work", default="/tmp/vllm-ddtree-upstream")
    args, grid_args = parser.parse_known_args()
    from vllm_ddtree.upstream.sdist import sha256_of
    from vllm_ddtree.upstream.site import patched_site, site_with

    os.makedirs(args.work, exist_ok=True)
    site_root = os.path.join(args.work, "patched")
    if os.path.isdir(site_root):
        shutil.rmtree(site_root)
    if args.files:
        applied = {
            "files": {
                os.path.relpath(os.path.join(d, n), args.files): sha256_of(os.path.join(d, n))
                for d, _, names in os.walk(os.path.join(args.files, "vllm"))
                for n in sorted(names)
            }
        }
        site = site_with(args.files, site_root)
    else:
        if args.series:
            patches = sorted(glob.glob(os.path.join(args.series, "*.patch")))
        elif args.vllm_src:
            from vllm_ddtree.upstream.export import export

            patches = export(args.vllm_src, os.path.join(args.work, "series"))
        else:
            parser.error("give --series PATCHES, --vllm-src DIR or --files FILES")
        if not patches:
            parser.error(f"no patches in {args.series}")
        applied = {
            "series": [{"patch": os.path.basename(p), "sha256": sha256_of(p)} for p in patches]
        }
        site = patched_site(patches, site_root)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([site, ROOT, os.environ.get("PYTHONPATH", "")]),
        "VLLM_PLUGINS": "",
        "VLLM_DDTREE_COMMIT": git_commit(),
    }
    os.makedirs(args.out, exist_ok=True)
    command = [
        *module_command("lossless_gpu"),
        "--runner",
        "v2",
        "--tag",
        "upstream",
        "--out",
        args.out,
        "--work",
        os.path.join(args.work, "grid"),
        *grid_args,
    ]
    print("$", " ".join(command), flush=True)
    grid_rc = subprocess.run(command, cwd=ROOT, env=env).returncode
    found = sorted(glob.glob(os.path.join(args.out, "lossless_gpu*_upstream.json")))
    grid = {}
    if found:
        with open(found[-1]) as f:
            grid = json.load(f)
    checks = engine_checks(grid, site)
    summary = {
        "commit": git_commit(),
        **applied,
        "vllm_plugins": "",
        "grid": os.path.basename(found[-1]) if found else None,
        "grid_exit_code": grid_rc,
        "engines": checks,
        "passed": grid_rc == 0 and bool(checks) and all(c["passed"] for c in checks),
    }
    with open(os.path.join(args.out, "upstream_gpu.json"), "w") as f:
        json.dump(summary, f, indent=1)
    for check in checks:
        print(json.dumps(check))
    print(f"upstream series on the GPU: {'passed' if summary['passed'] else 'FAILED'}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
