"""Every kernel compiles for Hopper (sm_90) on this CPU-only machine, and the decode-path kernels do not spill
registers. The interpreter used by the other kernel tests accepts programs the compiler rejects (a tl.dot
dim under 16, say), so this is what keeps CI honest about the GPU build."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("triton")
from atlas_kernels import compile_report

if not os.path.exists(compile_report.ptxas_path()):
    pytest.skip("this triton build ships no ptxas", allow_module_level=True)


def test_all_kernels_compile_for_hopper_and_decode_kernels_do_not_spill() -> None:
    reports = compile_report.all_reports()

    assert len(reports) == 13
    for report in reports:
        assert 0 < report.registers <= 255, report
        # the chunked prefill keeps [64, 128] fp32 operand tiles and is known to spill (KERNELS.md)
        if report.kernel not in ("gdn_chunk_kernel", "prepare_kernel", "scan_kernel"):
            assert report.spill_bytes == 0, report
