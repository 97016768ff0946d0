"""``python -m vllm_ddtree.upstream export --vllm-src DIR --out PATCHES [--check] [--files FILES]``:
the plugin as a patch series against the vLLM source tree ``DIR`` (vLLM 0.26.0's sdist,
extracted, or a checkout at v0.26.0); ``--check`` then applies it to a copy of ``DIR``.
``--files FILES`` also writes the ``vllm/`` files the series changes or adds, patched, under
``FILES`` (for a host without git: ``benchmarks/upstream_gpu.py --files``).
``python -m vllm_ddtree.upstream fetch --dest DIR``: vLLM 0.26.0's sdist from the package
index, checked against its sha256, extracted under ``DIR``; prints the tree's path."""

from __future__ import annotations

import argparse
import sys

from vllm_ddtree.upstream.export import check, export
from vllm_ddtree.upstream.sdist import fetch_sdist
from vllm_ddtree.upstream.site import patched_files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_ddtree.upstream")
    commands = parser.add_subparsers(dest="command", required=True)
    exporting = commands.add_parser("export", help="write the patch series")
    exporting.add_argument("--vllm-src", required=True, help="vLLM 0.26.0's source tree")
    exporting.add_argument("--out", required=True, help="folder for the patches (emptied)")
    exporting.add_argument("--check", action="store_true", help="apply it to a copy after")
    exporting.add_argument("--files", help="also write the patched vllm/ files here")
    fetching = commands.add_parser("fetch", help="download and extract vLLM 0.26.0's sdist")
    fetching.add_argument("--dest", required=True)
    args = parser.parse_args(argv)
    if args.command == "fetch":
        print(fetch_sdist(args.dest))
        return 0
    patches = export(args.vllm_src, args.out)
    for patch in patches:
        print(patch)
    if args.check:
        check(args.vllm_src, patches)
        print(f"{len(patches)} patches apply to {args.vllm_src}")
    if args.files:
        written = patched_files(patches, args.vllm_src, args.files)
        print(f"{len(written)} patched files under {args.files}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
