"""Time every atlas_kernels kernel on a GPU at the benchmark model's sizes, against the two ceilings measured
in the same run: device copy bandwidth (bytes read + written) and the bf16 matmul rate.

    python3 benchmarks/kernels.py [--config benchmarks/configs/qwen4exp-2p7b.json] [--out DIR] [--dry-run]

Without a CUDA GPU it exits with status 2 and one line; `--dry-run` (or `--smoke`) only loads the config and
lists what would be timed (CI runs that, so a missing config fails there).

Decode-sized kernels are timed as one whole decode step over all layers of their kind (18 GDN layers,
6 attention layers), each layer with its own buffers as in the model, replayed from a CUDA graph: one layer's
state alone would sit in the 60 MB L2 and flatter the bandwidth. Times are medians.
Byte counts are the fewest a kernel must move (each input read once, each output written once).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing
from atlas_kernels import reference as ref
from atlas_kernels.conv import causal_conv1d_update
from atlas_kernels.gdn_chunk_split import CHUNK, gdn_chunk_prefill_split
from atlas_kernels.gdn_recurrent import gdn_recurrent
from atlas_kernels.norms import gated_rms_norm, rms_norm
from atlas_kernels.paged_attention import paged_attention
from atlas_kernels.qsa import qsa_block_scores, qsa_pool_keys, qsa_select

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "qwen4exp-2p7b.json"
DEV = "cuda"
BF16 = torch.bfloat16
# The sizes swept; module constants so a CPU smoke run (TRITON_INTERPRET=1) can shrink them.
BATCHES = (1, 16, 64)
VERIFY = (16, 4)  # batch, tokens per row
PREFILL_TOKENS = 2048
CONTEXTS = (2048, 8192)
NORM_ROWS = (64, 2048)
results: list[dict] = []


def load_config(path: Path) -> dict:
    if not path.is_file():
        raise SystemExit(f"kernels.py: --config {str(path)!r} does not exist; pass a model config.json")
    return json.loads(path.read_text())


def time_ms(fn: Callable[[], object], graph: bool = True) -> float:
    fn()  # compile outside the timed region
    torch.cuda.synchronize()
    if graph:
        try:
            return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
        except Exception as error:  # a launch path that cannot be captured: time it with its launch gaps
            print(f"# CUDA graph capture failed ({error}); timing without a graph", flush=True)
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def record(kernel: str, case: str, ms: float, *, bytes_moved: float = 0.0, flops: float = 0.0,
           layers: int = 1, note: str = "") -> None:
    row = {"kernel": kernel, "case": case, "ms": ms, "us_per_layer": 1e3 * ms / layers, "layers": layers,
           "bytes": bytes_moved, "flops": flops, "note": note}
    if bytes_moved:
        row["gb_s"] = bytes_moved / ms / 1e6
        row["pct_copy_bw"] = 100 * row["gb_s"] / CEILINGS["copy_gb_s"]
    if flops:
        row["tflop_s"] = flops / ms / 1e9
        row["pct_bf16_mm"] = 100 * row["tflop_s"] / CEILINGS["bf16_tflop_s"]
    results.append(row)
    bw = f"{row['gb_s']:8.0f} GB/s {row['pct_copy_bw']:5.1f}%" if bytes_moved else " " * 20
    fl = f"{row['tflop_s']:7.1f} TF/s {row['pct_bf16_mm']:5.1f}%" if flops else ""
    print(f"{kernel:<16} {case:<34} {ms * 1e3:9.1f} us {row['us_per_layer']:8.1f} us/layer {bw} {fl} {note}",
          flush=True)


CEILINGS: dict[str, float] = {}


def measure_ceilings() -> None:
    src = torch.randn(1 << 29, device=DEV)  # 2 GiB fp32
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), graph=False)
    CEILINGS["copy_gb_s"] = 2 * src.numel() * 4 / ms / 1e6
    a = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    b = torch.randn(8192, 8192, device=DEV, dtype=BF16)
    ms = time_ms(lambda: a @ b, graph=False)
    CEILINGS["bf16_tflop_s"] = 2 * 8192**3 / ms / 1e9
    print(f"# ceilings: device copy {CEILINGS['copy_gb_s']:.0f} GB/s (read + write), "
          f"bf16 matmul 8192^3 {CEILINGS['bf16_tflop_s']:.0f} TFLOP/s", flush=True)


def gdn_inputs(lead: tuple[int, ...], hk: int, hv: int, dk: int, dv: int, dtype=BF16):
    q = torch.randn(*lead, hk, dk, device=DEV, dtype=dtype)
    k = torch.randn(*lead, hk, dk, device=DEV, dtype=dtype)
    v = torch.randn(*lead, hv, dv, device=DEV, dtype=dtype)
    g = -torch.nn.functional.softplus(torch.randn(*lead, hv, device=DEV) - 4.0) * 4.0
    beta = torch.sigmoid(torch.randn(*lead, hv, device=DEV)).to(dtype)
    return q, k, v, g, beta


def bench_gdn_recurrent(cfg: dict, layers: int) -> None:
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    state_bytes = hv * dk * dv * 4
    for batch, tokens, verify in [*((b, 1, False) for b in BATCHES), (*VERIFY, True)]:
        for block_v in (32, 64):
            per_layer = []
            for _ in range(layers):
                inputs = gdn_inputs((batch, tokens), hk, hv, dk, dv)
                pool = 0.1 * torch.randn(batch, hv, dk, dv, device=DEV)
                per_layer.append((inputs, pool, torch.arange(batch, device=DEV)))

            def step(per_layer=per_layer, verify=verify, block_v=block_v) -> None:
                for (q, k, v, g, beta), pool, slots in per_layer:
                    gdn_recurrent(q, k, v, g, beta, pool, slots, store_states=verify, commit=not verify,
                                  block_v=block_v)

            io = batch * tokens * (2 * hk * dk + 2 * hv * dv + 2 * hv) * 2
            moved = layers * (batch * state_bytes * (1 + (tokens if verify else 1)) + io)
            case = f"B={batch} T={tokens}{' verify' if verify else ''} BV={block_v}"
            record("gdn_recurrent", case, time_ms(step), bytes_moved=moved, layers=layers)
            del per_layer
    bench_fla_recurrent(hk, hv, dk, dv, layers)


def fla_ops():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as error:  # optional: measured where installed, never required
        print(f"# flash-linear-attention not available ({type(error).__name__}: {error})", flush=True)
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def bench_fla_recurrent(hk: int, hv: int, dk: int, dv: int, layers: int) -> None:
    ops = fla_ops()
    if ops is None:
        return
    _, fused_recurrent = ops
    for batch in BATCHES:
        per_layer = [(gdn_inputs((batch, 1), hk, hv, dk, dv), 0.1 * torch.randn(batch, hv, dk, dv, device=DEV))
                     for _ in range(layers)]

        def step(per_layer=per_layer) -> None:
            for (q, k, v, g, beta), state in per_layer:
                fused_recurrent(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                use_qk_l2norm_in_kernel=True)

        moved = layers * batch * (2 * hv * dk * dv * 4 + (2 * hk * dk + 2 * hv * dv) * 2)
        try:
            record("fla_recurrent", f"B={batch} T=1", time_ms(step), bytes_moved=moved, layers=layers,
                   note="fla-core 0.6.0 fused_recurrent_gated_delta_rule")
        except Exception as error:
            print(f"# fla recurrent failed: {error}", flush=True)
        del per_layer


def chunk_flops(tokens: int, hv: int, dk: int, dv: int) -> float:
    """Matrix FLOPs of the chunked algorithm (each dk-side product counted once per head, not per dv tile)."""
    c = CHUNK
    per_chunk = 2 * (c * c * dk * 2 + (int(math.log2(c)) - 1) * 2 * c**3 + c * c * (dv + dk)
                     + 3 * c * dk * dv + c * c * dv)
    return hv * (tokens / c) * per_chunk


def bench_gdn_prefill(cfg: dict, with_fp32: bool, others: bool = True, schedules: str = "") -> None:
    """others=False (--no-sweep): only the backend's call, at its defaults and GATED_CHUNK_SCHEDULES (not the split
    kernel's tiles); schedules (--chunk-schedules): only the schedules whose name holds it."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    tokens = PREFILL_TOKENS
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=DEV)
    slots = torch.zeros(1, dtype=torch.long, device=DEV)
    flops = chunk_flops(tokens, hv, dk, dv)
    # fp32 (ieee dots) spills tens of KB at dk = 128: 41 to 68 ms a layer and ~100 s to compile, so opt-in
    dtypes = [BF16, torch.float32] if with_fp32 else [BF16]
    for dtype in dtypes:
        inputs = gdn_inputs((tokens,), hk, hv, dk, dv, dtype)
        # the scan's grid is dv tiles x heads (128 programs at tile 32 for 32 heads, on 132 SMs): tile 16 doubles it;
        # pw: the prepare kernel's warps (8 spilled 2.4 KB a thread in the sm_90 compile report)
        variants: list[tuple[str, Callable]] = [] if not others else [
            (f"split BV={bv} w={w} pw={pw}", lambda pool, bv=bv, w=w, pw=pw, inputs=inputs: gdn_chunk_prefill_split(
                *inputs, cu, pool, slots, tokens, block_v=bv, scan_warps=w, prepare_warps=pw))
            for bv, w, pw in [(64, 8, 8), (32, 4, 8), (16, 4, 8), (16, 2, 8), (32, 2, 8), (32, 4, 4), (32, 4, 16)]
        ]
        variants.append(("gated (the backend's call: strided slices, gates in-kernel)", gated_chunk_call(
            tokens, hk, hv, dk, dv, dtype)))
        # the backend's call under other launch schedules
        variants += [
            (f"gated {' '.join(f'{key}={value}' for key, value in schedule.items())}",
             gated_chunk_call(tokens, hk, hv, dk, dv, dtype, **schedule))
            for schedule in GATED_CHUNK_SCHEDULES
        ]
        variants = [(name, run) for name, run in variants if schedules in name or not name.startswith("gated ")]
        for name, run in variants:
            pool = 0.1 * torch.randn(1, hv, dk, dv, device=DEV)
            try:
                ms = time_ms(lambda run=run, pool=pool: run(pool))
            except Exception as error:
                print(f"# gdn_prefill {name} failed: {error}", flush=True)
                continue
            record("gdn_prefill", f"L={tokens} {str(dtype)[6:]} {name}", ms, flops=flops,
                   note=f"{tokens / ms / 1e3:.2f}M tok/s/layer")
    ops = fla_ops()
    if ops is not None:
        chunk, _ = ops
        q, k, v, g, beta = gdn_inputs((1, tokens), hk, hv, dk, dv)
        state = 0.1 * torch.randn(1, hv, dk, dv, device=DEV)
        try:
            ms = time_ms(lambda: chunk(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True), graph=False)
            record("fla_chunk", f"L={tokens} bf16", ms, flops=flops, note=f"{tokens / ms / 1e3:.2f}M tok/s/layer")
        except Exception as error:
            print(f"# fla chunk failed: {error}", flush=True)


