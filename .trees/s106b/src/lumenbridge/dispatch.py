"""Backend selection: the one place that decides which implementation runs
the convolutions on a device, and why.

Two implementations exist:
  reference  pure PyTorch (reference.py); runs wherever PyTorch runs.
  native     the C++ gateway and LumenBridge kernels (torch.ops.lumenbridge),
             on CPU and, where built, CUDA.
The choice, in order: the `backend=` argument, the LUMENBRIDGE_BACKEND
environment variable, then the default for the device type and input layout
(DEFAULTS). An explicit choice that cannot run is an error; a default that
cannot run (extension not built) falls back to the reference.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from . import extension, native, reference

BACKEND_ENV = "LUMENBRIDGE_BACKEND"

log = logging.getLogger("lumenbridge")

# Default per (device type, channels-last input), from the measurements in
# benchmarks/RESULTS.md: the native kernels where they beat PyTorch, the
# reference elsewhere.
#   CUDA, either layout: native (the fused op reads the 3-channel images in
#     either layout: bf16 B=256 forward 1.21 vs 4.56 ms eager).
#   CPU, NCHW: native (at B=8 forward 59 vs 155 ms and training step 253 vs
#     334 ms, keeping about 3x less memory for the backward).
#   CPU, channels-last: reference (forward 61-201 vs 63-84 ms, training step
#     269-379 vs 200-272 ms).
# Other devices (e.g. Apple MPS) always use the reference.
DEFAULTS = {
    ("cuda", False): "native",
    ("cuda", True): "native",
    ("cpu", False): "native",
    ("cpu", True): "reference",
}

# Device types whose default already fell back to the reference, so the
# reason is logged once rather than on every call.
_fallbacks_logged: set[str] = set()
# Why calls of the native backend ran layer by layer, each logged once.
_layer_reasons_logged: set[str] = set()


class Backend:
    """One implementation of the tokenizer. tokenize(images, model) is the unit
    every backend implements: the whole forward of a VisualTokenizer on
    checked images. The per-convolution methods serve the layer-by-layer
    composition (VisualTokenizer.forward_layers) and the functional ops."""

    name: str

    def tokenize(self, images, model):
        return model.forward_layers(images, self.name)

    def tokenize_path(self, device_type: str, config, dtype: torch.dtype) -> str:
        """How tokenize runs this configuration and dtype on the device, for reports."""
        return "layer by layer in PyTorch"

    def backward_path(self, device_type: str) -> str:
        """How training gradients of the tokenizer are computed on the device, for reports."""
        return "PyTorch autograd, layer by layer"

    def depthwise_conv2d(self, input, weight, bias, stride):
        raise NotImplementedError

    def pointwise_conv2d(self, input, weight, bias):
        return reference.pointwise_conv2d(input, weight, bias)

    def separable_conv(self, input, dw_weight, dw_bias, pw_weight, pw_bias, stride):
        hidden = self.depthwise_conv2d(input, dw_weight, dw_bias, stride)
        return self.pointwise_conv2d(hidden, pw_weight, pw_bias)


class ReferenceBackend(Backend):
    name = "reference"

    def depthwise_conv2d(self, input, weight, bias, stride):
        return reference.depthwise_conv2d(input, weight, bias, stride)


class NativeBackend(Backend):
    """The whole tokenizer as one call of torch.ops.lumenbridge.tokenize (fused
    kernels on CUDA), for inference and training alike: the op has a backward
    (lumenbridge::tokenize_backward) and an autocast rule. Calls the op cannot
    express run layer by layer, depthwise convolutions through the native
    kernels and pointwise ones through PyTorch: see layer_reason."""

    name = "native"

    def tokenize(self, images, model):
        reason = self.layer_reason(images, model)
        if reason is None:
            return native.tokenize(images, model)
        if reason not in _layer_reasons_logged and not torch.compiler.is_compiling():
            _layer_reasons_logged.add(reason)
            log.warning("LumenBridge: this model runs layer by layer, not as one op: %s", reason)
        return super().tokenize(images, model)

    @staticmethod
    def layer_reason(images, model) -> str | None:
        """Why this call cannot use the one op, or None when it can."""
        # Each norm's own mode: model.eval() then norm.train() adapts the statistics at test time.
        if model.config.stage_norm == "batchnorm" and any(stage.norm.training for stage in model.stages):
            return "BatchNorm in training mode needs batch statistics"
        return model.edited_module()

    def tokenize_path(self, device_type: str, config, dtype: torch.dtype) -> str:
        return native.tokenize_path(device_type, config, dtype)

    def backward_path(self, device_type: str) -> str:
        return native.tokenize_backward_path(device_type)

    def depthwise_conv2d(self, input, weight, bias, stride):
        # Under autocast, PyTorch's own convolutions run in the autocast dtype
        # (float64 excepted); do the same so mixed stages agree on one dtype.
        # As autocast itself: only floating-point tensors other than float64 are cast.
        if torch.is_autocast_enabled(input.device.type) and _autocast_casts(input):
            dtype = torch.get_autocast_dtype(input.device.type)
            input, weight, bias = (t.to(dtype) if _autocast_casts(t) else t for t in (input, weight, bias))
        return native.depthwise_conv2d(input, weight, bias, stride)


def _autocast_casts(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.is_floating_point() and tensor.dtype != torch.float64


BACKENDS: dict[str, Backend] = {b.name: b for b in (ReferenceBackend(), NativeBackend())}


def unavailable_reason(name: str, device_type: str) -> str | None:
    """Why backend `name` cannot run on `device_type`, or None if it can."""
    if name == "reference":
        return None
    if device_type not in ("cpu", "cuda"):
        return f"the native kernels exist for cpu and cuda, not {device_type}"
    if not native.ready():
        return f"the native extension is not built: {extension.load_error()}"
    if device_type == "cuda" and not extension.has_cuda_kernels():
        return "the native extension was built without CUDA kernels"
    return None


def check_backend_name(name: str, source: str = "") -> None:
    """Raise ValueError unless `name` is a backend (`source`: where the name came from)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}{source}; choose from {sorted(BACKENDS)}")


