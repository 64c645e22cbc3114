"""LumenBridge: a visual tokenizer for multimodal LLMs.

Images [B, 3, H, W] become token sequences [B, (H/16)(W/16), D] through
strided depthwise-separable convolutions, on a pure-PyTorch reference or on
LumenBridge's own kernels behind a C++ operator gateway."""

from . import extension, ops
from .config import PRESETS, TokenizerConfig
from .dispatch import BACKEND_ENV, backends, select_backend
from .model import VisualTokenizer

__version__ = "0.1.0"

__all__ = [
    "BACKEND_ENV",
    "PRESETS",
    "TokenizerConfig",
    "VisualTokenizer",
    "__version__",
    "backends",
    "extension",
    "ops",
    "select_backend",
]