# the backend's call under other launch schedules (prepare warps, the scan loop's pipelining depth) against its
# defaults (gdn_chunk_prefill_gated's docstring)
GATED_CHUNK_SCHEDULES = [
    {"inverse": "squaring"},  # the WY inverse by squaring the whole chunk (the blocks' inverse replaced it)
    {"inverse": "squaring", "prepare_warps": 8},
    {"prepare_warps": 8},
    {"prepare_warps": 2},
    {"scan_stages": 1},
    {"block_v": 64, "scan_warps": 8},
    # bf16 intermediates and scan products (the backend's for bf16 inputs): half of w / u's bytes, twice the rate
    {"work": "bf16"},  # its default: 3 scan stages (H200: 221.8 us, 2 stages 255.7)
    {"work": "bf16", "scan_stages": 2},
    {"work": "bf16", "prepare_warps": 8},
    {"work": "bf16", "block_v": 16},
    {"work": "bf16", "block_v": 64, "scan_warps": 8, "scan_stages": 2},  # (3 stages at tile 64: over shared memory)
    # the registers prepare (16-row blocks in registers, no global scratch / barriers; gdn_chunk_split's docstring),
    # against the scratch prepare above; sm_90 report at bf16 work: 4 warps 240 registers, 8 warps 230, 2 warps 245,
    # no spills (the scratch prepare: 255 and 1.7 KB of spills at 4 warps)
    {"work": "bf16", "prepare": "registers"},
    {"work": "bf16", "prepare": "registers", "prepare_warps": 8},
    {"work": "bf16", "prepare": "registers", "prepare_warps": 2},
    {"prepare": "registers"},  # fp32 work: the blocks alone, products still tf32 on fp32 operands
    # its registers capped for more programs an SM (ptxas: 168 -> 3 programs of 4 warps for 120 B of spills a thread,
    # 128 -> 4 for 664 B; 8 warps at 128: 424 B)
    {"work": "bf16", "prepare": "registers", "prepare_maxnreg": 168},
    {"work": "bf16", "prepare": "registers", "prepare_maxnreg": 128},
    {"work": "bf16", "prepare": "registers", "prepare_warps": 8, "prepare_maxnreg": 128},
    # 2 warps are the registers prepare's default (H200: 146.5 us); fewer warps, capped
    {"work": "bf16", "prepare": "registers", "prepare_warps": 1},
    {"work": "bf16", "prepare": "registers", "prepare_warps": 2, "prepare_maxnreg": 168},
    {"work": "bf16", "prepare": "registers", "prepare_warps": 2, "scan_stages": 2},
]