def resolve_backend_name(device_type: str, channels_last: bool = False, requested: str | None = None) -> str:
    """The name of the backend for `device_type`: the one decision, made in
    plain Python. torch.compile runs it once while tracing and keeps the
    answer as a constant, so a compiled model keeps the backend it was
    compiled with and the (possibly building) lookup never enters the graph.

    An explicit request (argument or environment) that cannot be honoured is
    an error; the automatic default falls back to the reference."""
    explicit = requested or os.environ.get(BACKEND_ENV) or None
    if explicit is not None:
        # Name where the choice came from: an environment variable is not on the command line.
        source = "" if requested else f" (from {BACKEND_ENV}={explicit})"
        check_backend_name(explicit, source)
        reason = unavailable_reason(explicit, device_type)
        if reason is not None:
            raise RuntimeError(f"backend {explicit!r}{source} cannot run on {device_type}: {reason}")
        return explicit
    default = DEFAULTS.get((device_type, channels_last), "reference")
    reason = unavailable_reason(default, device_type)
    if reason is None:
        return default
    if device_type not in _fallbacks_logged:
        _fallbacks_logged.add(device_type)
        log.warning("LumenBridge: using the PyTorch reference on %s: %s", device_type, reason)
    return "reference"


# What torch.compiler.assume_constant_result(resolve_backend_name) does, without
# the import of torch._dynamo it makes first (over a second on every `import
# lumenbridge`); torch.compile reads this flag when it traces a call.
resolve_backend_name._dynamo_marked_constant = True


def select_backend(device: torch.device | str, requested: str | None = None, *, channels_last: bool = False) -> Backend:
    """The backend that runs convolutions for tensors on `device` (in
    channels-last layout when `channels_last`)."""
    return BACKENDS[resolve_backend_name(torch.device(device).type, channels_last, requested)]


@dataclass(frozen=True)
class BackendReport:
    """What lumenbridge.backends() returns: each implementation's status on
    this machine, and the backend each visible device type would use."""

    implementations: dict[str, str]
    selection: dict[str, str]
    paths: dict[str, str]
    backward_paths: dict[str, str]

    def __str__(self) -> str:
        lines = ["implementations:"]
        lines += [f"  {name:<10} {status}" for name, status in self.implementations.items()]
        if not self.selection:
            lines.append(f"selection: {NOT_BUILT_SELECTION}")
            return "\n".join(lines)
        lines.append("selection (device and input layout -> backend):")
        lines += [f"  {device:<10} {name}" for device, name in self.selection.items()]
        if os.environ.get(BACKEND_ENV):
            lines.append(f"  ({BACKEND_ENV}={os.environ[BACKEND_ENV]} is set)")
        lines.append(
            "tokenizer path (device, preset, dtype -> how the selected backend runs the forward, in inference "
            "and training; BatchNorm stage norms in training mode run layer by layer):"
        )
        lines += [f"  {case:<36} {path}" for case, path in self.paths.items()]
        lines.append("tokenizer backward (device -> how the selected backend computes training gradients):")
        lines += [f"  {device:<10} {path}" for device, path in self.backward_paths.items()]
        return "\n".join(lines)


def visible_device_types() -> list[str]:
    types = ["cpu"]
    if torch.cuda.is_available():
        types.append("cuda")
    if torch.backends.mps.is_available():
        types.append("mps")
    return types


NOT_BUILT = "not built yet: it builds on first use (a minute or two, once), or now with `lumenbridge build`"
NOT_BUILT_SELECTION = "shown once the native extension is built (`lumenbridge build`, then `lumenbridge info`)"


def backends(build_missing: bool = True) -> BackendReport:
    """Report the implementations on this machine and the per-device choice.
    Without `build_missing`, an extension not yet built is reported as such
    rather than compiled (which takes minutes), and the choice left out."""
    devices = visible_device_types()
    if not build_missing and extension.needs_compiling():
        return BackendReport({"reference": "available on " + ", ".join(devices), "native": NOT_BUILT}, {}, {}, {})
    implementations = {}
    for name in BACKENDS:
        runs_on = [d for d in devices if unavailable_reason(name, d) is None]
        if runs_on:
            implementations[name] = "available on " + ", ".join(runs_on)
        else:
            implementations[name] = "unavailable: " + unavailable_reason(name, "cpu")
    selection = {}
    for device in devices:
        for layout, channels_last in (("NCHW", False), ("NHWC", True)):
            try:
                selection[f"{device} {layout}"] = select_backend(device, channels_last=channels_last).name
            except (ValueError, RuntimeError) as error:
                selection[f"{device} {layout}"] = f"error: {error}"
    return BackendReport(implementations, selection, *tokenizer_paths(devices))


def tokenizer_paths(devices: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """For each device, preset and dtype: the backend chosen (NCHW input) and
    how it runs the forward; and for each device, how it runs the backward."""
    from .config import PRESETS

    paths, backward_paths = {}, {}
    for device in devices:
        try:
            backend = select_backend(device)
        except (ValueError, RuntimeError) as error:
            paths[device] = backward_paths[device] = f"error: {error}"
            continue
        backward_paths[device] = f"{backend.name}: {backend.backward_path(device)}"
        for preset, config in PRESETS.items():
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                name = str(dtype).removeprefix("torch.")
                paths[f"{device} {preset} {name}"] = f"{backend.name}: {backend.tokenize_path(device, config, dtype)}"
    return paths, backward_paths
