"""LumenBridge: a visual tokenizer for multimodal LLMs.

Images [B, 3, H, W] become token sequences [B, (H/16)(W/16), D] through
strided depthwise-separable convolutions, on a pure-PyTorch reference or on
LumenBridge's own kernels behind a C++ operator gateway."""

import importlib
import sys

__version__ = "0.1.0"

# The public names and the submodule each comes from, imported on first use:
# `import lumenbridge` alone, and the command line's start-up, then do not
# wait for torch (seconds) before they need it.
_SOURCES = {
    "BACKEND_ENV": "dispatch",
    "PRESETS": "config",
    "TokenizerConfig": "config",
    "VisualTokenizer": "model",
    "backends": "dispatch",
    "extension": None,  # a submodule itself
    "ops": None,
    "read_tokens": "shards",
    "select_backend": "dispatch",
}

__all__ = [
    "BACKEND_ENV",
    "PRESETS",
    "TokenizerConfig",
    "VisualTokenizer",
    "__version__",
    "backends",
    "extension",
    "ops",
    "read_tokens",
    "select_backend",
]


def __getattr__(name: str):
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f".{_SOURCES[name] or name}", __name__)
    value = module if _SOURCES[name] is None else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})


# With torch already imported (its cost paid), load a built extension now, so
# torch.ops.lumenbridge.* and their fakes and autograd kernels are complete
# right after `import lumenbridge`; a missing build waits for first use or
# `lumenbridge build`. Without torch, the import stays torch-free (fast CLI).
if "torch" in sys.modules:
    from . import extension

    extension.load(build_missing=False)