def gated_chunk_call(tokens: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, **schedule) -> Callable:
    """gdn_chunk_prefill_gated as a GDN layer's prefill calls it (gdn.triton_gdn): q / k / v token-strided slices
    of one channels-last conv output, a / b slices of one projection, the gates and the stamp in the kernels."""
    from atlas_kernels.gdn_chunk_split import gdn_chunk_prefill_gated

    key = hk * dk
    mixed = torch.randn(1, tokens, 2 * key + hv * dv, device=DEV, dtype=dtype)
    q, k = mixed[..., :key].view(1, tokens, hk, dk), mixed[..., key : 2 * key].view(1, tokens, hk, dk)
    v = mixed[..., 2 * key :].view(1, tokens, hv, dv)
    proj = torch.randn(1, tokens, 2 * hv, device=DEV, dtype=dtype)
    a, b = proj[..., :hv], proj[..., hv:]
    a_log, dt_bias = torch.zeros(hv, device=DEV), torch.full((hv,), -4.0, device=DEV)
    slots = torch.zeros(1, dtype=torch.long, device=DEV)
    stamps, ends = torch.zeros(1, dtype=torch.int32, device=DEV), torch.full((1,), tokens, dtype=torch.int32, device=DEV)
    return lambda pool: gdn_chunk_prefill_gated(q, k, v, a, b, a_log, dt_bias, pool, slots, stamp=(stamps, ends),
                                                **schedule)


def bench_conv(cfg: dict, layers: int) -> None:
    channels = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    channels += cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    kernel_size = cfg["linear_conv_kernel_dim"]
    for batch in BATCHES:
        per_layer = [(torch.randn(batch, 1, channels, device=DEV, dtype=BF16),
                      torch.randn(batch, channels, kernel_size, device=DEV, dtype=BF16),
                      torch.randn(channels, kernel_size, device=DEV, dtype=BF16)) for _ in range(layers)]
        slots = torch.arange(batch, device=DEV)

        def step(per_layer=per_layer, slots=slots) -> None:
            for x, pool, weight in per_layer:
                causal_conv1d_update(x, pool, slots, weight)

        moved = layers * (batch * channels * (2 * kernel_size + 2) * 2 + channels * kernel_size * 2)
        record("conv_update", f"B={batch} T=1 C={channels}", time_ms(step), bytes_moved=moved, layers=layers)
    # a prefill chunk's conv as the GDN head calls it (a compiled prefill region's): a slice of the in-projection's output,
    # at every named launch schedule (atlas_kernels.conv.PREFILL_SCHEDULES; PREFILL_SCHEDULE is today's)
    from atlas_kernels import conv
    from atlas_kernels.conv import causal_conv_prefill

    tokens = PREFILL_TOKENS
    proj = torch.randn(1, tokens, channels + 2 * cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"],
                       device=DEV, dtype=BF16)
    x = proj[..., :channels]
    prev = torch.randn(1, channels, kernel_size - 1, device=DEV, dtype=BF16)
    weight = torch.randn(channels, 1, kernel_size, device=DEV, dtype=BF16)
    today = conv.PREFILL_SCHEDULE
    for name in conv.PREFILL_SCHEDULES:
        conv.PREFILL_SCHEDULE = name
        record("conv_prefill", f"T={tokens} C={channels} (strided) {name}",
               time_ms(lambda: causal_conv_prefill(x, prev, weight, 1, True)), bytes_moved=2 * tokens * channels * 2,
               note="(today)" if name == today else "")
    conv.PREFILL_SCHEDULE = today


