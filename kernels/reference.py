"""Plain-torch references for every kernel in atlas_kernels, written from the math of transformers'
qwen4_exp modeling source (not calling it). All arithmetic is fp32; results are returned in fp32.

They favour obviousness over speed: loops over tokens and sequences, one formula per line. The kernels
are tested against them on random inputs, and the CPU backend may use them directly.
"""

from __future__ import annotations

import math

import torch
from atlas_kernels.rows import RowOffset, check_rows
from torch.nn import functional as F

L2_EPS = 1e-6  # transformers' l2norm, matching flash-linear-attention


def check_gdn_state_pool(state_pool: torch.Tensor, num_k_heads: int, num_v_heads: int, dk: int, dv: int) -> None:
    """The contract every GDN kernel shares: GQA-style heads, and an fp32 [slots, Hv, dk, dv] state pool."""
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads {num_v_heads} must be a multiple of key heads {num_k_heads}")
    if state_pool.dtype != torch.float32 or tuple(state_pool.shape[1:]) != (num_v_heads, dk, dv):
        raise ValueError(f"state pool must be fp32 [slots, {num_v_heads}, {dk}, {dv}], got "
                         f"{state_pool.dtype} {tuple(state_pool.shape)}")


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# --- Gated DeltaNet ---------------------------------------------------------------------------------------


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, token by token.

    q, k: [T, Hk, dk]; v: [T, Hv, dv]; g (log decay, <= 0), beta: [T, Hv]; state: [Hv, dk, dv].
    Value head h reads key head h // (Hv // Hk). q and k are l2-normalised, q is scaled by dk^-0.5.
    Returns (out [T, Hv, dv], states [T, Hv, dk, dv]): states[t] is the state after token t.
    """
    num_tokens, num_k_heads, dk = k.shape
    num_v_heads = v.shape[1]
    group = num_v_heads // num_k_heads
    q = l2_normalize(q).repeat_interleave(group, dim=1) * dk**-0.5
    k = l2_normalize(k).repeat_interleave(group, dim=1)
    v, g, beta = v.float(), g.float(), beta.float()
    s = state.float().clone()
    outs, states = [], []
    for t in range(num_tokens):
        s = s * g[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", s, k[t])
        delta = (v[t] - predicted) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
        states.append(s)
    return torch.stack(outs), torch.stack(states)


# --- causal depthwise conv1d ------------------------------------------------------------------------------


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over T new columns of one sequence, continuing from its conv state.

    x: [T, C] (token-major, as the projection writes it); conv_state: [C, S] with S >= K - 1, the last S
    pre-activation columns, oldest first (transformers keeps S == K); weight: [C, K].
    Returns (out [T, C], new_state [C, S]): the new state is the last S columns of state ++ x.
    """
    num_tokens = x.shape[0]
    channels, kernel_size = weight.shape
    state_len = conv_state.shape[1]
    columns = torch.cat([conv_state.float(), x.float().T], dim=1)  # [C, S + T]
    window = columns[:, state_len - (kernel_size - 1) :]  # only the last K-1 state columns are read
    out = F.conv1d(window[None], weight.float()[:, None, :], bias.float() if bias is not None else None,
                   groups=channels)[0]  # [C, T]
    assert out.shape[1] == num_tokens
    if silu:
        out = F.silu(out)
    return out.T, columns[:, -state_len:]


# --- paged attention --------------------------------------------------------------------------------------


