"""Cost profiles for tests of "tree_budget": "auto"."""

import json

from vllm_ddtree.budget.cost_model import CostProfile, StepCost


def cheap_tree_profile() -> CostProfile:
    """Trees cheap beside the chain: "auto" chooses trees (budget 16 at 4 requests)."""
    return CostProfile(
        source="test: trees cheap",
        depth=15,
        chain=StepCost(3.0, 0.01),
        tree=StepCost(2.0, 0.01),
        chain_acceptance=1.8,
        tree_acceptance={4: 2.0, 32: 4.0},
        max_batch=4,
    )


def write_cheap_tree_profile(tmp_path) -> str:
    """``cheap_tree_profile`` as a JSON file in ``tmp_path``; its path."""
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(cheap_tree_profile().to_dict()))
    return str(path)