def paged_kv(batch: int, context: int, block_size: int, kv_heads: int, head_dim: int):
    pages = batch * triton.cdiv(context, block_size)
    tables = torch.randperm(pages, device=DEV).view(batch, -1).to(torch.int32)
    k_pool = torch.randn(pages, block_size, kv_heads, head_dim, device=DEV, dtype=BF16)
    v_pool = torch.randn(pages, block_size, kv_heads, head_dim, device=DEV, dtype=BF16)
    return k_pool, v_pool, tables


def bench_attention(cfg: dict, layers: int) -> None:
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ratio, budget = cfg["indexer_compress_ratio"], cfg["indexer_budget"]
    block_size = 16
    cases = [(context, batch, False) for context in CONTEXTS for batch in BATCHES]
    cases += [(CONTEXTS[-1], batch, True) for batch in (BATCHES[0], BATCHES[-1])]
    for context, batch, qsa in cases:
        per_layer = []
        for _ in range(layers):
            k_pool, v_pool, tables = paged_kv(batch, context, block_size, hkv, d)
            q = torch.randn(batch, 1, hq, d, device=DEV, dtype=BF16)
            per_layer.append((q, k_pool, v_pool, tables))
        lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)
        selected = counts = None
        keys = context
        if qsa:
            scores = torch.rand(batch, 1, context // ratio, device=DEV)
            selected, counts = qsa_select(scores, lens, ratio, budget)
            keys = budget + ratio - 1

        def step(per_layer=per_layer, lens=lens, selected=selected, counts=counts, keys=keys) -> None:
            for q, k_pool, v_pool, tables in per_layer:
                paged_attention(q, k_pool, v_pool, tables, lens, d**-0.5, keys, selected, counts)

        moved = layers * batch * (keys * hkv * d * 2 * 2 + 2 * hq * d * 2)
        flops = layers * batch * 4 * hq * d * keys
        case = f"ctx={context} B={batch}{' qsa' if qsa else ''}"
        record("paged_attention", case, time_ms(step), bytes_moved=moved, flops=flops, layers=layers)
        del per_layer


def bench_qsa(cfg: dict, layers: int) -> None:
    heads, d = cfg["indexer_n_heads"], cfg["indexer_head_dim"]
    ratio, budget, eps = cfg["indexer_compress_ratio"], cfg["indexer_budget"], cfg["rms_norm_eps"]
    rope = cfg["rope_parameters"]
    inv_freq = ref.rope_inv_freq(cfg["head_dim"], rope["partial_rotary_factor"], rope["rope_theta"]).to(DEV)
    block_size, context = 16, CONTEXTS[-1]
    blocks = context // ratio
    for batch in BATCHES:
        per_layer = []
        for _ in range(layers):
            pages = batch * context // block_size
            tables = torch.randperm(pages, device=DEV).view(batch, -1).to(torch.int32)
            pooled = torch.randn(pages, block_size // ratio, d, device=DEV, dtype=BF16)
            per_layer.append((torch.randn(batch, 1, heads, d, device=DEV, dtype=BF16), pooled, tables))
        lens = torch.full((batch,), context, dtype=torch.int32, device=DEV)

        def scores_only(per_layer=per_layer, lens=lens) -> None:
            for q, pooled, tables in per_layer:
                qsa_block_scores(q, pooled, tables, lens, ratio, blocks)

        def with_select(per_layer=per_layer, lens=lens) -> None:
            for q, pooled, tables in per_layer:
                qsa_select(qsa_block_scores(q, pooled, tables, lens, ratio, blocks), lens, ratio, budget)

        moved = layers * batch * blocks * d * 2
        record("qsa_scores", f"ctx={context} B={batch}", time_ms(scores_only), bytes_moved=moved, layers=layers)
        record("qsa_score+select", f"ctx={context} B={batch}", time_ms(with_select), bytes_moved=moved,
               layers=layers, note="select = stable torch.sort")
        del per_layer
    # prefill pooling: every block of a CONTEXTS[-1]-token prompt
    pages = context // block_size
    tables = torch.randperm(pages, device=DEV).view(1, -1).to(torch.int32)
    raw = torch.randn(pages, block_size, d, device=DEV, dtype=BF16)
    pooled = torch.empty(pages, block_size // ratio, d, device=DEV, dtype=BF16)
    zero, end = torch.zeros(1, dtype=torch.int32, device=DEV), torch.full((1,), blocks, dtype=torch.int32, device=DEV)
    weight = torch.randn(d, device=DEV)
    ms = time_ms(lambda: qsa_pool_keys(raw, pooled, tables, zero, end, weight, inv_freq, ratio, eps, blocks))
    record("qsa_pool_keys", f"prefill ctx={context}", ms, bytes_moved=context * d * 2 * (1 + 1 / ratio))


def bench_norms(cfg: dict) -> None:
    hidden, eps = cfg["hidden_size"], cfg["rms_norm_eps"]
    hv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    for tokens in NORM_ROWS:
        x = torch.randn(tokens, hidden, device=DEV, dtype=BF16)
        w = torch.randn(hidden, device=DEV)
        record("rms_norm", f"[{tokens}, {hidden}]", time_ms(lambda x=x, w=w: rms_norm(x, w, eps)),
               bytes_moved=2 * x.numel() * 2)
        record("rms_norm_torch", f"[{tokens}, {hidden}]",
               time_ms(lambda x=x, w=w: ref.rms_norm(x, w, eps).to(BF16)), bytes_moved=2 * x.numel() * 2,
               note="eager torch, for comparison")
        x = torch.randn(tokens * hv, dv, device=DEV, dtype=BF16)
        z = torch.randn(tokens * hv, dv, device=DEV, dtype=BF16)
        w = torch.randn(dv, device=DEV)
        record("gated_rms_norm", f"[{tokens}x{hv}, {dv}]", time_ms(lambda x=x, z=z, w=w: gated_rms_norm(x, z, w, eps)),
               bytes_moved=3 * x.numel() * 2)
        record("gated_norm_torch", f"[{tokens}x{hv}, {dv}]",
               time_ms(lambda x=x, z=z, w=w: ref.gated_rms_norm(x, z, w, eps).to(BF16)),
               bytes_moved=3 * x.numel() * 2, note="eager torch, for comparison")


# (block_m, block_n, block_k, stages) of the routed-MoE kernels swept at decode sizes; block_m stays 16 for every
# decode batch (a row's result must not depend on the batch). The chosen tile is then fixed in block_sizes: a
# runtime autotune would pick by timing noise and change the reduction order from run to run.
MOE_TILES = [(16, bn, bk, st) for bn in (16, 32, 64) for bk in (64, 128, 256) for st in (None, 2, 4)]


# prefill-sized rows (a 2,048-token chunk: 8,192 pairs, ~512 an expert on the benchmark model): (block_m, block_n,
# block_k, warps, stages); the tile is then fixed for every prefill size in block_sizes (rows > 64)
PREFILL_MOE_TILES = [(bm, bn, bk, w, st) for bm, bn in ((64, 64), (64, 128), (128, 64), (128, 128))
                     for bk in (32, 64) for w in (4, 8) for st in (2, 3, 4)]
PREFILL_MOE_ROWS = (2048, 8192)
# the down kernel's own (block_n, block_k, warps, stages) at prefill rows, beside the shared tile (with the shared tile the
# down kernel runs at ~36% of the matmul rate, 61.7 us a layer, its 128 x 64 output tiles re-reading each pair's
# activations from L2 for each of 32 column tiles)
# H200, rows 2,048 / 8,192: 243.1 / 632.7, 244.2 / 618.4 (256 x 64 s3: moe_grouped.PREFILL_DOWN_TILE), 256.6 / -,
# 259.1 / - us, against the shared tile's 250.9 / 671.2; (64, 64, 8, None) is that shared tile
PREFILL_MOE_DOWN_TILES = [(64, 64, 8, None), (128, 64, 8, None), (256, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3)]


def moe_rows(rows: int, gate_up: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(x [rows, H], top_i, top_w, the bytes of the chosen experts' weights, read once) for a routed-MoE timing."""
    experts, two_inter, hidden = gate_up.shape
    x = torch.randn(rows, hidden, device=DEV, dtype=BF16)
    top_w, top_i = torch.topk(torch.randn(rows, experts, device=DEV).softmax(-1), top_k, dim=-1)
    chosen = len(set(top_i.flatten().tolist()))
    return x, top_i, top_w.to(BF16), chosen * 3 * (two_inter // 2) * hidden * 2


def bench_moe(cfg: dict) -> None:
    from atlas_kernels.moe_grouped import block_sizes, moe_grouped

    gate_up, down, top_k = moe_weights(cfg)
    for rows in BATCHES:
        x, top_i, top_w, moved = moe_rows(rows, gate_up, top_k)
        want = moe_grouped(x, top_i, top_w, gate_up, down)
        default = block_sizes(rows)
        best = None
        for bm, bn, bk, st in MOE_TILES:
            def step(bm=bm, bn=bn, bk=bk, st=st, x=x, top_i=top_i, top_w=top_w) -> None:
                moe_grouped(x, top_i, top_w, gate_up, down, blocks=(bm, bn, bk), stages=st)
            try:
                got = moe_grouped(x, top_i, top_w, gate_up, down, blocks=(bm, bn, bk), stages=st)
                err = float((got.float() - want.float()).norm() / want.float().norm())
                ms = time_ms(step)
            except Exception as error:  # a tile that does not compile (registers, shared memory)
                print(f"# moe tile {(bm, bn, bk, st)} failed: {type(error).__name__}: {str(error)[:120]}")
                continue
            mark = " (block_sizes today)" if (bm, bn, bk) == default and st is None else ""
            record("moe_grouped", f"rows {rows}, tile {bm}x{bn}x{bk} stages {st}", ms, bytes_moved=moved,
                   note=f"rel err vs today {err:.1e}{mark}")
            if best is None or ms < best[0]:
                best = (ms, (bm, bn, bk, st))
        if best is not None:
            print(f"# moe rows {rows}: best tile {best[1]} {best[0] * 1e3:.1f} us", flush=True)


# the decode MoE's two kernels swept apart (block_m 16 and the gate-up's block_k fixed per batch bucket; block_n, warps
# and stages only tile columns and schedule loads): the H200's b1 profile has the gate-up at 12.0 us a layer for
# ~4 us of bytes (4 of 16 experts: 64-column tiles leave 32 programs with work on 132 SMs) and the down at 6.1 us
MOE_DECODE_GATE_TILES = [(bn, bk, w, st) for bn in (16, 32, 64) for bk in (128, 256) for w in (2, 4)
                         for st in (None, 4)]
MOE_DECODE_DOWN_TILES = [(bn, bk, w, None) for bn in (16, 32, 64, 128) for bk in (64, 128) for w in (2, 4)]
MOE_DECODE_ROWS = (1, 4, 16, 64)
HYPER_DECODE_ROWS = (1, 4, 16, 64)


def bench_moe_decode(cfg: dict, sweep: bool = True) -> None:
    """The routed experts at decode rows: today's moe_grouped call and (sweep) the grouped call with the gate-up's
    tile (block_n, block_k, warps, stages) and the down's swept apart
    (the other kernel on today's tile). Each whole call graph-timed (routing, both kernels, the slot sum), so a row's
    difference from today's is its kernels'. H200: the sweep moves rows 1 / 16 / 64 by at most 1.3 /
    1.1 / 1.4 us of 30.0 / 48.8 / 75.7."""
    from atlas_kernels.moe_grouped import block_sizes, moe_grouped, num_warps

    gate_up, down, top_k = moe_weights(cfg)
    for rows in MOE_DECODE_ROWS:
        x, top_i, top_w, moved = moe_rows(rows, gate_up, top_k)
        want = moe_grouped(x, top_i, top_w, gate_up, down)
        bm, bn0, bk0 = block_sizes(rows)
        cases = [("today", {})]
        cases += [(f"gate-up {bn}x{bk} w{w} s{st}", dict(blocks=(bm, bn, bk), warps=w, stages=st, down_tile=()))
                  for bn, bk, w, st in (MOE_DECODE_GATE_TILES if sweep else [])]
        cases += [(f"down {bn}x{bk} w{w} s{st}", dict(down_tile=(bn, bk, w, st))) for bn, bk, w, st in
                  (MOE_DECODE_DOWN_TILES if sweep else [])]
        best: dict[str, tuple[float, str]] = {}
        for name, knobs in cases:
            if name.startswith("gate-up"):  # the down kernel on today's tile
                knobs = dict(knobs, down_tile=(bn0, bk0, num_warps(bm), None))
            call = moe_grouped

            def step(knobs=knobs, x=x, top_i=top_i, top_w=top_w, call=call) -> None:
                call(x, top_i, top_w, gate_up, down, **knobs)
            try:
                got = call(x, top_i, top_w, gate_up, down, **knobs)
                err = float((got.float() - want.float()).norm() / want.float().norm())
                ms = time_ms(step)
            except Exception as error:
                print(f"# moe decode {name} failed: {type(error).__name__}: {str(error)[:120]}")
                continue
            record("moe_decode", f"rows {rows}, {name}", ms, bytes_moved=moved, note=f"rel err vs today {err:.1e}")
            kind = name.split(" ")[0]
            if kind not in best or ms < best[kind][0]:
                best[kind] = (ms, name)
        print(f"# moe decode rows {rows}: " + "; ".join(f"{k} best {n} {m * 1e3:.1f} us" for k, (m, n) in best.items()),
              flush=True)


def bench_hyper_decode(cfg: dict, sweep: bool = True) -> None:
    """A hyper site (norm, mix-down, silu, mix-up, sigmoid, mix, mean, injection) at decode rows: compiled as the decode
    regions compile it (combo kernels; products through cuBLAS, or as Inductor reductions with split K, the b1-4
    form), and cuBLAS's two products alone. The H200's b64
    profile: ~16 us a site (cuBLAS's split-K mix-down 5.7 us + its reduce 2.2, the mix-up 4.9) for 10.5 MB of weights."""
    from atlas.backends.cuda.hyper import hyper_block

    hidden, hc, lowrank, eps = cfg["hidden_size"], cfg["hc_count"], cfg["hc_lowrank"], cfg["rms_norm_eps"]
    width = hc * hidden
    norm_w = 1 + 0.1 * torch.randn(width, device=DEV, dtype=BF16)
    down_w = torch.randn(lowrank + hc, width, device=DEV, dtype=BF16) / width**0.5
    up_w = torch.randn(width, lowrank, device=DEV, dtype=BF16) / lowrank**0.5
    moved = (down_w.numel() + up_w.numel()) * 2
    for rows in HYPER_DECODE_ROWS:
        streams = torch.randn(rows, width, device=DEV, dtype=BF16)
        forms = {}
        for gemv in ("", "split") if sweep else ():  # without sweep: cuBLAS's products only
            def site(s: torch.Tensor, gemv=gemv) -> tuple[torch.Tensor, torch.Tensor | None]:
                return hyper_block(s, norm_w, down_w, up_w, hc, hidden, lowrank, eps, True, gemv)
            forms[f"compiled {gemv or 'cublas'}"] = torch.compile(site, options={"combo_kernels": True},
                                                                  dynamic=False, fullgraph=True)
        want = hyper_block(streams.double(), norm_w.double(), down_w.double(), up_w.double(), hc, hidden, lowrank, eps,
                           True)[0]
        for name, fn in forms.items():
            try:
                got = fn(streams)[0]
                err = float((got.double() - want).norm() / want.norm())
                record("hyper_decode", f"rows {rows}, {name}", time_ms(lambda fn=fn, s=streams: fn(s)),
                       bytes_moved=moved, note=f"rel err vs float64 {err:.1e}")
            except Exception as error:
                print(f"# hyper decode {name} failed: {type(error).__name__}: {str(error)[:160]}")
        normed = torch.randn(rows, width, device=DEV, dtype=BF16)
        act = torch.randn(rows, lowrank + 8, device=DEV, dtype=BF16)[:, :lowrank]
        record("hyper_decode", f"rows {rows}, cuBLAS mix-down alone", time_ms(lambda n=normed: n @ down_w.T),
               bytes_moved=down_w.numel() * 2)
        record("hyper_decode", f"rows {rows}, cuBLAS mix-up alone", time_ms(lambda a=act: a @ up_w.T),
               bytes_moved=up_w.numel() * 2)


def bench_site_gemms(cfg: dict) -> None:
    """A prefill hyper site's two skinny products alone, at the shapes the model runs and at padded or re-laid-out
    ones, so the next change to the site's weights (their alignment rows, their layout) is chosen by measurement.
    The H200's profile (2,048 tokens): the mix-down 24-27 us and the mix-up 24-27 us a site, ~400 TFLOP/s, 49 sites;
    both products are 11 GFLOP (14 us at 788 TFLOP/s). The mix-down's 328 output columns (320 + 4 inject + 4 alignment
    rows) make 48 output tiles of 128 x 128 at 2,048 rows on 132 SMs; the mix-up writes a [T, 8,192] product of K 320.
    Forms: the mix-down as F.linear against the [N, K] weight (today's), against a [K, N] copy, and per stream over
    the raw streams (a batched product over a strided [hc, T, H] view, the raw-stream site's form); the mix-up with
    its activations a 320-column slice of the mix-down's output (today's), contiguous, or K padded with zero
    weight columns to 328 (every column of the mix-down's output) or 384."""
    hidden, hc, lowrank = cfg["hidden_size"], cfg["hc_count"], cfg["hc_lowrank"]
    width = hc * hidden
    for tokens in (PREFILL_TOKENS, 4 * PREFILL_TOKENS):
        x = torch.randn(tokens, width, device=DEV, dtype=BF16)
        for n_out in (328, 336, 384):
            w = torch.randn(n_out, width, device=DEV, dtype=BF16) / width**0.5
            flops = 2 * tokens * width * n_out
            moved = (x.numel() + w.numel() + tokens * n_out) * 2
            record("site_gemm", f"[{tokens}] mix-down N {n_out} linear", time_ms(lambda x=x, w=w: F.linear(x, w)),
                   bytes_moved=moved, flops=flops)
            wt = w.T.contiguous()
            record("site_gemm", f"[{tokens}] mix-down N {n_out} x @ [K, N]", time_ms(lambda x=x, wt=wt: x @ wt),
                   bytes_moved=moved, flops=flops)
            ws = w.view(n_out, hc, hidden).permute(1, 2, 0).contiguous()  # [hc, H, N]
            xs = x.view(tokens, hc, hidden).transpose(0, 1)  # [hc, T, H], a strided view (no copy)
            record("site_gemm", f"[{tokens}] mix-down N {n_out} per stream (bmm)",
                   time_ms(lambda xs=xs, ws=ws: torch.bmm(xs, ws)), bytes_moved=moved, flops=flops)
        wide = torch.randn(tokens, 384, device=DEV, dtype=BF16)
        for k, name, act in ((lowrank, "a 320-column slice of 328 (today)", wide[:, :328][:, :lowrank]),
                             (lowrank, "contiguous", wide[:, :lowrank].contiguous()),
                             (328, "K 328 (zero weight columns)", wide[:, :328].contiguous()),
                             (384, "K 384 (zero weight columns)", wide)):
            up = torch.randn(width, k, device=DEV, dtype=BF16) / k**0.5
            flops = 2 * tokens * lowrank * width
            moved = (act.numel() + up.numel() + tokens * width) * 2
            record("site_gemm", f"[{tokens}] mix-up {name}", time_ms(lambda a=act, up=up: F.linear(a, up)),
                   bytes_moved=moved, flops=flops)


def moe_weights(cfg: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    experts = cfg["num_experts"]
    gate_up = torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=BF16) / hidden**0.5
    down = torch.randn(experts, hidden, inter, device=DEV, dtype=BF16) / inter**0.5
    return gate_up, down, cfg["num_experts_per_tok"]


def bench_moe_prefill(gate_up: torch.Tensor, down: torch.Tensor, top_k: int, sweep: bool = True) -> None:
    """The grouped kernels at prefill rows over PREFILL_MOE_TILES (tile, warps, pipeline depth; only today's
    block_sizes / num_warps without `sweep`); the whole call (routing, both GEMMs, the slot sum) graph-timed."""
    from atlas_kernels.moe_grouped import block_sizes, moe_grouped, num_warps

    experts, two_inter, hidden = gate_up.shape
    flops_per_pair = 2 * hidden * (two_inter + two_inter // 2)  # gate-up then down, 2 FLOPs a multiply-add
    for rows in PREFILL_MOE_ROWS:
        x = torch.randn(rows, hidden, device=DEV, dtype=BF16)
        top_w, top_i = torch.topk(torch.randn(rows, experts, device=DEV).softmax(-1), top_k, dim=-1)
        top_w = top_w.to(BF16)
        want = moe_grouped(x, top_i, top_w, gate_up, down)
        bm0, bn0, bk0 = block_sizes(rows)
        today = (bm0, bn0, bk0, num_warps(bm0), None)
        timed = []
        for tile in [today, *(PREFILL_MOE_TILES if sweep else [])]:
            bm, bn, bk, w, st = tile
            # today's row is the default call (its down kernel on PREFILL_DOWN_TILE); a named tile is both kernels'
            knobs = {} if tile == today else dict(blocks=(bm, bn, bk), stages=st, warps=w)

            def step(knobs=knobs, x=x, top_i=top_i, top_w=top_w) -> None:
                moe_grouped(x, top_i, top_w, gate_up, down, **knobs)
            try:
                got = moe_grouped(x, top_i, top_w, gate_up, down, **knobs)
                err = float((got.float() - want.float()).norm() / want.float().norm())
                ms = time_ms(step)
            except Exception as error:  # a tile that does not compile (registers, shared memory)
                print(f"# moe prefill tile {tile} failed: {type(error).__name__}: {str(error)[:120]}")
                continue
            mark = " (today)" if tile == today else ""
            record("moe_grouped prefill", f"rows {rows}, tile {bm}x{bn}x{bk} warps {w} stages {st}", ms,
                   flops=rows * top_k * flops_per_pair, note=f"rel err vs today {err:.1e}{mark}")
            timed.append((ms, tile))
        for down_tile in PREFILL_MOE_DOWN_TILES:
            def down_step(down_tile=down_tile, x=x, top_i=top_i, top_w=top_w) -> None:
                moe_grouped(x, top_i, top_w, gate_up, down, down_tile=down_tile)
            try:
                got = moe_grouped(x, top_i, top_w, gate_up, down, down_tile=down_tile)
                err = float((got.float() - want.float()).norm() / want.float().norm())
                ms = time_ms(down_step)
            except Exception as error:
                print(f"# moe prefill down tile {down_tile} failed: {type(error).__name__}: {str(error)[:120]}")
                continue
            record("moe_grouped prefill", f"rows {rows}, today's gate-up, down {'x'.join(map(str, down_tile[:2]))} "
                   f"w{down_tile[2]} s{down_tile[3]}", ms, flops=rows * top_k * flops_per_pair,
                   note=f"rel err vs today {err:.1e}")
        timed.sort()
        print(f"# moe prefill rows {rows}: today {today} -> best {[(round(m * 1e3, 1), t) for m, t in timed[:4]]}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--only", default="",
                        help="comma-separated subset: gdn,conv,attn,qsa,norms,site_gemm,moe,moe_decode,hyper_decode,"
                             "moe_prefill,chunk")
    parser.add_argument("--fp32-chunk", action="store_true", help="also time the fp32 (parity) chunked prefill")
    parser.add_argument("--chunk-schedules", default="", metavar="TEXT",
                        help="chunk: only the GATED_CHUNK_SCHEDULES whose name holds TEXT (e.g. prepare=registers)")
    parser.add_argument("--decode-rows", default="", metavar="N,N",
                        help="the decode row counts of moe_decode and hyper_decode (default 1,4,16,64)")
    parser.add_argument("--no-sweep", action="store_true",
                        help="moe_prefill: today's tile only, not the tile sweep; chunk: the "
                             "backend's call only (its defaults and GATED_CHUNK_SCHEDULES)")
    parser.add_argument("--dry-run", "--smoke", action="store_true",
                        help="load the config and list what would be timed; no GPU needed")
    args = parser.parse_args()
    cfg = load_config(args.config)
    if args.decode_rows:
        global MOE_DECODE_ROWS, HYPER_DECODE_ROWS
        MOE_DECODE_ROWS = HYPER_DECODE_ROWS = tuple(int(n) for n in args.decode_rows.split(","))
    gdn_layers = cfg["layer_types"].count("linear_attention")
    attn_layers = len(cfg["layer_types"]) - gdn_layers
    groups = ("gdn", "conv", "attn", "qsa", "norms", "site_gemm", "moe", "moe_decode", "hyper_decode",
              "moe_prefill", "chunk")
    unknown = [name for name in args.only.split(",") if name and name not in groups]
    if unknown:
        parser.error(f"--only {','.join(unknown)}: not a kernel group; use some of {','.join(groups)}")
    if args.dry_run:
        chosen = [name for name in args.only.split(",") if name] or list(groups)
        print(f"dry run: {args.config.name}, {gdn_layers} GDN layers, {attn_layers} attention layers; would time "
              f"{', '.join(chosen)}")
        return
    if not torch.cuda.is_available():
        print(f"kernels.py needs a CUDA GPU and torch {torch.__version__} sees none; run it on the GPU machine "
              "(--dry-run checks the arguments and the config here)", file=sys.stderr)
        sys.exit(2)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{gdn_layers} GDN layers, {attn_layers} attention layers", flush=True)
    measure_ceilings()
    benches = {  # the slow-to-compile chunked prefill last
        "gdn": lambda: bench_gdn_recurrent(cfg, gdn_layers),
        "conv": lambda: bench_conv(cfg, gdn_layers),
        "attn": lambda: bench_attention(cfg, attn_layers),
        "qsa": lambda: bench_qsa(cfg, attn_layers),
        "norms": lambda: bench_norms(cfg),
        "site_gemm": lambda: bench_site_gemms(cfg),
        "moe": lambda: bench_moe(cfg),
        "moe_decode": lambda: bench_moe_decode(cfg, sweep=not args.no_sweep),
        "hyper_decode": lambda: bench_hyper_decode(cfg, sweep=not args.no_sweep),
        "moe_prefill": lambda: bench_moe_prefill(*moe_weights(cfg), sweep=not args.no_sweep),
        "chunk": lambda: bench_gdn_prefill(cfg, args.fp32_chunk, others=not args.no_sweep,
                                         schedules=args.chunk_schedules),
    }
    chosen = [name for name in args.only.split(",") if name] or list(benches)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        try:
            benches[name]()
        except Exception:
            print(f"# {name} failed:\n{traceback.format_exc()}", flush=True)
        torch.cuda.empty_cache()
        # after every group, so a run stopped at its time limit keeps what it measured
        (args.out / "kernels.json").write_text(json.dumps({"ceilings": CEILINGS, "results": results}, indent=1))


if __name__ == "__main__":
    main()
