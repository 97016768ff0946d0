"""Build a scale model on this machine: ``python -m benchmarks scale-model --model qwen3-8b``.

Random weights at a served model's shapes (``vllm_ddtree/testing/scale_models.py``), saved as
HF checkpoints under ``--root`` (``<model>/target``, ``<model>/drafter``; kept when already
there), built on ``--device`` (``cuda`` on the GPU host: seconds, then a disk write). Prints
the two paths and the target's parameter count as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from vllm_ddtree.testing.scale_models import SCALE_MODELS, build, parameter_count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SCALE_MODELS), default="qwen3-8b")
    parser.add_argument("--root", default="/tmp/scale-models")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shrink", type=int, default=1, help="divide the shapes (CPU checks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--predictable",
        action="store_true",
        help="the successor-head build (scale_models.ScaleModel.predictable)",
    )
    args = parser.parse_args()
    model = SCALE_MODELS[args.model].shrunk(args.shrink)
    if args.predictable:
        model = model.predictable()
    start = time.time()
    target, drafter = build(model, args.root, args.device, args.seed)
    print(
        json.dumps(
            {
                "model": model.name,
                "target": target,
                "drafter": drafter,
                "parameters": parameter_count(model),
                "seconds": round(time.time() - start, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
