"""Importing LumenBridge stays cheap: nothing heavy loads before it is needed."""

from __future__ import annotations

import subprocess
import sys

import torch

from lumenbridge import dispatch


def test_import_does_not_load_dynamo():
    run = subprocess.run(
        [sys.executable, "-c", "import sys, lumenbridge; print('torch._dynamo' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert run.stdout.strip() == "False"


def test_the_backend_choice_is_marked_constant_as_torch_compiler_would():
    def probe():
        return "cpu"

    marked = torch.compiler.assume_constant_result(probe)
    flags = {key: value for key, value in vars(dispatch.resolve_backend_name).items() if key.startswith("_dynamo")}
    assert flags == vars(marked)
