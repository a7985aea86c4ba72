"""Compile every kernel for Hopper (sm_90) without a GPU and report registers, spills and shared memory.

    python -m atlas_kernels.compile_report [--json] [--ptx DIR]

Triton compiles ahead of time for any target, and its wheel ships ptxas, so compile errors and register
spills (the usual reason a kernel is far off its bandwidth or FLOP ceiling) show up on a CPU-only machine,
at no device time. The tests use it to catch kernels that interpret fine but do not compile. --ptx DIR writes
every kernel's PTX there (the JSON's "ptx" names the file).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import attrs
import triton
from atlas_kernels import (
    conv,
    gdn_chunk_split,
    gdn_recurrent,
    keyed_sample,
    moe_grouped,
    norms,
    paged_attention,
    qsa,
    stamp_summary,
)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

HOPPER = GPUTarget("cuda", 90, 32)


@attrs.frozen
class CompileReport:
    kernel: str
    config: str
    registers: int
    spill_bytes: int  # spill stores + spill loads per thread
    stack_bytes: int
    shared_bytes: int
    ptx: str = ""  # the PTX's file under --ptx DIR ("" without)


def ptxas_path() -> str:
    """The ptxas Triton itself assembles Hopper code with: from 3.9 on a newer one (ptxas-blackwell) for sm_90+,
    whose PTX version the bundled legacy ptxas refuses."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:  # Triton 3.6: one bundled ptxas
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return get_ptxas(90).path


PTX_DIR = ""  # where compile_for_hopper writes each kernel's PTX (main's --ptx); "" nowhere


