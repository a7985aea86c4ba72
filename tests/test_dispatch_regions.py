"""benchmarks/dispatch_count.py --regions-as-calls: a compiled-regions step counted on the CPU without compiling,
each region call one and the launches outside the regions one each."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import dispatch_count

pytestmark = pytest.mark.slow


def test_a_compiled_decode_counts_each_region_call_once_and_nothing_inside() -> None:
    from atlas.backends.cuda import regions

    real = regions.compiled
    row = dispatch_count.count_step("default", batch=1, context=20, layers=4, regions_as_calls=True)
    assert regions.compiled is real  # put back
    calls = {k[len("region:"):]: v for k, v in row["by_op"].items() if k.startswith("region:")}
    # the benchmark model's first 4 layers: three GDN (one with PLE) and one attention; the prologue and final mix
    assert calls == {"group_columns": 1, "prologue": 1, "ple_block": 1, "gdn_head": 3, "gdn_tail": 3, "attn_head": 1,
                     "attn_post": 1, "final_mix": 1}, calls
    assert row["region_calls"] == 12
    # inside the regions nothing is counted: no hyper-site norm, no router top-k, no sigmoid of a gate; and the
    # prologue's rotary table and n-gram ids (regions.computes_ngram_ids: the runner leaves them to it)
    # and the group's columns (positions, flat KV slots, stamps: regions.columns_of)
    assert not {"rms_norm", "topk", "sigmoid", "softmax", "cos", "sin", "bitwise_xor", "gather", "floor_divide",
                "arange"} & set(row["by_op"])
    # what the regions leave outside: the GDN update, the paged attention and the routed experts (Triton), the step's
    # stamps, the n-gram ids, the lm head
    assert row["by_op"]["triton:_gdn_recurrent_kernel"] == 3 and row["by_op"]["triton:_moe_down_kernel"] == 4
    assert row["gemms"] == 1


def test_a_compiled_verify_runs_the_decodes_regions_and_commits_in_two_launches_a_state() -> None:
    """A wide verify of 2 drafts (one [1, 3] group, compiled regions) makes the decode's region calls and Triton
    launches, each once a layer; what it adds outside them is its verdicts and its commit, which selects every
    kept state in two launches (the gather, the write) and stamps them all in one."""
    decode = dispatch_count.count_step("default", batch=1, context=20, layers=4, regions_as_calls=True)
    verify = dispatch_count.count_step("default", batch=1, context=20, layers=4, regions_as_calls=True, drafts=2)

    def kinds(row: dict, prefix: str) -> dict:
        return {k: v for k, v in row["by_op"].items() if k.startswith(prefix)}

    assert kinds(verify, "region:") == kinds(decode, "region:")
    assert kinds(verify, "triton:") == kinds(decode, "triton:")
    states = 3 + 3 + 1 + 1  # three GDN layers' conv and recurrent states, the PLE layer's conv, the n-gram context
    assert verify["by_op"]["index_put_"] == states + 1  # each state's write, then every kept stamp at once
    assert verify["by_op"].get("sub", 0) <= 1 and verify["by_op"]["argmax"] <= decode["by_op"]["argmax"] + 1
    assert verify["ops"] <= decode["ops"] + 2 * states + 30, (verify["by_op"], decode["by_op"])
