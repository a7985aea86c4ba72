"""The decode step and prefill chunks as compiled regions (Tuning.regions, Tuning.compile): each layer's pure math between its
state writes, one torch.compile'd function per region kind, reused by every layer.

A decode step is launch-bound (H200: ~1,600-1,900 kernels a step at ~3 us each against 0.74 ms of weights), so
the lever is the count of kernels. The layer stack of atlas.backends.decoder calls the layer ops one by one, and
each op is several small kernels (a hyper-connection site ~13, the norms, gates, rotary and casts between the
GEMMs). Here the stack is cut at the state writes instead of at the ops, and each piece between two writes is one
function of tensors that Inductor fuses into a few kernels around its GEMMs:

    prologue (a compiled decode): the embedded streams, the rotary table, the PLE n-gram ids
    [ple: the previous ffn settled + the PLE addition + its conv state write (compiled groups)]
    head:  [the previous layer's ffn tail: routed + shared experts, injection] + PLE-free hyper site (attn)
           + the mixer's in-projection (+ GDN's causal conv over the slot's conv state, + attention's q/k
           norms and rotary)
    (eager: conv state / KV / QSA key writes and their stamps; the GDN recurrent kernel)
    tail:  the mixer's output (GDN's gated norm, or attention over the paged KV with QSA selection) + out
           projection + injection + the ffn's hyper site + the MoE router and shared expert
    (eager: the routed experts, atlas.backends.cuda.moe.moe_routed)

The regions take tensors and plain numbers only (no weight dict, no layer names), so every layer of a kind hits
the same compiled graph (one compile per region kind, and one more with symbolic sizes when a second batch
bucket comes). The math is the layer modules' functions (atlas.backends.cuda.gdn, attention, moe, hyper, ple:
gdn_in, gdn_out, attn_in, attn_core, hyper_block, moe_router), composed: with compile "none" the regions run eagerly and give the layer stack's
result bit for bit (tests/test_cuda_regions.py). Every group of a hyper-connection model runs here: decode groups,
prefill chunks and wide verifies ([B, K] rows written pending, the per-slot state after each row kept for the commit:
the heads then leave the conv states' pools alone and hand their columns back, pools.put keeping each column's window);
the other models take the layer stack.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from atlas.backends.cuda.attention import (
    attention_kind,
    attn_core,
    attn_gate_out,
    attn_in,
    attn_paged,
    attn_sources,
    attn_store,
)
from atlas.backends.cuda.batch import Group, GroupShape, group_columns
from atlas.backends.cuda.compiled import COMPILE_MODE, compiled
from atlas.backends.cuda.gdn import GdnKernel, gdn_in, gdn_out, gdn_update
from atlas.backends.cuda.hyper import hyper_block
from atlas.backends.cuda.moe import (
    RANKED_PAIRS,
    SMALL_EXPERTS,
    counted_route,
    moe_mode_of,
    moe_routed,
    moe_router,
)
from atlas.backends.cuda.ple import ngram_ids_from, ple_layer, ple_mix, ple_weights
from atlas.backends.cuda.pools import DevicePools, store_final
from atlas.backends.cuda.primitives import library_conv, put_conv
from atlas.backends.cuda.tuning import Tuning
from atlas.backends.ops import dense_mlp, hyper_inject, rope_table
from atlas.model.spec import FULL_ATTENTION, ModelSpec

# a compiled decode group of at most this many rows takes its small products as split reductions (primitives.linear): the
# reduction re-reads a weight from L2 once a row (cuBLAS's GEMM reads it once), so it can only win where the GEMV's
# fixed cost dominates. H200 (benchmarks/kernels.py --only hyper_decode, a compiled hyper site alone): 13.0 / 32.2 us
# at 1 / 4 rows against cuBLAS's 14.1 / 17.6, so one row only
GEMV_ROWS = 1

# (routed [R, H] or its pairs [R, K, H], shared, inject) of the ffn not yet injected into the streams; all None before
# the first layer
Pending = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def applies(spec: ModelSpec, grp: Group, tuning: Tuning) -> bool:
    """Whether this group runs as regions (Tuning.regions): any group of a hyper-connection model (a decode group, a
    prefill chunk, a row-by-row or a wide verify)."""
    return tuning.regions and spec.has_hyper_connections


def _site(spec: ModelSpec, streams: torch.Tensor, norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor,
          gemv: str) -> tuple[torch.Tensor, torch.Tensor]:
    x, inject = hyper_block(streams, norm_w, down_w, up_w, spec.hc_count, spec.hidden_size, spec.hc_lowrank,
                            spec.rms_norm_eps, True, gemv)
    assert inject is not None
    return x, inject


def settle(streams: torch.Tensor, routed: torch.Tensor | None, shared: torch.Tensor | None,
            inject: torch.Tensor | None) -> torch.Tensor:
    """The previous ffn's output (routed + shared experts [R, H]) injected into the streams [B, T, hc*H]. routed
    may be the routed pairs' outputs [R, K, H] (moe_routed(summed=False)): summed over the slots here, in the
    region's fused kernel (the same sum as moe_grouped's own, one launch a layer fewer)."""
    if routed is None:
        return streams
    assert inject is not None
    if routed.dim() == 3:
        routed = routed.sum(dim=1)
    out = routed if shared is None else routed + shared
    return hyper_inject(streams, out.view(*streams.shape[:-1], -1), inject)


def gdn_head(spec: ModelSpec, streams: torch.Tensor, routed: torch.Tensor | None, shared: torch.Tensor | None,
             inject_prev: torch.Tensor | None, norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor,
             fused_in: torch.Tensor, conv_w: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor,
             library_conv: bool = False, gemv: str = "", fused_conv: str = "", keep: bool = False
             ) -> tuple[torch.Tensor | None, ...]:
    """(streams, inject, *gdn_in's parts, the conv columns or None) of a GDN layer, the previous ffn settled first;
    the new conv state written into conv_pool at `slots` here (fused with the conv; its stamp is the stack's, once a
    step for every layer), or with `keep` (a wide verify) nothing written and the columns [B, C, S + T] handed back
    (the caller keeps each column's window for the commit)."""
    streams = settle(streams, routed, shared, inject_prev)
    x, inject = _site(spec, streams, norm_w, down_w, up_w, gemv)
    *parts, cols = gdn_in(spec, x, fused_in, conv_w, conv_pool[slots], library_conv, fused_conv)
    if keep:
        return (streams, inject, *parts, cols)
    store_final(conv_pool, slots, cols[:, :, -conv_pool.shape[-1]:])
    return (streams, inject, *parts, None)


def attn_head(spec: ModelSpec, streams: torch.Tensor, routed: torch.Tensor | None, shared: torch.Tensor | None,
              inject_prev: torch.Tensor | None, norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor,
              fused_in: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              write: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, raw_pool: torch.Tensor | None,
              gemv: str = "") -> tuple[torch.Tensor, ...]:
    """(streams, inject, q, gate, qk) of an attention layer, the previous ffn settled first; its new KV rows (and
    QSA raw keys) written into the pools at the flat slots `write` here (their stamps are the stack's, once a
    step for every layer)."""
    streams = settle(streams, routed, shared, inject_prev)
    x, inject = _site(spec, streams, norm_w, down_w, up_w, gemv)
    q, gate, k, v, qk = attn_in(spec, x, fused_in, q_norm, k_norm, cos, sin)
    attn_store(spec, k, v, qk, write, k_pool, v_pool, raw_pool)
    return streams, inject, q, gate, qk


def ffn_head(spec: ModelSpec, streams: torch.Tensor, mixed: torch.Tensor, inject: torch.Tensor,
              norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor, moe_in: torch.Tensor | None,
              shared_down: torch.Tensor | None, route: str, gemv: str = "") -> tuple[torch.Tensor, ...]:
    """The mixer's output injected, then the ffn's site and (MoE) router: (streams, rows, inject, top_w, top_i,
    shared, the pairs' (order, offsets) for the routed kernels when `route`: "ranked" or "counted", see
    moe.counted_route; "" none); a dense ffn's rows only (its router
    parts None). Few experts: the top-k and the route as comparisons and counts (moe.ranked_topk /
    counted_route), which fuse here, instead of torch.topk and a sort."""
    streams = hyper_inject(streams, mixed, inject)
    x, inject = _site(spec, streams, norm_w, down_w, up_w, gemv)
    rows = x.reshape(-1, x.shape[-1])
    if moe_in is None or spec.moe is None:
        return streams, rows, inject, None, None, None, None
    assert shared_down is not None
    small = spec.moe.num_experts <= SMALL_EXPERTS
    top_w, top_i, shared = moe_router(spec.moe, rows, moe_in, shared_down, ranked=small, gemv=gemv)
    # a decode group's pairs ranked (comparisons, no scan); a prefill chunk's counted (its token count symbolic)
    ranked = route == "ranked" and top_i.numel() <= RANKED_PAIRS
    pairs = counted_route(top_i, spec.moe.num_experts, ranked=ranked) if route and small else None
    return streams, rows, inject, top_w, top_i, shared, pairs


def gdn_tail(spec: ModelSpec, streams: torch.Tensor, inject: torch.Tensor, out: torch.Tensor, z: torch.Tensor,
             gnorm_w: torch.Tensor, out_w: torch.Tensor, norm_w: torch.Tensor, down_w: torch.Tensor,
             up_w: torch.Tensor, moe_in: torch.Tensor | None, shared_down: torch.Tensor | None, route: str,
             gemv: str = "") -> tuple[torch.Tensor, ...]:
    return ffn_head(spec, streams, gdn_out(spec, out, z, gnorm_w, out_w), inject, norm_w, down_w, up_w, moe_in,
                     shared_down, route, gemv)


def attn_tail(spec: ModelSpec, streams: torch.Tensor, inject: torch.Tensor, q: torch.Tensor, gate: torch.Tensor,
              qk: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, raw_pool: torch.Tensor | None,
              read_slots: torch.Tensor, positions: torch.Tensor, o_w: torch.Tensor, iq_norm: torch.Tensor | None,
              ik_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, qsa_select: bool, sdpa: bool,
              norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor, moe_in: torch.Tensor | None,
              shared_down: torch.Tensor | None, route: str, gemv: str = "") -> tuple[torch.Tensor, ...]:
    mixed = attn_core(spec, q, gate, qk, k_pool, v_pool, raw_pool, read_slots, positions, o_w, iq_norm, ik_norm,
                      cos, sin, qsa_select, sdpa)
    return ffn_head(spec, streams, mixed, inject, norm_w, down_w, up_w, moe_in, shared_down, route, gemv)


def attn_post(spec: ModelSpec, streams: torch.Tensor, inject: torch.Tensor, att: torch.Tensor, gate: torch.Tensor,
              o_w: torch.Tensor, norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor,
              moe_in: torch.Tensor | None, shared_down: torch.Tensor | None, route: str, gemv: str = "") -> tuple[torch.Tensor, ...]:
    """attn_tail after the paged kernel's attention output att [R, nh, hd]: its gate and projection, then the ffn
    head."""
    b, t = streams.shape[:2]
    return ffn_head(spec, streams, attn_gate_out(att, gate, o_w, b, t), inject, norm_w, down_w, up_w, moe_in,
                     shared_down, route, gemv)


def ple_block(spec: ModelSpec, streams: torch.Tensor, routed: torch.Tensor | None, shared: torch.Tensor | None,
              inject_prev: torch.Tensor | None, ids: torch.Tensor, table: torch.Tensor, key_w: torch.Tensor,
              key_norm: torch.Tensor, query_norm: torch.Tensor, value_w: torch.Tensor, conv_norm: torch.Tensor,
              conv_w: torch.Tensor, conv_pool: torch.Tensor, slots: torch.Tensor, fused_conv: str = "",
              keep: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A compiled PLE layer as one region (a prefill chunk's, a compiled decode group's and a wide verify's): the
    previous ffn settled, the PLE addition (ple.ple_mix) added to the streams, its conv's new state written into
    conv_pool at `slots` (the stamp is the caller's): (the streams, None); with `keep` (a wide verify) nothing
    written, (the streams, the conv columns) for the caller to keep. Eagerly (ple.ple_layer) a PLE layer is ~20
    launches: at 2,048 tokens over the [2,048, 4 x 2,048] streams, its conv ATen's depthwise kernel (176 us on the
    H200) after a 133 us cat; in a decode step ~20 of its ~840 kernels each (two PLE layers)."""
    streams = settle(streams, routed, shared, inject_prev)
    add, cols = ple_mix(spec, streams, ids, table, key_w, key_norm, query_norm, value_w, conv_norm, conv_w,
                        conv_pool[slots], False, fused_conv)
    if keep:
        return streams + add, cols
    store_final(conv_pool, slots, cols[:, :, -conv_pool.shape[-1]:])
    return streams + add, None


def final_mix(spec: ModelSpec, streams: torch.Tensor, routed: torch.Tensor | None, shared: torch.Tensor | None,
              inject: torch.Tensor | None, norm_w: torch.Tensor, down_w: torch.Tensor, up_w: torch.Tensor,
              gemv: str = "") -> torch.Tensor:
    """The last ffn settled, then the final mixer: the hidden states [B, T, H]."""
    streams = settle(streams, routed, shared, inject)
    final, _ = hyper_block(streams, norm_w, down_w, up_w, spec.hc_count, spec.hidden_size, spec.hc_lowrank,
                           spec.rms_norm_eps, False, gemv)
    return final


def prologue(spec: ModelSpec, tokens: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor,
             ctx_pool: torch.Tensor | None, slots: torch.Tensor, tables: Sequence[tuple[torch.Tensor, ...]]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A compiled decode group's first region: (the streams [B, T, hc*H], the embedded tokens repeated per stream;
    cos, sin of the rotary table at the positions; the PLE n-gram ids from the slots' n-gram contexts (the pool
    `ctx_pool` [slots, L] at `slots`), ple.device_ngram_ids' [P, B, T, heads], or None when ctx_pool is None).
    Eagerly ~40 launches a step (the table's arange, pow, reciprocal, product, cat, cos, sin and casts; the gather and
    the streams' cat; the context's gather and the n-gram ids' ~30 integer ops)."""
    cos, sin = rope_table(positions.reshape(-1), spec.rotary_dim, spec.rope_theta, embed.dtype)
    ids = None
    if ctx_pool is not None and spec.ple is not None:
        ids = ngram_ids_from(ctx_pool[slots], tokens, spec.ple, tables)
    return torch.cat([embed[tokens]] * spec.hc_count, dim=-1), cos, sin, ids


def compiled_decode(spec: ModelSpec, shape: GroupShape, tuning: Tuning) -> bool:
    """Whether a group runs as compiled decode regions (applies, Tuning.compile, one token a row or a wide verify's
    K): the runner then derives its columns with a compiled batch.group_columns, and leaves its n-gram ids to the
    prologue (computes_ngram_ids)."""
    return (shape.width == 1 or shape.keep) and spec.has_hyper_connections and tuning.regions and tuning.compile


def columns_of(spec: ModelSpec, shape: GroupShape, tuning: Tuning) -> Callable[..., tuple[torch.Tensor, ...]] | None:
    """The compiled batch.group_columns a compiled decode group's columns are derived with (~17 launches one
    region), or None (Group.view's eager group_columns)."""
    return compiled(group_columns, COMPILE_MODE) if compiled_decode(spec, shape, tuning) else None


def computes_ngram_ids(spec: ModelSpec, shape: GroupShape, tuning: Tuning) -> bool:
    """Whether regions_stack computes a group's n-gram ids itself (in the compiled prologue): a compiled decode group
    of a PLE model. The runner then leaves Group.ngram_ids None (ple.device_ngram_ids eagerly otherwise)."""
    return spec.ple is not None and shape.ngram_on_device and compiled_decode(spec, shape, tuning)


def _same(x: torch.Tensor | None) -> torch.Tensor | None:
    return x


def _token_dim(x: torch.Tensor | None) -> torch.Tensor | None:
    """A prefill chunk's activation with its token dimension marked dynamic (dim 1 of [1, T, ...], dim 0 of rows
    [T, ...]) before a compiled region sees it: one compile a region kind serves every chunk length, and only the
    token dimension is symbolic. dynamic=True instead made every size symbolic, weights' included, and the
    kernels 5-10x slower (H200: a grouped RMSNorm over [2,048, 8,192] 157 us, ~15 us of traffic)."""
    if x is not None:
        torch._dynamo.mark_dynamic(x, 1 if x.dim() >= 2 and x.shape[0] == 1 else 0)
    return x


def regions_stack(spec: ModelSpec, w: dict[str, torch.Tensor], pools: DevicePools, grp: Group, *,
                  gdn_kernel: GdnKernel | None, tuning: Tuning, invariant: bool = False,
                  ngram_tables: Sequence[tuple[torch.Tensor, ...]] = ()) -> torch.Tensor:
    """The group's final hidden states [B, T, H]: decoder_stack's result, cut into regions. A prefill chunk takes
    its token dimension symbolic when compiled (one compile a region kind serves every chunk length). A wide verify
    (keep) runs as a decode group of K tokens a row: its regions, its prologue, its attention over the paged KV (each
    row its own visible keys and QSA selection), its routed experts over the B * K rows; the per-slot state after
    each row kept (pools.put with keep), the live state and its stamps left as they were."""
    keep = grp.shape.keep
    prefill = grp.shape.width > 1 and not grp.shape.pending
    mode = COMPILE_MODE if tuning.compile else "none"
    head_g, head_a = compiled(gdn_head, mode), compiled(attn_head, mode)
    tail_g, tail_a, post_a = compiled(gdn_tail, mode), compiled(attn_tail, mode), compiled(attn_post, mode)
    ffn_c = compiled(ffn_head, mode)
    settle_c, final_c, ple_c = compiled(settle, mode), compiled(final_mix, mode), compiled(ple_block, mode)
    tok = _token_dim if prefill and mode != "none" else _same
    dtype = w["embed_tokens.weight"].dtype
    # compiled: the prologue, the PLE layers and a decode group's columns as regions too; eager regions run them
    # op by op
    wide = mode != "none"
    if prefill or not wide:
        cos, sin = rope_table(grp.positions.reshape(-1), spec.rotary_dim, spec.rope_theta, dtype)
        streams = torch.cat([w["embed_tokens.weight"][grp.tokens]] * spec.hc_count, dim=-1)
    else:  # a compiled decode: the step's ~40 eager launches before the first layer as one region
        ctx_pool = pools.state["pctx"] if grp.ngram_ids is None and spec.ple is not None else None
        streams, cos, sin, ids = compiled(prologue, mode)(spec, grp.tokens, grp.positions, w["embed_tokens.weight"],
                                                          ctx_pool, grp.slots, ngram_tables)
        if ids is not None:
            grp = attrs.evolve(grp, ngram_ids=ids)
    cos, sin = tok(cos), tok(sin)
    write = grp.write_slots.reshape(-1)
    # a compiled decode group of few rows: the hyper sites' and router's products as reductions Inductor fuses, a
    # long K's sum split (primitives.linear)
    gemv = "split" if grp.shape.width == 1 and wide and grp.tokens.shape[0] <= GEMV_ROWS else ""
    # paged: the split-K kernel between the head and attn_post (eager, in the graph)
    sdpa, paged = attention_kind(grp, tuning)
    moe_mode = moe_mode_of(tuning, prefill)
    library = library_conv(tuning, grp, invariant)  # the eager convs' (PLE's)
    # a compiled region's GDN heads' (and PLE region's) conv: the windowed product Inductor fuses, or in a prefill
    # chunk on a CUDA device the time-major Triton kernel (a custom op the region calls)
    head_library = library and not wide
    head_fused = "triton" if prefill and wide else ""
    if head_fused:
        import atlas_kernels.conv  # noqa: F401  (registers torch.ops.atlas.causal_conv_prefill)
    # the routed kernels take the pairs' order computed in the tail region: ranked (decode) or counted (prefill)
    route = ("counted" if prefill else "ranked") if moe_mode == "triton" else ""
    ple_layers = spec.ple.layers if spec.ple is not None else ()
    pending: Pending = (None, None, None)
    for layer in range(spec.num_layers):
        pre = f"layers.{layer}."
        routed, shared, inject_prev = pending
        if layer in ple_layers and wide:  # PLE as one compiled region, its stamp with the convs' at the end
            assert grp.ngram_ids is not None
            conv_pool = pools.state[f"pconv{layer}"]
            streams, cols = ple_c(spec, tok(streams), tok(routed), tok(shared), tok(inject_prev),
                                  tok(grp.ngram_ids[ple_layers.index(layer)]), *ple_weights(w, pre + "ple."),
                                  conv_pool, grp.slots, head_fused, keep)
            if keep:
                assert cols is not None
                put_conv(pools, grp, f"pconv{layer}", cols)
            routed = shared = inject_prev = None
        elif layer in ple_layers:  # PLE keeps its own conv state: settle, add it eagerly, then the head
            assert grp.ngram_ids is not None
            streams = settle_c(tok(streams), tok(routed), tok(shared), tok(inject_prev))
            streams = streams + ple_layer(spec, w, pre + "ple.", streams, grp.ngram_ids[ple_layers.index(layer)],
                                          grp, pools, layer, library)
            routed = shared = inject_prev = None
        site = (w[pre + "attn_hyper_connection.hc_norm.weight"], w[pre + "attn_hyper_connection.fused_down.weight"],
                w[pre + "attn_hyper_connection.input_mix_weight_up.weight"])
        mlp = pre + "mlp_hyper_connection."
        ffn_site = (w[mlp + "hc_norm.weight"], w[mlp + "fused_down.weight"], w[mlp + "input_mix_weight_up.weight"])
        moe = spec.moe_layers[layer] and spec.moe is not None
        moe_w = (w[pre + "mlp.fused_in.weight"], w[pre + "mlp.shared_expert.down_proj.weight"]) if moe else (None, None)
        if spec.layer_types[layer] == FULL_ATTENTION:
            a = pre + "self_attn."
            k_pool, v_pool, raw_pool, read_slots, _, o_w, iq_norm, ik_norm = attn_sources(spec, w, a, layer, grp,
                                                                                         pools)
            streams, inject, q, gate, qk = head_a(spec, tok(streams), tok(routed), tok(shared), tok(inject_prev),
                                                  *site, w[a + "fused_in.weight"], w[a + "q_norm.weight"],
                                                  w[a + "k_norm.weight"], cos, sin, tok(write), k_pool, v_pool,
                                                  raw_pool, gemv)
            if paged:
                att = attn_paged(q, k_pool, v_pool, grp)
                streams, rows, inject, top_w, top_i, shared, pairs = post_a(spec, streams, inject, att, gate, o_w,
                                                                            *ffn_site, *moe_w, route, gemv)
            elif prefill:
                # a prefill chunk's attention eager (as the layer stack's), its ffn head compiled. Written when the
                # ConstraintViolationError (H200) was taken for Inductor's sdpa lowering specialising the
                # query length; the cause was the frame retry that fullgraph=True ends (atlas.backends.cuda.compiled),
                # so attn_tail could serve prefill too: unmeasured, kept as run
                mixed = attn_core(spec, q, gate, qk, k_pool, v_pool, raw_pool, read_slots, grp.positions, o_w,
                                  iq_norm, ik_norm, cos, sin, grp.shape.qsa_select, sdpa)
                streams, rows, inject, top_w, top_i, shared, pairs = ffn_c(
                    spec, tok(streams), tok(mixed), tok(inject), *ffn_site, *moe_w, route, "")
            else:
                streams, rows, inject, top_w, top_i, shared, pairs = tail_a(
                    spec, streams, inject, q, gate, qk, k_pool, v_pool, raw_pool, read_slots, grp.positions, o_w,
                    iq_norm, ik_norm, cos, sin, grp.shape.qsa_select, sdpa, *ffn_site, *moe_w, route,
                    gemv)  # decode only
        else:
            g = pre + "linear_attn."
            streams, inject, *parts = head_g(spec, tok(streams), tok(routed), tok(shared), tok(inject_prev), *site,
                                             w[g + "fused_in.weight"], w[g + "conv1d.weight"],
                                             pools.state[f"conv{layer}"], grp.slots, head_library, gemv,
                                             head_fused, keep)
            # a wide verify's conv columns kept by gdn_update (put_conv); the others' conv state is written
            out = gdn_update(spec, w, g, layer, tuple(parts), grp, pools, gdn_kernel, conv_written=not keep)
            streams, rows, inject, top_w, top_i, shared, pairs = tail_g(
                spec, tok(streams), tok(inject), tok(out), tok(parts[3]), w[g + "norm.weight"],
                w[g + "out_proj.weight"], *ffn_site, *moe_w, route, gemv)
        if moe:
            assert spec.moe is not None and top_w is not None and top_i is not None
            routed = moe_routed(spec.moe, w, pre + "mlp.", rows, top_w, top_i, mode=moe_mode, route=pairs,
                                summed=False)
        else:
            routed, shared = dense_mlp(w, pre + "mlp.", rows), None
        pending = (routed, shared, inject)
    # the stamps of the state the heads wrote, after all of it (a stamp never runs ahead of its data): every
    # layer's conv state at the slots (the compiled PLE regions' too; eager PLE layers stamped theirs as they
    # wrote), every attention layer's KV and QSA positions at the new rows (each of these was one launch a layer,
    # 30 a step, with the data's copies). A wide verify wrote no conv state: its kept rows' stamps are the commit's
    if not keep:
        pools.stamp_states(pools.conv_rows_ple if wide else pools.conv_rows, grp.slots, grp.ends)
    if spec.attention_layers:
        pools.stamp_rows(grp.stamp_at, grp.stamp_values)
    routed, shared, inject_prev = pending
    final = final_c(spec, tok(streams), tok(routed), tok(shared), tok(inject_prev),
                    w["hyper_connection_mixer.hc_norm.weight"],
                    w["hyper_connection_mixer.input_mix_weight_down.weight"],
                    w["hyper_connection_mixer.input_mix_weight_up.weight"], gemv)
    return final