def gather_paged(pool: torch.Tensor, block_table: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Positions [0, num_tokens) of one sequence from a paged pool [num_blocks, block_size, ...]."""
    block_size = pool.shape[1]
    positions = torch.arange(num_tokens, device=pool.device)
    return pool[block_table.long()[positions // block_size], positions % block_size]


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    selected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of T query rows per sequence over its paged KV.

    q: [B, T, Hq, D]; k_pool, v_pool: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks];
    seq_lens: [B], counting the T rows' own keys (already written). Row t sits at position
    seq_len - T + t and sees positions <= its own (causal within the rows). selected: optional
    [B, T, max_sel] int32 token positions (-1 padded): the row attends to those positions only (QSA).
    Returns [B, T, Hq, D] fp32.
    """
    batch, num_rows, num_q_heads, _ = q.shape
    num_kv_heads = k_pool.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for b in range(batch):
        seq_len = int(seq_lens[b])
        # the rows' start becomes addresses through the block table: inside it (paged_attention checks the bound)
        check_rows(RowOffset(max(0, seq_len - num_rows)), num_rows, block_tables.shape[1], k_pool.shape[1],
                   what=f"paged attention row {b}")
        keys = gather_paged(k_pool, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        values = gather_paged(v_pool, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        for t in range(num_rows):
            position = seq_len - num_rows + t
            if selected is None:
                visible = torch.arange(position + 1, device=q.device)
            else:
                visible = selected[b, t][selected[b, t] >= 0].long()
                assert int(visible.max()) <= position, "a selected token lies in the row's future"
            scores = torch.einsum("hd,nhd->hn", q[b, t].float(), keys[visible]) * scale
            out[b, t] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values[visible])
    return out


# --- QSA indexer ------------------------------------------------------------------------------------------


def rope_inv_freq(head_dim: int, partial_rotary_factor: float, theta: float) -> torch.Tensor:
    """Default RoPE inverse frequencies over the rotary part of the head, as transformers computes them."""
    rotary_dim = int(head_dim * partial_rotary_factor)
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first 2 * len(inv_freq) dims of x [..., P, d]; the rest passes through."""
    rotary_dim = 2 * inv_freq.numel()
    angles = positions.float()[:, None] * inv_freq.to(x.device)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x = x.float()
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * cos + rotated_half * sin, rest], -1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN's output norm (not zero-centred): x * rsqrt(mean(x^2) + eps) * w * silu(gate)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float() * F.silu(gate.float())


def qsa_pool_keys(
    raw_keys: torch.Tensor, norm_weight: torch.Tensor, inv_freq: torch.Tensor, ratio: int, eps: float
) -> torch.Tensor:
    """Block keys of one sequence: raw_keys [n, d] -> [n // ratio, d]. Each complete block of `ratio`
    tokens is mean-pooled, RMS-normed (zero-centred) and roped at the block's first position."""
    num_blocks = raw_keys.shape[0] // ratio
    pooled = raw_keys[: num_blocks * ratio].float().view(num_blocks, ratio, -1).mean(1)
    starts = torch.arange(num_blocks, device=raw_keys.device) * ratio
    return apply_rope(rms_norm(pooled, norm_weight, eps), starts, inv_freq)


def qsa_block_scores(q: torch.Tensor, block_keys: torch.Tensor) -> torch.Tensor:
    """Score of each block for one query row: sum over index heads of relu(q_h . k_j), over sqrt(d).
    q: [H_index, d] (normed and roped at the row's position); block_keys: [nb, d]. Returns [nb]."""
    return torch.relu(q.float() @ block_keys.float().T).sum(0) / math.sqrt(q.shape[-1])


def qsa_select(scores: torch.Tensor, num_visible: int, ratio: int, budget: int) -> torch.Tensor:
    """Token positions one query row attends to, ascending: the budget // ratio best complete blocks,
    then the incomplete tail block. Ties go to the lowest block index (relu makes exact ties common:
    every block whose score is clipped to 0), so the choice never depends on the sort's stability."""
    num_blocks = num_visible // ratio
    ranked = sorted(range(num_blocks), key=lambda j: (-float(scores[j]), j))
    chosen = sorted(ranked[: budget // ratio])
    tokens = [j * ratio + i for j in chosen for i in range(ratio)]
    tokens += list(range(num_blocks * ratio, num_visible))
    return torch.tensor(tokens, dtype=torch.int32)
