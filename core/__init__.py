"""fw: a plugin-first LLM inference framework.

The heavy names (LLM, SamplingParams, ...) load lazily so that `fw --version`
and `fw plugins list` do not pay for importing torch.
"""

import fw.started  # noqa: F401  first: start-up is timed from here (fw.warm.startup)
from fw.version import PLUGIN_API_VERSION, __version__

_LAZY = {
    "LLM": "fw.llm",
    "SamplingParams": "fw.sampling.params",
    "RequestOutput": "fw.engine.outputs",
    "CompletionOutput": "fw.engine.outputs",
    "Logprob": "fw.engine.outputs",
    "EngineConfig": "fw.config",
    "LoRARequest": "fw.lora.request",
    "PoolingParams": "fw.pooling.params",
}

__all__ = ["__version__", "PLUGIN_API_VERSION", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib  # here: `import fw` stays light; the names load on first use

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fw' has no attribute {name!r}")
