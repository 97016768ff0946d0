"""The plugin in vLLM's own tree: a ``git format-patch`` series against vLLM's sources.

Owns the in-tree layout of the plugin's modules (``layout``: where each module lands in vLLM
and the rewrite of its imports), the few hand-written edits of vLLM's own files that cannot be
generated (``edits``), the series of reviewable patches (``series``), and the export and check
against a vLLM source tree (``export``, ``sdist``; ``python -m vllm_ddtree.upstream``). The
generated files are the plugin's sources with their module names rewritten, so the series
never drifts from the plugin. It may import nothing of the rest of the project: it reads the
project's files as text.
"""
