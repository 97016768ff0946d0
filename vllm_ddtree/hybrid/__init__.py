"""DDTree on hybrid (GatedDeltaNet) targets: every tree node's recurrent state.

Owns the GDN layer's tree verify and commit (``gdn_layer``: the tree path that vLLM's GDN
layers' speculative calls reach, routed there by the plugin in ``compat/gdn_dispatch.py``;
per-node conv and SSM state; the accepted node's state written where vLLM's chain would leave
it), the state layout and its memory check before the engine starts (``gdn_state``), the
GDN attention metadata of a tree step (``gdn_metadata``), one KV-cache group for TREE_ATTN and
the drafter (``kv_cache_specs``) and vLLM-CPU's prefix-caching state copies
(``cpu_mamba_align``). It may import ``config``, ``envs`` and ``ops``; never ``compat``,
``spec_decode``, ``requests`` or ``budget``: the runner hooks call in with the step's tree and
accepted paths, and in vLLM's tree the GDN layer, its metadata builder and the runners call
it directly (upstream patch 14).
"""
