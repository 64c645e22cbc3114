"""Importing LumenBridge stays cheap: nothing heavy loads before it is needed."""

from __future__ import annotations

import subprocess
import sys

import torch

from lumenbridge import dispatch


def modules_loaded_by(code: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running code."""
    run = subprocess.run(
        [sys.executable, "-c", f"import sys; {code}; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return set(run.stdout.split())


def test_import_lumenbridge_alone_does_not_load_torch():
    assert "torch" not in modules_loaded_by("import lumenbridge")


def test_using_the_package_does_not_load_dynamo():
    loaded = modules_loaded_by("import lumenbridge; lumenbridge.VisualTokenizer; lumenbridge.backends")
    assert "torch" in loaded and "lumenbridge.dispatch" in loaded
    assert "torch._dynamo" not in loaded


def test_every_public_name_resolves():
    import lumenbridge

    assert all(getattr(lumenbridge, name) is not None for name in lumenbridge.__all__)
    assert set(lumenbridge.__all__) <= set(dir(lumenbridge))


def test_the_backend_choice_is_marked_constant_as_torch_compiler_would():
    def probe():
        return "cpu"

    marked = torch.compiler.assume_constant_result(probe)
    flags = {key: value for key, value in vars(dispatch.resolve_backend_name).items() if key.startswith("_dynamo")}
    assert flags == vars(marked)
