"""The plugin's wrappers of vLLM 0.26.0's V2 model runner (the seam group ``V2_RUNNER``).

Each wrapper calls vLLM's method and, in a DDTree engine, the plain function of
``spec_decode/v2_hooks.py`` that vLLM's tree calls from the same method (upstream patch 13):
at its start, at its end, or in its place where that function answers (``sample``,
``init_speculator``). What only the plugin does stays here: a hybrid target's GatedDeltaNet
calls routed to the tree path (``gdn_dispatch``), where vLLM's tree changes the layer itself,
and vLLM's DFlash chain drafting from the test oracle's source (``draft_source.py``).
"""

from __future__ import annotations

from vllm_ddtree.spec_decode import v2_hooks
from vllm_ddtree.spec_decode.draft_source import draft_source


def _wrap_init_speculator(original):
    def init_speculator(vllm_config, device):
        speculator = v2_hooks.init_speculator(vllm_config, device)
        if speculator is not None:
            if speculator.state.hybrid is not None:  # the GDN layers' calls to the tree path
                from vllm_ddtree.compat.gdn_dispatch import install

                install(device)
            return speculator
        if getattr(vllm_config.speculative_config, "method", None) == "dflash":
            # The chain, drafting from its source.
            source = draft_source(vllm_config, device)
            return source.v2_chain_speculator(vllm_config, device, original)
        return original(vllm_config, device)

    return init_speculator


def _wrap_capture_model(original):
    def capture_model(self):
        timers = v2_hooks.before_capture_model(self)
        captured = original(self)
        v2_hooks.after_capture_model(self, timers)
        return captured

    return capture_model


def _wrap_profile_run(original):
    def profile_run(self):
        v2_hooks.before_profile_run(self)
        return original(self)

    return profile_run


def _wrap_prepare_attn(original):
    def prepare_attn(self, input_batch):
        block_tables, slot_mappings = original(self, input_batch)
        v2_hooks.after_prepare_attn(self, input_batch, slot_mappings)
        return block_tables, slot_mappings

    return prepare_attn


def _wrap_sample(original):
    def sample(self, hidden_states, input_batch, grammar_output):
        sampled = v2_hooks.sample(self, hidden_states, input_batch, grammar_output)
        if sampled is None:
            return original(self, hidden_states, input_batch, grammar_output)
        return sampled

    return sample


def _wrap_take_draft_token_ids(original):
    def take_draft_token_ids(self):
        return v2_hooks.with_tree_parents_of(self, original(self))

    return take_draft_token_ids
