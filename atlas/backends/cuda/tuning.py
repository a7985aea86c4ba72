"""The CUDA backend's performance knobs: which implementation each part of a step uses.

Every knob has a plain-torch setting (the reference arrangement, and the only one the fp32 parity mode and a
CPU without TRITON_INTERPRET run) and faster ones (Triton kernels, flash attention, torch.compile) that
the GPU benchmark times side by side (`VARIANTS`, `atlas bench gpu`), so the winners are chosen by
measurement. Nothing here changes what a step computes beyond rounding (each kernel is tested against the
torch path on random inputs).
"""

from __future__ import annotations

import attrs

MOE = ("torch", "triton", "small", "split", "grouped_mm")
PREFILL_MOE = ("grouped", "dense", "triton", "grouped_mm")
ATTENTION = ("torch", "sdpa")
DECODE_ATTENTION = (*ATTENTION, "paged")
HYPER = ("torch", "triton")
COMPILE = ("none", "default", "max-autotune-no-cudagraphs", "tuned", "combo", "tuned-combo", "combo-persistent",
           "combo-pdl")
STACK = ("layers", "regions")
CONV = ("windowed", "library", "inductor", "shifted", "triton")
GEMV = ("library", "reduce", "split")
PREFILL_GRAPHS = ("none", "recurring")
GDN_WORK = ("fp32", "bf16")
MIX_UP = ("inductor", "triton")
SITE = ("normed", "raw")
GDN_PREPARE = ("scratch", "registers")
DECODE_REGIONS = ("wide", "narrow")
PDL = ("off", "on")
DECODE_HYPER = ("inductor", "triton", "small")


def _one_of(options: tuple[str, ...]):  # type: ignore[no-untyped-def]
    def check(instance: object, attribute: attrs.Attribute, value: str) -> None:
        if value not in options:
            raise ValueError(f"Tuning.{attribute.name} must be one of {', '.join(options)}, got {value!r}")
    return check


