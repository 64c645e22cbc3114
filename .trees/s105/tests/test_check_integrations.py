"""scripts/check_integrations.py, the GPU machine's smoke check, passes here on the CPU."""

from __future__ import annotations

import runpy
from pathlib import Path

from conftest import import_or_skip

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_integrations.py"


def test_every_check_passes(capsys):
    import_or_skip("timm")
    import_or_skip("transformers")
    assert runpy.run_path(str(SCRIPT))["main"]() == 0
    out = capsys.readouterr().out
    for check in ("check_timm", "check_hf_model", "check_hf_towers", "check_packed"):
        assert f"OK    {check}" in out
