"""TREE_ATTN: tree attention for vLLM over paged KV (per-request draft trees).

vLLM removed its TREE_ATTN backend (PR #42121); this package brings it back as a plugin
backend registered with ``register_backend``. See docs/design.md ("TREE_ATTN").
"""