@attrs.frozen
class Tuning:
    # MoE of decode groups (fixed shapes, CUDA-graph safe): "torch" gathers the chosen experts' weights (rows
    # x top_k < experts) or runs every expert on every row; "triton" routes on the device and runs grouped
    # GEMMs that read each chosen expert's weights once, in place (atlas_kernels.moe_grouped); "small": the same, but
    # groups of at most 4 rows through atlas_kernels.moe_small's GEMV-shaped kernels (H200 session 16 profile, b1: the
    # grouped kernels' 16-row tensor-core tiles 12.0 + 6.0 us a layer for ~6 us of bytes; a tile sweep moved them < 1 us;
    # session 17: slower, 36.3 against 29.8 us a call at one row); "split": the grouped kernels, the gate-up's hidden size
    # split in 4 at <= 4 rows (atlas_kernels.moe_grouped split_k: 4 x the programs, 128 with work at one row instead of
    # 32 on 132 SMs; the down kernel sums the fp32 partials in split order); session 18: slower (b1 3.18 against
    # 2.74 ms; in the b1 profile the split gate-up 13.6 against 12.2 us a layer, the summing down kernel 23.5 against 6.0);
    # "grouped_mm": torch._grouped_mm (CUTLASS grouped GEMMs) over the pairs in the order the tail region ranks them
    # (moe.routed_grouped_mm, the prefill's "grouped_mm" path), never measured at decode rows: session 19 (no device
    # time) added it for the b1 experts' 12 + 6 us a layer against ~6 us of bytes, which no Triton form closed
    moe: str = attrs.field(default="torch", validator=_one_of(MOE))
    # MoE of prefill chunks (eager): "grouped" by expert with one host sync a layer, "dense" every expert on
    # every token (no sync, top_k / experts of its FLOPs useful), "triton" the device-routed grouped kernels
    # (no sync), "grouped_mm" torch._grouped_mm over expert-sorted rows (no sync; where torch has it)
    prefill_moe: str = attrs.field(default="grouped", validator=_one_of(PREFILL_MOE))
    # prefill attention: "torch" materialised fp32 scores, "sdpa" F.scaled_dot_product_attention (flash or
    # memory-efficient kernels; the causal / QSA mask passed as a boolean mask where one is needed)
    attention: str = attrs.field(default="torch", validator=_one_of(ATTENTION))
    # decode attention (T = 1, inside the decode graphs): the same two choices, or "paged": the split-K Triton
    # kernel over the KV pools in place (atlas_kernels.paged_attention: fixed 256-key partitions merged in a fixed
    # order), no gather of the keys, no copy to the query heads, no mask; dense groups only (QSA-selected groups
    # take sdpa). H200, session 7: sdpa's path was ~100 us a layer at batch 64 (cuDNN 53 us + the keys' gather
    # and head copy 45 us), the kernel 8-10 us at 256 keys (benchmarks/kernels.py --only attn)
    decode_attention: str = attrs.field(default="torch", validator=_one_of(DECODE_ATTENTION))
    # hyper-connection sites (decode and prefill): "torch" ~13 kernels a site, "triton" the four kernels of
    # atlas_kernels.hyper (per-stream norm; split-K mix-down; split sum + silu / injection sigmoid; mix-up +
    # sigmoid + mix + mean)
    hyper: str = attrs.field(default="torch", validator=_one_of(HYPER))
    # torch.compile of the decode step's hyper-connection sites and MoE router + shared expert (one compiled
    # graph per block kind, reused by every layer: atlas.backends.cuda.compiled), captured under the decode
    # CUDA graphs as before
    compile_decode: str = attrs.field(default="none", validator=_one_of(COMPILE))
    # the decode step's shape: "layers" the shared layer stack (atlas.backends.decoder, an op at a time);
    # "regions" cut at the state writes, each piece between two writes one function (atlas.backends.cuda.regions)
    # that compile_decode compiles once per region kind: one compiled graph per piece of a layer instead of per op
    decode_stack: str = attrs.field(default="layers", validator=_one_of(STACK))
    # the same for prefill chunks: "regions" runs them through the same region functions (their state writes,
    # GDN chunk kernel and routed experts eager between them), compiled by compile_prefill with symbolic sizes.
    # The eager layer stack launches ~2,600 kernels a 2,048-token prefill, host-bound ~12 ms over its device
    # time, with ~15 ms of unfused elementwise passes over the [T, hc * H] streams (H200, session 6). H200, session
    # 8 (after session 7's ConstraintViolationError was fixed by fullgraph=True, atlas.backends.cuda.compiled): a
    # 2,048-token prefill 67.5 -> 56.0 ms, 8,192 263.6 -> 174.7 ms, 32,752 1,362 -> 1,085 ms; in regions-compile
    prefill_stack: str = attrs.field(default="layers", validator=_one_of(STACK))
    compile_prefill: str = attrs.field(default="none", validator=_one_of(COMPILE))
    # the causal convs of prefill chunks (bf16): "windowed" the reference's fp32 windowed product; "library"
    # depthwise F.conv1d (cuDNN), never in the batch-invariant modes (atlas.backends.cuda.layers.conv_step);
    # "inductor": library for the eager convs (PLE's, the layer stack's), the windowed product inside a compiled
    # prefill region's GDN head, which Inductor fuses with the cat and silu around it (H200 session 8: ATen's
    # depthwise kernel was 176 us a layer at 2,048 tokens, 3.5 ms of a 33.7 ms prefill; session 10: the prefill's device
    # time 34.2 -> 31.2 ms, 1,699 -> 1,663 kernels, wall 52.8 -> 51.0 ms; in regions-compile); "shifted": as
    # "inductor" but the compiled head's conv time-major, a sum of K shifted slices (no channel-major transpose of
    # the columns; session 11: time-major windows made Inductor materialise [T, C, K] fp32 products, +1.4 ms).
    # Measured slower (H200 session 11 run 3, as regions-compile + this: prefill 2,048 31.8 against 29.3 ms), so
    # not in regions-compile; kept as a tested knob (the channel-major transposes are still the conv's cost);
    # session 12, the PLE layer's conv compiled too: 28.8 against 27.9 ms. "triton": as "inductor" but the compiled
    # regions' convs (GDN heads, PLE) one time-major Triton kernel each on a CUDA device
    # (atlas_kernels.conv.causal_conv_prefill, a custom op: it reads the projection's output in place)
    prefill_conv: str = attrs.field(default="windowed", validator=_one_of(CONV))
    # the small products of compiled decode regions of at most regions.GEMV_ROWS rows (the hyper sites' mix-down and
    # mix-up, the MoE router + shared expert in and down): "library" cuBLAS GEMVs; "reduce" a broadcast multiply
    # and fp32 sum (layers.linear) that Inductor lowers to reduction kernels fused with their neighbours. H200,
    # session 8, batch 1: 199 GEMVs 1.52 ms of a 3.2 ms device step, the sites' 5 MB ones 4-7 us each (+ a 1.7 us
    # split-K reduce) against ~1.3 us of bytes; "split" the same with a long K's sum cut into chunks (layers.linear:
    # the mix-down's 328 outputs of 8,192 inputs were one 7-8 us reduction of 328 programs; H200 session 10: b1 3.47 ->
    # 3.30 ms a step, 1,039 -> 1,088 kernels, device 2.8 ms both; in regions-compile)
    decode_gemv: str = attrs.field(default="library", validator=_one_of(GEMV))
    # prefill chunks replayed from CUDA graphs: "none"; "recurring": every prefill chunk's key blocks rounded up to a
    # power of two (as the decode graphs' are), and a chunk shape (width, key blocks, QSA selection) captured the
    # second time it is fed, at most runner.PREFILL_GRAPHS shapes, replayed from then on (a full chunk of a long
    # prompt, a benchmark's repeated prompt). Written for the host's launch overhead (H200 session 8: a 2,048-token
    # prefill through compiled regions 56.0 ms wall over 33.7 ms of device work in ~1,700 kernels; Inductor's Triton
    # launches ~10-16 us of host each); needs prefill_moe other than "grouped" (no host sync). H200 session 10: 2,048
    # tokens 52.8 -> 41.7 ms (execute 40.7 ms over an eager device time of 34.2), 8,192 tokens 161.0 -> 157.2 ms
    # (benchmarks/prefill_runs.py; the capture, the second feed, 490 ms); in regions-compile
    prefill_graphs: str = attrs.field(default="none", validator=_one_of(PREFILL_GRAPHS))
    # the GDN chunk prefill kernel's intermediates (w, u, p) and its scan's product operands for bf16 activations
    # (atlas_kernels.gdn_chunk_split.WORK): "fp32" (tf32 products), "bf16" (bf16 products at twice the tensor rate,
    # half the intermediates' bytes; the state stays fp32). CPU interpreter, 150 tokens: output error against the
    # fp32 reference 3.3e-3 against 1.7e-3 (the output's own bf16 rounding), the state 2.8e-3 against 3e-7
    gdn_work: str = attrs.field(default="fp32", validator=_one_of(GDN_WORK))
    # the hyper sites' mix after the mix-down in compiled prefill regions (bf16 / fp16 streams): "inductor" the torch
    # form (cuBLAS's mix-up product [T, hc * H] written, then read back with the normed streams by Inductor's mix and
    # mean), "triton" one kernel (atlas_kernels.hyper.mix_up, a custom op) that keeps the product in registers: two
    # passes of 32 MB a site fewer at 2,048 tokens, 49 sites
    prefill_mix_up: str = attrs.field(default="inductor", validator=_one_of(MIX_UP))
    # the hyper sites' mix-down in prefill chunks through the regions (prefill_stack "regions"; decode groups and the
    # layer stack keep "normed"): "normed" the normed streams [T, hc * H] written by the per-stream norm for cuBLAS's
    # mix-down GEMM, then read again by the mix (H200, 2,048 tokens: 33.5 MB written a site, the rms_norm_mul_view
    # kernel ~26 us, 49 sites); "raw" the mix-down on the raw streams as one batched product over a [hc, T, H] view
    # against the mix-down weight folded with the norm weight at load (layers.raw_mix_down; hc x 328 x 2,048 more
    # weight a site, 5.4 MB in bf16, 263 MB for 49 sites), the hc products weighted by the fp32 rstd per row and
    # summed, and the normed streams recomputed elementwise inside the mix, so never written. Predicted ~8 us a site,
    # ~0.4 ms a 2,048-token prefill; bf16 rounds differently (each stream's product rounded before rstd scales it).
    # With prefill_mix_up "triton" the mix kernel reads the normed streams, so they are written for it: no saving.
    # Unmeasured on the GPU: written in session 19 without device time
    prefill_site: str = attrs.field(default="normed", validator=_one_of(SITE))
    # the GDN chunk prefill's chunk-local kernel for bf16 activations (atlas_kernels.gdn_chunk_split, prepare=):
    # "scratch" the WY inverse by 16 x 16 blocks through global scratch rows with barriers; "registers" the blocks
    # computed from k's 16-row blocks and inverted in registers, its products in the work dtype and p stored in it
    # (H200 session 15: the chunk call 221.9 -> 146.5 us a 2,048-token layer with bf16 work; in regions-compile)
    gdn_prepare: str = attrs.field(default="scratch", validator=_one_of(GDN_PREPARE))
    # programmatic dependent launch for our own Triton kernels in decode groups (atlas_kernels.pdl; prefill chunks and
    # verifies keep it off): "on" launches the GDN update, the paged attention's partition and merge and the routed
    # experts' gate-up and down with the programmatic-stream-serialization attribute on sm_90+, each waiting
    # (griddepcontrol.wait) before its first global load or store and then letting the next kernel launch, so a
    # kernel's launch and prologue overlap the tail of the one before it (a b1 decode step is ~840 kernels of ~2-3 us
    # on the H200). compile_decode "combo-pdl" does the same for Inductor's kernels. Session 16, unmeasured
    decode_pdl: str = attrs.field(default="off", validator=_one_of(PDL))

    # where compiled decode regions are cut (decode_stack "regions" with compile_decode other than "none"): "wide" (session
    # 16) also runs the PLE layers, the step's prologue (embedded streams, rotary table, the PLE n-gram ids) and the
    # group's columns (batch.group_columns) as compiled regions: a b1 step's launches outside the regions 232 -> 104
    # (benchmarks/dispatch_count.py --regions-as-calls); "narrow" runs those eagerly (session 15's cut, for the A/B).
    # Eager regions (compile "none") compute the same either way
    decode_regions: str = attrs.field(default="wide", validator=_one_of(DECODE_REGIONS))
    # the hyper-connection sites of decode groups through the regions (decode_stack "regions"): "inductor" the torch form
    # (hyper_block) as the region's compile lowers it (cuBLAS's products, or Inductor's reductions at <= GEMV_ROWS
    # rows); "triton" each site as atlas_kernels.hyper.hyper_site's four kernels (a custom op: per-stream norm,
    # split-K mix-down over 176 programs, the split sum + silu / injection sigmoid, the mix-up + sigmoid + mix +
    # mean), the final mixer's too. H200 session 16 profiles: a site ~16 us at b64 (cuBLAS's split-K mix-down 5.7 us
    # + its reduce 2.2, the mix-up 4.9, Inductor's norm and mix) and ~12 us at b1, for 10.5 MB of weights (2.5 us).
    # H200 session 17 run 1: slower (b1 / b16 / b64 3.59 / 5.26 / 7.12 against 2.96 / 4.57 / 6.51 ms; a site alone at 1 /
    # 64 rows 19.5 / 26.9 us against the compiled torch form's 14.1 / 20.6). "small": groups of at most 4 rows take
    # atlas_kernels.hyper_small's two GEMV-shaped kernels (no 64-row tensor-core tiles; the norm folded into both),
    # larger ones the torch form
    decode_hyper: str = attrs.field(default="inductor", validator=_one_of(DECODE_HYPER))

    def __attrs_post_init__(self) -> None:
        if self.prefill_graphs != "none" and self.prefill_moe == "grouped":
            raise ValueError(f"Tuning.prefill_graphs {self.prefill_graphs!r} captures prefill chunks in CUDA graphs, "
                             "and prefill_moe 'grouped' syncs with the host every layer: use triton, dense or "
                             "grouped_mm")

    @property
    def uses_triton(self) -> bool:
        return (self.moe in ("triton", "small", "split", "grouped_mm") or self.prefill_moe == "triton" or self.hyper == "triton"
                or self.decode_attention == "paged" or self.prefill_mix_up == "triton" or self.decode_hyper != "inductor")


