"""Print, as one JSON line, the attention backend vLLM resolves for each engine of a list.

    python report_attention_backends.py ENGINES_JSON

ENGINES_JSON maps a name to ``EngineArgs`` keyword arguments. vLLM's general plugins load as
an engine's processes load them (``VLLM_PLUGINS`` decides which); each engine's config is
made (no weights are loaded) and the target's attention layers' backend is resolved under
it, as a worker resolves it. Prints ``RESULT {name: class path or "error: ..."}``.
"""

import json
import sys


def resolve(engine_kwargs: dict) -> str:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.selector import _cached_get_attn_backend, get_attn_backend

    try:
        config = EngineArgs(**engine_kwargs).create_engine_config()
        hf_config = config.model_config.hf_config
        head_size = hf_config.hidden_size // hf_config.num_attention_heads
        with set_current_vllm_config(config):
            backend = get_attn_backend(head_size, torch.float32, "auto")
        _cached_get_attn_backend.cache_clear()
        return f"{backend.__module__}.{backend.__qualname__}"
    except Exception as error:  # noqa: BLE001 - the engine's refusal is the answer
        return f"error: {type(error).__name__}: {error}"


def main() -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    engines = json.loads(sys.argv[1])
    print("RESULT " + json.dumps({name: resolve(kwargs) for name, kwargs in engines.items()}))


if __name__ == "__main__":
    main()
