"""Checkpoints: config.json plus model.safetensors in one directory. No pickle.

Each file is written to a temporary name, flushed and renamed into place, so a
failure midway never leaves a half-written file. model.safetensors also holds
the config in its metadata, and loading prefers that copy: a save killed
between the two renames, over a checkpoint of another architecture, still loads
the weights it wrote, with their own config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch

from .atomic import write_atomically
from .config import TokenizerConfig

if TYPE_CHECKING:
    from .model import VisualTokenizer

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# The metadata key of the config that model.safetensors carries.
CONFIG_METADATA = "lumenbridge_config"


def save(model: VisualTokenizer, directory: str | Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # safetensors stores dense tensors; channels-last parameters are made contiguous.
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    metadata = {CONFIG_METADATA: model.config.to_json()}
    write_atomically(directory / WEIGHTS_NAME, lambda path: safetensors.torch.save_file(tensors, path, metadata))
    write_atomically(directory / CONFIG_NAME, lambda path: Path(path).write_text(model.config.to_json() + "\n"))


def _require(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    return path


def _unreadable(path: Path, error: Exception) -> ValueError:
    return ValueError(f"{path} is not a readable LumenBridge checkpoint file: {type(error).__name__}: {error}")


def read_config(directory: str | Path) -> TokenizerConfig:
    weights = Path(directory) / WEIGHTS_NAME
    if weights.is_file():
        try:
            with safetensors.safe_open(weights, "pt") as file:
                stored = (file.metadata() or {}).get(CONFIG_METADATA)
        except safetensors.SafetensorError as error:
            raise _unreadable(weights, error) from error
        if stored is not None:
            return TokenizerConfig.from_json(stored)
    path = _require(Path(directory) / CONFIG_NAME)
    try:
        return TokenizerConfig.from_json(path.read_text())
    except json.JSONDecodeError as error:
        raise _unreadable(path, error) from error


def load_weights(model: VisualTokenizer, directory: str | Path) -> None:
    """Load model.safetensors into model, naming any missing, unexpected or mis-shaped tensor."""
    path = _require(Path(directory) / WEIGHTS_NAME)
    try:
        stored = safetensors.torch.load_file(path)
    except safetensors.SafetensorError as error:
        raise _unreadable(path, error) from error
    expected = model.state_dict()
    problems = [f"missing tensor {name!r}" for name in expected if name not in stored]
    problems += [f"unexpected tensor {name!r}" for name in stored if name not in expected]
    problems += [
        f"tensor {name!r} has shape {list(stored[name].shape)} but the model expects {list(t.shape)}"
        for name, t in expected.items()
        if name in stored and stored[name].shape != t.shape
    ]
    if problems:
        raise ValueError(f"checkpoint {path} does not match the model: " + "; ".join(problems))
    model.load_state_dict(stored)
