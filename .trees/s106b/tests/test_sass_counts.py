"""scripts/sass_counts.py splits nvdisasm's listing into kernels and counts
each one's instructions by opcode (predicated ones included)."""

from __future__ import annotations

import pytest
from conftest import load_script

sass_counts = load_script("sass_counts")

LISTING = """\
\t.section\t.text._Z5firstv,"ax",@progbits
_Z5firstv:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
	//## File "/src/lumenbridge/csrc/cuda/first.cu", line 12
        /*0010*/               @P0 BRA `(.L_x_1) ;
.L_x_1:
        /*0020*/              @!P1 EXIT ;
	//## File "/src/lumenbridge/csrc/cuda/common.cuh", line 40
        /*0030*/                   HMMA.16816.F32.BF16 R12, R12, R4, RZ ;
\t.type\t$__internal_0_$__cuda_sm20_div_s64,@function
_Z6secondv:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!UP0 BRA `(.L_x_2) ;
"""


def test_kernels_are_split_and_their_opcodes_counted():
    kernels = sass_counts.kernels_in(LISTING)
    assert list(kernels) == ["_Z5firstv", "_Z6secondv"]
    assert [i.opcode for i in kernels["_Z5firstv"]] == ["LDC", "BRA", "EXIT", "HMMA"]
    assert [i.opcode for i in kernels["_Z6secondv"]] == ["LDC", "BRA"]
    assert kernels["_Z5firstv"][3].text.startswith("/*0030*/")


def test_each_instruction_takes_the_source_line_named_before_it():
    kernels = sass_counts.kernels_in(LISTING)
    assert [i.source for i in kernels["_Z5firstv"]] == ["", "first.cu:12", "first.cu:12", "common.cuh:40"]
    assert [i.source for i in kernels["_Z6secondv"]] == ["", ""]  # a new kernel starts with none


def test_names_are_demangled():
    assert sass_counts.demangle(["_Z5firstv", "_Z6secondv"]) == ["first()", "second()"]


def test_a_given_nvdisasm_is_used_as_given():
    assert sass_counts.find_nvdisasm("/opt/cuda/bin/nvdisasm") == "/opt/cuda/bin/nvdisasm"


def test_a_kernel_file_that_does_not_compile_is_named(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cu"
    broken.write_text("this is not CUDA\n")

    class Failed:
        returncode, stderr = 1, "broken.cu(1): error: this declaration has no storage class"

    monkeypatch.setattr(sass_counts.subprocess, "run", lambda *args, **kwargs: Failed())
    with pytest.raises(SystemExit, match="nvcc failed on .*broken.cu"):
        sass_counts.compile_cubin(broken, tmp_path / "out.cubin")