# regions-compile's knobs (see its entry below), the arrangement its neighbours in VARIANTS change one knob of
_REGIONS = Tuning(moe="triton", prefill_moe="triton", attention="sdpa", decode_attention="paged", compile_decode="combo",
                  decode_stack="regions", prefill_conv="triton", prefill_stack="regions", compile_prefill="combo",
                  decode_gemv="split", prefill_graphs="recurring", gdn_work="bf16", gdn_prepare="registers")

# the variants `atlas bench gpu` times side by side (name -> knobs), each predicted in docs/BENCHMARKS.md;
# "baseline" is the arrangement measured before (H200 run 2: decode b1 5.83 ms, prefill 2048 92.7 ms dense)
VARIANTS: dict[str, Tuning] = {
    # in measuring order: the baseline, then the predicted winner, then the single changes that explain it (a
    # timeout cuts the tail), the compiled variant last (its compile time must not starve the others)
    "baseline": Tuning(),
    "fused": Tuning(moe="triton", prefill_moe="triton", attention="sdpa", decode_attention="sdpa", hyper="triton"),
    # the fused arrangement with the torch hyper-connection sites: whether the split-K hyper kernels (session 3)
    # now win inside it (run 3, before them: fused lost to moe-triton at decode, 10.56 vs 7.80 ms at batch 1)
    "fused-hyper-torch": Tuning(moe="triton", prefill_moe="triton", attention="sdpa", decode_attention="sdpa"),
    "hyper-triton": Tuning(hyper="triton"),
    "moe-triton": Tuning(moe="triton", prefill_moe="triton"),
    "sdpa": Tuning(attention="sdpa", decode_attention="sdpa"),
    "moe-grouped-mm": Tuning(moe="triton", prefill_moe="grouped_mm"),
    "dense-prefill": Tuning(prefill_moe="dense"),  # run 2's faster prefill (92.7 ms); decodes as the baseline
    # the compiled hyper_block stands in for the hyper kernels here, so the two ways of fusing a site compare
    "fused-compile": Tuning(moe="triton", prefill_moe="triton", attention="sdpa", decode_attention="sdpa",
                            compile_decode="default"),
    # the decode step as compiled regions (session 4): a layer is ~4 compiled pieces + its state writes, the
    # GDN kernel and the routed experts (dispatch count on the CPU: see docs/BENCHMARKS.md, session 4)
    # the prefill chunks through the same compiled regions since session 8 (the "regions-prefill" variant of session
    # 7 won: 56.0 against 67.5 ms at 2,048 tokens, see the prefill_stack knob), batch 1-4's small products as
    # Inductor reductions with a long K's sum split (decode_gemv "split"), the compiled prefill regions' convs as
    # one time-major Triton kernel each (prefill_conv "triton", since session 12; "inductor" before), and recurring
    # prefill chunks replayed from CUDA graphs (prefill_graphs).
    # H200 session 10 against session 8's arrangement: decode b1 3.47 -> 3.30 ms, b16 4.89 -> 4.80, b64 6.91 ->
    # 6.78; prefill 2,048 52.8 -> 41.7 ms (graphs; 65.9 -> 43.4 ms on a slower host), 8,192 161.0 -> 157.2 ms.
    # Since session 14 the regions compile with Inductor's combo kernels and the GDN chunk prefill runs bf16 work
    # (regions-no-combo, regions-gdn-fp32 keep the previous; H200 session 14 run 3: decode 3.36 / 4.52 / 6.41 ms,
    # prefill 2,048 24.7 ms, 33.3% of the matmul rate); since session 15 the chunk prefill's registers prepare
    # (regions-prepare-scratch keeps the previous)
    "regions-compile": _REGIONS,
    # regions-compile with its prefill chunks eager (what prefill_graphs replaced; its decode rows are regions-compile's)
    "regions-eager-prefill": attrs.evolve(_REGIONS, prefill_graphs="none"),
    # regions-compile with the prefill's routed experts through torch._grouped_mm (cuBLAS / CUTLASS grouped GEMMs).
    # H200 session 12: prefill 2,048 31.7 against 28.8 ms; the routed call alone (benchmarks/kernels.py --only
    # moe_prefill) 375.6 against the Triton kernels' 253.0 us at 2,048 rows, 1,023 against 677 us at 8,192
    "regions-grouped-mm": attrs.evolve(_REGIONS, prefill_moe="grouped_mm"),
    # regions-compile with the compiled prefill heads' convs (GDN and PLE) as time-major shifted slices
    # (prefill_conv "shifted"; session 11: 31.8 against 29.3 ms, before the PLE layer was a compiled region)
    "regions-conv-shifted": attrs.evolve(_REGIONS, prefill_conv="shifted"),
    # regions-compile with those convs as Inductor fuses the channel-major windowed product (prefill_conv
    # "inductor", regions-compile's before session 12's run 4: prefill 2,048 29.6 against 27.5 ms with the Triton conv,
    # the same run, a slower H200 than runs 1-4: 727 TFLOP/s measured against 777)
    "regions-conv-inductor": attrs.evolve(_REGIONS, prefill_conv="inductor"),
    # regions-compile's compiled regions under Inductor's options (atlas.backends.cuda.compiled.INDUCTOR_OPTIONS), session 14: each
    # generated kernel's launch tuned by coordinate descent at compile time ("tuned"; the b1 decode's ~900 Inductor
    # launches average ~2.2 us), independent kernels of a region fused into one launch ("combo"), and the prefill
    # regions under max-autotune (Triton GEMM templates timed against cuBLAS, epilogues fused into the GEMMs: the
    # prefill's ~4.5 ms of Inductor passes over the streams sit around its GEMMs)
    # H200 session 14 run 2 (760 TFLOP/s GPU), against "default" in the same run: combo decode b1 3.60 -> 3.23 ms,
    # b16 5.24 -> 4.94, b64 7.39 -> 7.09, kernels 1,089 -> 885 (b1) and 1,419 -> 1,225 (prefill), prefill 2,048
    # 26.7 -> 26.4 ms; in regions-compile since. "tuned": its compile did not finish within run 1's ~200 s left
    # (a compile-time search per generated kernel and shape), so it is unmeasured
    "regions-tuned": attrs.evolve(_REGIONS, compile_decode="tuned", compile_prefill="tuned"),
    "regions-no-combo": attrs.evolve(_REGIONS, compile_decode="default", compile_prefill="default"),
    # regions-compile with inner reductions of up to 2,048 elements persistent (compiled.PERSISTENT_INNER, session 15,
    # unmeasured): a hyper site's per-stream norm one kernel instead of a looped reduction and a pointwise pass
    "regions-persistent": attrs.evolve(_REGIONS, compile_decode="combo-persistent", compile_prefill="combo-persistent"),
    # regions-compile with Inductor's kernels launched with programmatic dependent launch (compile mode "combo-pdl",
    # session 16): each generated kernel's launch and prologue overlap the tail of the one before it, for the b1
    # decode's ~700 Inductor kernels of ~2.7 us (atlas.backends.cuda.compiled). H200 session 16 run 2: no gain (b1 /
    # b64 3.12 / 5.95 ms measured first; with regions-pdl-kernels 2.79 / 5.89, regions-compile 2.79 / 5.87 in run 1)
    "regions-pdl": attrs.evolve(_REGIONS, compile_decode="combo-pdl", compile_prefill="combo-pdl"),
    # regions-pdl with our own decode kernels launched with programmatic dependent launch too (decode_pdl "on",
    # session 16; H200 run 2: b1 / b64 2.79 / 5.89 ms, within regions-compile's spread: no gain): the GDN update, paged attention and routed experts between the Inductor kernels, so
    # the chain of early launches is not broken at each of them
    "regions-pdl-kernels": attrs.evolve(_REGIONS, compile_decode="combo-pdl", compile_prefill="combo-pdl",
                                        decode_pdl="on"),
    # regions-compile with session 15's narrower decode cut (decode_regions "narrow": the PLE layers, the prologue and the
    # group's columns eager; H200 session 16 run 1: b1 2.94 against the wide cut's 2.79 ms, b64 6.10 against 5.87,
    # kernels b1 842 against 733)
    "regions-narrow": attrs.evolve(_REGIONS, decode_regions="narrow"),
    # regions-compile with each decode hyper site as atlas_kernels.hyper's four kernels (decode_hyper "triton", session
    # 17): a site's two 5 MB products over 176 / 64 programs at every batch, instead of cuBLAS's skinny GEMMs (b16 / b64)
    # or Inductor's reductions (b1-4)
    "regions-hyper-site": attrs.evolve(_REGIONS, decode_hyper="triton"),
    # regions-compile with the sites of decode groups of at most 4 rows as atlas_kernels.hyper_small's two kernels
    # (session 17: the first kernels with both small forms, variant regions-small, decoded b1 in 5.51 against 3.07 ms;
    # the unrolled site alone 9.3 us at one row against the compiled torch form's 13.0-14.1; session 18, in the model:
    # 13.2 us a site, b1 / b4 2.91 / 4.42 against regions-compile's 2.74 / 3.84 ms: slower)
    "regions-hyper-small": attrs.evolve(_REGIONS, decode_hyper="small"),
    # regions-compile with the routed experts of decode groups of at most 4 rows as atlas_kernels.moe_small's kernels
    # (session 17 run 3, alone: slower than moe_grouped at 1 and 4 rows, 36.3 / 84.3 against 29.8 / 40.9 us a call)
    "regions-moe-small": attrs.evolve(_REGIONS, moe="small"),
    # regions-compile with the routed experts' gate-up split four ways at <= 4 rows (moe "split", session 17; session 18:
    # b1 / b4 3.18 / 5.18 against 2.74 / 3.84 ms, slower)
    "regions-moe-split": attrs.evolve(_REGIONS, moe="split"),
    # both session-17 small-row forms together (the gate-up split and hyper_small's sites), so that one run measures
    # the pair as well as each alone (session 18: b1 / b4 3.12 / 5.45 against regions-compile's 2.74 / 3.84 ms)
    "regions-split-small": attrs.evolve(_REGIONS, moe="split", decode_hyper="small"),
    # regions-compile with the decode groups' routed experts through torch._grouped_mm (moe "grouped_mm", session 19,
    # unmeasured; regions-grouped-mm is the prefill's)
    "regions-moe-grouped-mm": attrs.evolve(_REGIONS, moe="grouped_mm"),
    # regions-compile with the GDN chunk prefill's intermediates and scan products in fp32 / tf32 (what gdn_work
    # "bf16" replaced in session 14: the backend's chunk call 322.5 -> 221.8 us a 2,048-token layer; H200 run 1,
    # with 2 scan stages, prefill 2,048 27.6 -> 26.9 ms)
    "regions-gdn-fp32": attrs.evolve(_REGIONS, gdn_work="fp32"),
    # regions-compile with the GDN chunk prefill's scratch prepare (what gdn_prepare "registers" replaced in session 15:
    # the backend's chunk call 221.9 -> 146.5 us a 2,048-token layer, the prepare kernel 137.6 -> 78.8 us in the
    # model; H200 run 2, 4 prepare warps, measured first: prefill 2,048 execute 23.3 against 23.9 ms)
    "regions-prepare-scratch": attrs.evolve(_REGIONS, gdn_prepare="scratch"),
    "regions-autotune-prefill": attrs.evolve(_REGIONS, compile_prefill="max-autotune-no-cudagraphs"),
    # regions-compile with the prefill's hyper-site mix as one Triton kernel (prefill_mix_up "triton", session 15)
    "regions-mix-up": attrs.evolve(_REGIONS, prefill_mix_up="triton"),
    # regions-compile with the prefill's hyper-site mix-down on the raw streams (prefill_site "raw", session 19,
    # unmeasured): the normed streams' write (33.5 MB a site at 2,048 tokens) saved, ~0.4 ms predicted a 2,048 prefill
    "regions-raw-site": attrs.evolve(_REGIONS, prefill_site="raw"),
    # regions-compile with cuBLAS's GEMVs at batch 1-4 (what decode_gemv replaced)
    "regions-cublas": attrs.evolve(_REGIONS, decode_gemv="library"),
    # the same with Inductor's GEMM autotuning (Triton templates against cuBLAS, epilogues fused into the GEMM)
    "regions-autotune": Tuning(moe="triton", prefill_moe="triton", attention="sdpa", decode_attention="sdpa",
                               compile_decode="max-autotune-no-cudagraphs", decode_stack="regions",
                               prefill_conv="library"),
}
