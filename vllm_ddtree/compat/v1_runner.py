"""The plugin's wrappers of vLLM 0.26.0's V1 model runner (the seam group ``V1_RUNNER``).

Each wrapper calls vLLM's method and, in a DDTree engine, the plain function of
``spec_decode/v1_hooks.py`` that vLLM's tree calls from the same method (upstream patch 9):
at its start, at its end, or in its place where that function answers (``sample``,
``drafter_input_fits``). ``PluginDDTreeProposer`` is the V1 drafter the plugin puts in the
place of vLLM's ``DFlashProposer``: the ``DDTreeProposer`` plus what only the plugin does when
it is made: vLLM's GatedDeltaNet calls routed to the tree path (``gdn_dispatch``) and vLLM-CPU's
DFlash drafter given each layer's own K-norm (``cpu_dflash``), where vLLM's tree changes the
GDN layer and the drafter themselves.
"""

from __future__ import annotations

from vllm_ddtree.compat import bind_arguments
from vllm_ddtree.compat.cpu_dflash import use_per_layer_k_norm
from vllm_ddtree.handles import held
from vllm_ddtree.spec_decode import v1_hooks
from vllm_ddtree.spec_decode.proposer import DDTreeProposer
from vllm_ddtree.spec_decode.step_state import StepState


class PluginDDTreeProposer(DDTreeProposer):
    """``DDTreeProposer`` as the plugin serves it."""

    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config, device, runner)
        if self.state is not None and self.state.hybrid is not None:
            from vllm_ddtree.compat.gdn_dispatch import install

            install(device)

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        if self.ddtree is not None:  # vLLM-CPU's drafter as trained (compat/cpu_dflash.py)
            use_per_layer_k_norm(self.model)


def _wrap_prepare_inputs(original):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = original(self, scheduler_output, num_scheduled_tokens)
        logits_indices, spec_decode_metadata = result
        v1_hooks.after_prepare_inputs(
            self, num_scheduled_tokens, logits_indices, spec_decode_metadata
        )
        return result

    return _prepare_inputs


def _wrap_determine_batch_execution(original):
    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        state = held(self, StepState)
        if state is None or not state.rows_without_drafts:  # every step of other engines
            return original(self, *args, **kwargs)
        bound = bind_arguments(original, self, *args, **kwargs)
        given = bound.arguments.get("force_uniform_decode")
        choice = v1_hooks.uniform_decode_choice(self, given)
        if choice is given:
            return original(self, *args, **kwargs)
        bound.arguments["force_uniform_decode"] = choice
        return original(*bound.args, **bound.kwargs)

    return _determine_batch_execution_and_padding


def _wrap_sample(original):
    def _sample(self, logits, spec_decode_metadata):
        sampled = v1_hooks.sample(self, logits, spec_decode_metadata)
        if sampled is None:
            return original(self, logits, spec_decode_metadata)
        return sampled

    return _sample


def _wrap_propose(original):
    def propose_draft_token_ids(self, *args, **kwargs):
        if v1_hooks.ddtree_proposer(self) is not None:
            bound = bind_arguments(original, self, *args, **kwargs)
            v1_hooks.before_propose(self, bound.arguments.get("aux_hidden_states"))
        return original(self, *args, **kwargs)

    return propose_draft_token_ids


def _wrap_copy_draft_token_ids_to_cpu(original):
    def _copy_draft_token_ids_to_cpu(self, scheduler_output, zeros_only=False):
        original(self, scheduler_output, zeros_only)
        v1_hooks.after_copy_draft_token_ids_to_cpu(self, zeros_only)

    return _copy_draft_token_ids_to_cpu


def _wrap_take_draft_token_ids(original):
    def take_draft_token_ids(self):
        return v1_hooks.with_tree_parents_of(self, original(self))

    return take_draft_token_ids


def _wrap_input_fits_in_drafter(original):
    def _input_fits_in_drafter(self, common_attn_metadata):
        fits = v1_hooks.drafter_input_fits(self, common_attn_metadata)
        return original(self, common_attn_metadata) if fits is None else fits

    return _input_fits_in_drafter


def _wrap_profile_run(original):
    def profile_run(self, *args, **kwargs):
        v1_hooks.before_profile_run(self)
        return original(self, *args, **kwargs)

    return profile_run


def _wrap_capture_model(original):
    def capture_model(self, *args, **kwargs):
        v1_hooks.before_capture_model(self)
        return original(self, *args, **kwargs)

    return capture_model


def _wrap_update_states_after_model_execute(original):
    """A DDTree engine serving a hybrid target with prefix caching on a device without Triton
    (vLLM-CPU): vLLM's step end, with its ``align`` state copies made on the host
    (``v1_hooks.align_states_on_host``; vLLM's own is a Triton kernel). Everywhere else
    vLLM's."""

    def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
        if not v1_hooks.copies_align_states_on_host(self):
            return original(self, output_token_ids, scheduler_output)
        # vLLM's align branch, with its kernel's decisions and copies made on the host.
        num_reqs = output_token_ids.size(0)
        self.num_accepted_tokens.gpu[:num_reqs] = (output_token_ids != -1).sum(dim=1)
        v1_hooks.align_states_on_host(self, num_reqs)
        self.num_accepted_tokens_event.record()

    return _update_states_after_model_execute
