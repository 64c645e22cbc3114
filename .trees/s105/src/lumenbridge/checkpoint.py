"""Checkpoints: config.json plus model.safetensors in one directory. No pickle.

Each file is written to a temporary name, flushed and renamed into place, so a
failure midway never leaves a half-written file. model.safetensors also holds
the config in its metadata, and loading builds the model from that copy;
config.json (read by tools such as transformers' AutoConfig) must agree with
it, so a save killed between the two renames, or an edited config.json, is
refused rather than loaded as a model that other tools would build
differently. config.json is written first: a save killed between the two
leaves the previous weights whole, and deleting config.json loads them. Keys
of config.json that are not TokenizerConfig fields (transformers'
"model_type", say) are left to those tools.

Weights load in the floating-point dtype they were saved in."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
import torch

from .atomic import write_atomically
from .config import TokenizerConfig

if TYPE_CHECKING:
    from .model import VisualTokenizer

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# The metadata key of the config that model.safetensors carries.
CONFIG_METADATA = "lumenbridge_config"
# The model_type of integrations.hf's LumenBridgeVisionModel folders, which hold
# the same two files with Hugging Face's config and key names.
HF_MODEL_TYPE = "lumenbridge"
# A tensor every VisualTokenizer has (a LumenBridgeVisionModel's is tokenizer.stages.0.dw.weight).
FIRST_TENSOR = "stages.0.dw.weight"


def save(model: VisualTokenizer, directory: str | Path) -> None:
    from .model import VisualTokenizer  # model imports this module

    edit = model.edited_module()
    if edit is not None:
        raise ValueError(
            f"cannot save this model: {edit}. A checkpoint records the config, so it would reload as the "
            "config's architecture; build the model from a config that describes it instead"
        )
    state = model.state_dict()
    with torch.device("meta"):
        expected = VisualTokenizer(model.config).state_dict()
    problems = mismatches(expected, state)
    if problems:  # from_pretrained would refuse what it wrote
        hint = ""
        if any(".parametrizations." in name for name in state):
            hint = "; torch.nn.utils.parametrize.remove_parametrizations bakes a parametrized weight in"
        raise ValueError(f"cannot save this model: its tensors do not fit its config: {'; '.join(problems)}{hint}")
    tied = tied_tensors(state)
    if tied:  # the checkpoint would load them untied
        raise ValueError(f"cannot save this model: {'; '.join(tied)}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # safetensors stores dense tensors; channels-last parameters are made contiguous.
    tensors = {name: t.detach().contiguous() for name, t in state.items()}
    metadata = {CONFIG_METADATA: model.config.to_json()}
    write_atomically(directory / CONFIG_NAME, lambda path: Path(path).write_text(model.config.to_json() + "\n"))
    write_atomically(directory / WEIGHTS_NAME, lambda path: safetensors.torch.save_file(tensors, path, metadata))


def tied_tensors(state: dict[str, torch.Tensor]) -> list[str]:
    """The tensors of a state dict that share memory: a checkpoint stores each
    on its own, so the model would load untied."""
    by_storage: dict[int, list[str]] = {}
    for name, tensor in state.items():
        pointer = tensor.untyped_storage().data_ptr()
        if pointer:  # 0: no memory (meta or empty tensors)
            by_storage.setdefault(pointer, []).append(name)
    return [
        f"tensors {', '.join(map(repr, names))} share memory (tied); give each its own copy"
        for names in by_storage.values()
        if len(names) > 1
    ]


def mismatches(expected: dict[str, torch.Tensor], stored: dict[str, torch.Tensor]) -> list[str]:
    """Why tensors `stored` cannot be the state of a model whose state dict is
    `expected`: missing, unexpected or mis-shaped tensors, integers where the
    model holds floats or the other way round, mixed or unsupported float dtypes."""
    from .model import FLOAT_DTYPES  # model imports this module

    problems = [f"missing tensor {name!r}" for name in expected if name not in stored]
    problems += [f"unexpected tensor {name!r}" for name in stored if name not in expected]
    problems += [
        f"tensor {name!r} has shape {list(stored[name].shape)} but the model expects {list(t.shape)}"
        for name, t in expected.items()
        if name in stored and stored[name].shape != t.shape
    ]
    problems += [
        f"tensor {name!r} is stored as {stored[name].dtype} but the model holds {t.dtype}"
        for name, t in expected.items()
        if name in stored and stored[name].is_floating_point() != t.is_floating_point()
    ]
    floating = {t.dtype for name, t in stored.items() if name in expected and t.is_floating_point()}
    if len(floating) > 1:
        problems.append(f"its floating-point tensors mix dtypes {sorted(map(str, floating))}")
    problems += [
        f"its tensors are {dtype}, which the model cannot run in (it runs in {', '.join(map(str, FLOAT_DTYPES))})"
        for dtype in floating
        if dtype not in FLOAT_DTYPES
    ]
    return problems


def _require(path: Path) -> Path:
    if path.parent.is_file():
        raise ValueError(f"{path.parent} is a file: pass the folder that holds {CONFIG_NAME} and {WEIGHTS_NAME}")
    if path.is_dir():
        raise ValueError(f"checkpoint file {path} is a folder")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    return path


def _unreadable(path: Path, error: Exception) -> ValueError:
    return ValueError(f"{path} is not a readable LumenBridge checkpoint file: {type(error).__name__}: {error}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise _unreadable(path, error) from error


def _config_from(path: Path, text: str, *, only_known_keys: bool = False) -> TokenizerConfig:
    """The TokenizerConfig that text (read from path) holds, errors naming path."""
    try:
        data = json.loads(text)
        if only_known_keys and isinstance(data, dict):
            fields = {f.name for f in dataclasses.fields(TokenizerConfig)}
            data = {key: value for key, value in data.items() if key in fields}
        return TokenizerConfig.from_dict(data)
    except (json.JSONDecodeError, TypeError, ValueError) as error:
        raise _unreadable(path, error) from error


def read_config(directory: str | Path) -> TokenizerConfig:
    weights = Path(directory) / WEIGHTS_NAME
    config_path = Path(directory) / CONFIG_NAME
    tokenizer_weights = False  # named as a VisualTokenizer's tensors, not a LumenBridgeVisionModel's (tokenizer.*)
    if weights.is_file():
        try:
            with safetensors.safe_open(weights, "pt") as file:
                stored = (file.metadata() or {}).get(CONFIG_METADATA)
                tokenizer_weights = FIRST_TENSOR in file.keys()  # noqa: SIM118 - safe_open has no __contains__
        except safetensors.SafetensorError as error:
            raise _unreadable(weights, error) from error
        if stored is not None:
            config = _config_from(weights, stored)
            if (
                config_path.is_file()
                and _config_from(config_path, _read_text(config_path), only_known_keys=True) != config
            ):
                raise ValueError(
                    f"{config_path} does not match the config saved with {weights} (a save interrupted between "
                    "the two files, or an edited config.json): save the model again, or delete config.json "
                    "to load the weights with their own config"
                )
            return config
    # Weights saved before they carried the config: config.json alone says what they are.
    path = _require(config_path)
    text = _read_text(path)
    with contextlib.suppress(json.JSONDecodeError, AttributeError):
        if not tokenizer_weights and json.loads(text).get("model_type") == HF_MODEL_TYPE:
            raise ValueError(
                f"{directory} holds a Hugging Face LumenBridgeVisionModel: load it with "
                "LumenBridgeVisionModel.from_pretrained (lumenbridge.integrations.hf), or save its tokenizer "
                "for VisualTokenizer with hf_model.tokenizer.save_pretrained(folder)"
            )
    return _config_from(path, text, only_known_keys=tokenizer_weights)


def load_weights(model: VisualTokenizer, directory: str | Path) -> None:
    """Load model.safetensors into model, in the floating-point dtype it was
    saved in (see mismatches for what it refuses)."""
    path = _require(Path(directory) / WEIGHTS_NAME)
    try:
        stored = safetensors.torch.load_file(path)
    except safetensors.SafetensorError as error:
        raise _unreadable(path, error) from error
    problems = mismatches(model.state_dict(), stored)
    if problems:
        raise ValueError(f"checkpoint {path} does not match the model: " + "; ".join(problems))
    floating = {t.dtype for t in stored.values() if t.is_floating_point()}
    if floating:
        model.to(floating.pop())
    model.load_state_dict(stored)