def compile_for_hopper(kernel: Any, arg_types: dict[str, str], constexprs: dict[str, Any], num_warps: int = 4,
                       label: str = "", num_stages: int = 3, divisible: tuple[str, ...] = ()) -> CompileReport:
    """arg_types: Triton type strings ('*bf16', 'i32', 'fp32') of every non-constexpr argument; divisible: the
    arguments a launch would see divisible by 16 (Triton specialises on it: vector loads, fewer address registers)."""
    if not isinstance(kernel, JITFunction):
        # Under TRITON_INTERPRET=1 the decorator gave an interpreter wrapper; compiling its function in the
        # same process breaks the interpreter's later runs (and the reverse), so run this in its own process.
        raise RuntimeError("compile_report needs a process without TRITON_INTERPRET=1")
    names = kernel.arg_names
    signature = {name: "constexpr" if name in constexprs else arg_types[name] for name in names}
    source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constexprs.items()},
                       {(names.index(name),): [["tt.divisibility", 16]] for name in divisible})
    compiled = triton.compile(source, target=HOPPER, options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = compiled.asm["ptx"]
    arch = next(line.split()[1] for line in ptx.splitlines() if line.startswith(".target"))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as file:
        file.write(ptx)
        file.flush()
        info = subprocess.run([ptxas_path(), "-v", f"--gpu-name={arch}", file.name, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr

    ptx_file = ""
    if PTX_DIR:
        ptx_file = os.path.join(PTX_DIR, re.sub(r"[^A-Za-z0-9=.-]+", "_", f"{kernel.fn.__name__.strip('_')} {label}")
                                + ".ptx")
        with open(ptx_file, "w") as out:
            out.write(ptx)

    def number(pattern: str) -> int:
        found = re.search(pattern, info)
        return int(found.group(1)) if found else 0

    return CompileReport(
        kernel=kernel.fn.__name__.strip("_"), config=label,
        registers=number(r"Used (\d+) registers"),
        spill_bytes=number(r"(\d+) bytes spill stores") + number(r"(\d+) bytes spill loads"),
        stack_bytes=number(r"(\d+) bytes stack frame"), shared_bytes=compiled.metadata.shared, ptx=ptx_file,
    )


def gdn_chunk_split_cases() -> list[CompileReport]:
    work = dict(w_ptr="*fp32", u_ptr="*fp32", q_norm_ptr="*fp32", k_norm_ptr="*fp32", p_ptr="*fp32",
                g_cum_ptr="*fp32", cu_seqlens_ptr="*i32")
    # as the backend launches them (gdn_chunk_prefill_gated): the raw gates a / b (bf16 slices of the projection)
    # in, the gates in the kernel, uniform sequence lengths; 4 prepare warps; the scan at dv tile 32 with 4 warps, its
    # loop pipelined 2 deep, the stamp in it
    prepare = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", g_ptr="*bf16", beta_ptr="*bf16",
                   a_log_ptr="*fp32", dt_bias_ptr="*fp32", **work, num_k_heads="i32", num_v_heads="i32",
                   qk_stride="i32", v_stride="i32", g_stride="i32", beta_stride="i32", seq_len="i32", scale="fp32",
                   eps="fp32")
    scan = dict(w_ptr="*fp32", u_ptr="*fp32", q_ptr="*bf16", k_ptr="*bf16", q_norm_ptr="*fp32", k_norm_ptr="*fp32",
                p_ptr="*fp32", g_cum_ptr="*fp32", cu_seqlens_ptr="*i32", state_ptr="*fp32", slot_ptr="*i64",
                out_ptr="*bf16", stamp_ptr="*i32", end_ptr="*i32", num_k_heads="i32", num_v_heads="i32",
                qk_stride="i32", seq_len="i32")
    # divisible by 16 as a 2,048-token layer launches them: the q / k / v slices of the conv output and their
    # strides, the scratch, the head counts and the length (the gate slices a / b of the projection are not)
    aligned = ("q_ptr", "k_ptr", "v_ptr", *work, "state_ptr", "out_ptr", "num_k_heads", "num_v_heads", "qk_stride",
               "v_stride", "seq_len")
    c = gdn_chunk_split.CHUNK
    bf16_work = dict(w_ptr="*bf16", u_ptr="*bf16", p_ptr="*bf16")
    return [
        compile_for_hopper(gdn_chunk_split._prepare_kernel, prepare,
                           dict(DK=128, DV=128, BK=128, BDV=128, C=c, LOG2_C=6, PRECISION="tf32", FUSED_GATING=True,
                                UNIFORM=True, BLOCK_INVERSE=True), 4, "warps=4 stages=1 tf32 gated uniform blocks",
                           num_stages=1, divisible=tuple(name for name in aligned if name in prepare)),
        compile_for_hopper(gdn_chunk_split._scan_kernel, scan,
                           dict(DK=128, DV=128, BK=128, BV=32, C=c, PRECISION="tf32", UNIFORM=True, STAMP=True), 4,
                           "BV=32 warps=4 stages=2 tf32 uniform stamp", num_stages=2,
                           divisible=tuple(name for name in aligned if name in scan)),
        # the default's: bf16 work (w, u, p in bf16) with the registers prepare at its 2 warps
        compile_for_hopper(gdn_chunk_split._prepare_registers_kernel, {**prepare, **bf16_work},
                           dict(DK=128, DV=128, BK=128, BDV=128, C=c, PRECISION="tf32", FUSED_GATING=True,
                                UNIFORM=True), 2, "registers warps=2 stages=1 bf16 work gated uniform",
                           num_stages=1, divisible=tuple(name for name in aligned if name in prepare)),
    ]


def gdn_recurrent_case(block_v: int = 32, store_states: bool = False, fused_gating: bool = False
                       ) -> CompileReport:
    types = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", g_ptr="*fp32", beta_ptr="*bf16", a_log_ptr="*fp32",
                 dt_bias_ptr="*fp32", state_ptr="*fp32", slot_ptr="*i64", out_ptr="*bf16", states_out_ptr="*fp32",
                 stamp_ptr="*i32", end_ptr="*i32", num_tokens="i32", num_k_heads="i32", num_v_heads="i32", qk_token_stride="i32",
                 v_token_stride="i32", g_token_stride="i32", beta_token_stride="i32", scale="fp32", eps="fp32")
    # the decode case (commit) writes its state's stamp in the kernel, as the backend launches it
    consts = dict(DK=128, DV=128, BK=128, BV=block_v, STORE_STATES=store_states, COMMIT=not store_states,
                  FUSED_GATING=fused_gating, STAMP=not store_states)
    return compile_for_hopper(gdn_recurrent._gdn_recurrent_kernel, types, consts, 4,
                              f"BV={block_v} states={store_states} gating={fused_gating}")


def conv_case() -> CompileReport:
    types = dict(x_ptr="*bf16", state_ptr="*bf16", slot_ptr="*i64", weight_ptr="*bf16", bias_ptr="*bf16",
                 out_ptr="*bf16", num_tokens="i32", channels="i32")
    consts = dict(K=4, S=4, BS=4, BC=256, HAS_BIAS=False, SILU=True)
    return compile_for_hopper(conv._conv_update_kernel, types, consts, 4, "C tile 256, K=S=4")


def conv_prefill_cases() -> list[CompileReport]:
    # as causal_conv_prefill launches it on a GDN head's projection slice (bf16, K = 4, S = 3, dilation 1; the
    # pointers, the channel count and the strides divisible by 16 as there)
    types = dict(x_ptr="*bf16", prev_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16", num_tokens="i32",
                 channels="i32", x_seq_stride="i32", x_token_stride="i32")
    consts = dict(K=4, S=3, DIL=1, BT=32, BC=128, SILU=True)
    reports = []
    for name in (conv.PREFILL_SCHEDULE, "rows" if conv.PREFILL_SCHEDULES[conv.PREFILL_SCHEDULE][0] == "tiles" else "tiles"):
        form, block_t, block_c, warps = conv.PREFILL_SCHEDULES[name]
        kernel = conv._conv_prefill_rows_kernel if form == "rows" else conv._conv_prefill_kernel
        label = f"{name}{' (today)' if name == conv.PREFILL_SCHEDULE else ''}: T {block_t}, C {block_c}, K=4 S=3, {warps} warps"
        reports.append(compile_for_hopper(kernel, types, {**consts, "BT": block_t, "BC": block_c}, warps, label,
                                          divisible=("x_ptr", "prev_ptr", "weight_ptr", "out_ptr", "channels",
                                                     "x_seq_stride", "x_token_stride")))
    return reports


def attention_cases() -> list[CompileReport]:
    """The partition kernel dense and QSA-selected and the merge."""
    types = dict(q_ptr="*bf16", k_pool_ptr="*bf16", v_pool_ptr="*bf16", block_tables_ptr="*i32",
                 seq_lens_ptr="*i32", selected_ptr="*i32", selected_count_ptr="*i32", m_ptr="*fp32",
                 l_ptr="*fp32", acc_ptr="*fp32", num_rows="i32", num_q_heads="i32", num_kv_heads="i32",
                 block_size="i32", max_blocks="i32", max_selected="i32", num_partitions="i32", scale="fp32")
    reports = []
    for selected in (False, True):
        consts = dict(D=128, BD=128, GROUP=8, BG=16, BN=64, PART=paged_attention.PARTITION, SELECTED=selected,
                      PRECISION="tf32")
        reports.append(compile_for_hopper(paged_attention._attention_partition_kernel, types, consts, 8,
                                          f"D=128 group 8 {'qsa' if selected else 'dense'}"))
    merge_types = dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", out_ptr="*bf16", num_partitions="i32")
    reports.append(compile_for_hopper(paged_attention._attention_merge_kernel, merge_types,
                                      dict(D=128, BD=128, BP=32), 4, "32 partitions"))
    return reports


def qsa_cases() -> list[CompileReport]:
    pool_types = dict(raw_pool_ptr="*bf16", pooled_pool_ptr="*bf16", block_tables_ptr="*i32",
                      first_block_ptr="*i32", end_block_ptr="*i32", norm_weight_ptr="*fp32", inv_freq_ptr="*fp32",
                      block_size="i32", max_pages="i32", eps="fp32")
    score_types = dict(q_ptr="*bf16", pooled_pool_ptr="*bf16", block_tables_ptr="*i32", seq_lens_ptr="*i32",
                       scores_ptr="*fp32", num_rows="i32", num_heads="i32", max_pages="i32", per_page="i32",
                       max_blocks="i32", scale="fp32")
    return [
        compile_for_hopper(qsa._pool_keys_kernel, pool_types,
                           dict(D=128, BD=128, ROTARY=32, RATIO=4, BJ=16), 4, "d=128 rotary 32"),
        compile_for_hopper(qsa._block_scores_kernel, score_types,
                           dict(RATIO=4, D=128, BD=128, BH=16, BB=64, PRECISION="tf32"), 4,
                           "8 heads, 64 blocks"),
    ]


def norm_cases() -> list[CompileReport]:
    types = dict(x_ptr="*bf16", gate_ptr="*bf16", weight_ptr="*fp32", out_ptr="*bf16", num_rows="i32",
                 width="i32", eps="fp32")
    return [
        compile_for_hopper(norms._rms_norm_kernel, types, dict(BN=2048, BM=2, GATED=False), 4, "[*, 2048]"),
        compile_for_hopper(norms._rms_norm_kernel, types, dict(BN=128, BM=16, GATED=True), 4, "gated [*, 128]"),
    ]


def keyed_sample_cases() -> list[CompileReport]:
    reports = []
    for logits in ("bf16", "fp32"):  # the bf16 model, and the fp32 parity mode (a penalty makes them fp64)
        types = dict(key_ptr=f"*{logits}", temp_ptr="*fp64", lmp_ptr="*fp64", last_ptr="*fp64", zmax_ptr="*fp64",
                     seed_ptr="*i64", pos_ptr="*i64", best_val_ptr="*fp64", best_idx_ptr="*i64", vocab="i32",
                     chunk="i32", start_a="i64", start_b="i64", splits="i32")
        reports.append(compile_for_hopper(keyed_sample._keyed_argmax_kernel, types,
                                          dict(BLOCK=keyed_sample.BLOCK), 4, f"{logits} logits, block 1024"))
    return reports


def moe_cases() -> list[CompileReport]:
    """The gate-up and down kernels at the decode and prefill tiles and the prefill down tile."""
    reports = []
    for rows in (1, 2048):  # decode tiles, prefill tiles
        bm, bn, bk = moe_grouped.block_sizes(rows)
        warps = moe_grouped.num_warps(bm)
        up = dict(x_ptr="*bf16", order_ptr="*i64", offsets_ptr="*i32", w_ptr="*bf16", act_ptr="*bf16",
                  hidden="i32", inter="i32", m_tiles="i32", pairs="i32")
        reports.append(compile_for_hopper(moe_grouped._moe_gate_up_kernel, up,
                                          dict(TOP_K=4, BM=bm, BN=bn, BK=bk, EVEN_K=True, PRECISION="tf32"),
                                          warps, f"BM={bm} BN={bn} BK={bk} warps={warps}"))
        down = dict(act_ptr="*bf16", order_ptr="*i64", offsets_ptr="*i32", top_w_ptr="*bf16", w_ptr="*bf16",
                    out_ptr="*bf16", hidden="i32", inter="i32", m_tiles="i32", pairs="i32")
        reports.append(compile_for_hopper(moe_grouped._moe_down_kernel, down,
                                          dict(BM=bm, BN=bn, BK=bk, EVEN_K=True, PRECISION="tf32"), warps,
                                          f"BM={bm} BN={bn} BK={bk} warps={warps}"))
    # the prefill down kernel's own tile (moe_grouped.PREFILL_DOWN_TILE)
    bn, bk, warps, stages = moe_grouped.PREFILL_DOWN_TILE
    reports.append(compile_for_hopper(moe_grouped._moe_down_kernel, down,
                                      dict(BM=128, BN=bn, BK=bk, EVEN_K=True, PRECISION="tf32"), warps,
                                      f"BM=128 BN={bn} BK={bk} warps={warps} stages={stages}", stages))
    return reports


def stamp_summary_case() -> CompileReport:
    # the benchmark model: 12 paged kinds (KV + QSA keys of 6 attention layers), 38 per-slot stamps, the drafter
    types = dict(tables_ptr="*i64", table_stride="i32", pos_ptr="*i32", pos_kind_stride="i32", stamps_ptr="*i32",
                 slots_total="i32", drafter_ptr="*i32", drafter_cap="i32", out_ptr="*i32", out_stride="i32",
                 span="i32")
    return compile_for_hopper(stamp_summary._stamp_summary_kernel, types,
                              dict(A=12, AP=16, S=38, SP=64, BS=16, BLOCK=256, HAS_DRAFTER=True), 4,
                              "12 paged kinds, 38 stamps, drafter")


def all_reports() -> list[CompileReport]:
    """The kernels at the benchmark model's (qwen4exp-2p7b) sizes, in the configurations the wrappers pick."""
    return [gdn_recurrent_case(), gdn_recurrent_case(64, store_states=True, fused_gating=True),
            *gdn_chunk_split_cases(), conv_case(), *conv_prefill_cases(),
            *attention_cases(), *qsa_cases(), *norm_cases(), *keyed_sample_cases(),
            *moe_cases(), stamp_summary_case()]


def main() -> None:
    global PTX_DIR
    if "--ptx" in sys.argv:
        PTX_DIR = sys.argv[sys.argv.index("--ptx") + 1]
        os.makedirs(PTX_DIR, exist_ok=True)
    if "--json" in sys.argv:
        print(json.dumps([attrs.asdict(report) for report in all_reports()]))
        return
    print(f"{'kernel':<30} {'config':<28} {'regs':>5} {'spill B':>8} {'stack B':>8} {'shared B':>9}")
    for report in all_reports():
        print(f"{report.kernel:<30} {report.config:<28} {report.registers:>5} {report.spill_bytes:>8} "
              f"{report.stack_bytes:>8} {report.shared_bytes:>9}")


if __name__ == "__main__":
    main()
