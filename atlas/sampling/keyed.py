"""The keyed sampler: one batched, device-agnostic function every backend runs, CPU reference and GPU alike.

`sample(logits [B, V], rows) -> tokens [B]`. Per row: logit_bias added to the raw logits, the repetition
penalty (vLLM semantics), the frequency and presence penalties (OpenAI's; the bias and the penalties' inputs from
atlas.sampling.adjust), banned tokens to -inf, then z = logits / temperature, then the kept set (min_p and top_k:
thresholds on the same ordering; top_p over what they keep), then token = argmax over the kept set of z + g,
where g is Gumbel noise keyed by (seed, position, salt, token id) (atlas.sampling.hashing). Gumbel-max samples
exactly from softmax(z) restricted to the kept set. Temperature 0 (and below TEMPERATURE_FLOOR, 1e-5, packed
as 0) is the greedy argmax, lowest index among ties.

No host synchronisation and fixed shapes (CUDA-graph capturable): which code path runs (greedy only, no
sort, sort) is chosen from the host-side parameters (`RowBatch.mode`), never from tensor values. On a GPU the
draw itself (row keys, words, noise, kept test, argmax) is one fused kernel, atlas_kernels.keyed_sample, that
computes the same words and the same correctly rounded z as the torch ops here (the CPU reference).

A row's token depends on its own logits and parameters only: never on the batch, its order or its padding.
Every step is elementwise or a per-row max/argmax/sort, which are exact. Where the CPU and a GPU can differ
for the same logits, and by how much:
- the noise: the integer words are bit-identical; the two float64 logs of -log(-log(u)) may differ by 1 ulp
  between libm and CUDA (~1e-16 relative), so a token flips only when two scores z + g are within ~1e-15 of
  each other (float64, not float32, for the noise and scores for this reason: float32 would be ~1e-6);
- top_p: the cumulative mass is a float64 scan whose order differs by device (and possibly by batch shape
  on a GPU): a token whose preceding mass is within ~1e-15 relative of top_p may be kept on one and not the
  other. On a GPU, 16-bit keys find the threshold from a histogram of the row's bit patterns instead of a
  sort (atlas_kernels.keyed_threshold: bin masses count x exp, summed in a fixed order per row, so on a GPU
  the top_p scan does not depend on the batch), the same value up to that same ~1e-15 bound. min_p is
  compared in logit space, z - z_max >= log(min_p) with log(min_p) computed on the host, so it is
  elementwise and exact; top_k is a sort and a gather (or a count over the histogram), exact.
Ties at a threshold are kept (every token with z equal to the last kept one's): the kept set is a function
of the values, not of the token order.

The words are 32 bits: the noise is truncated at -log(-log(1 - 2^-33)) ~ 22.9, which changes a draw only
when some token's noise would exceed that (probability < V * 1.2e-10: 8e-6 total variation at V = 65,536),
far below what bf16 logits perturb.
"""

from __future__ import annotations

import importlib
import math
import operator
import os
from collections.abc import Sequence

import attrs
import numpy as np
import torch

from atlas.sampling.adjust import Adjust
from atlas.sampling.hashing import gumbel, row_keys, seed64, token_words, uniform
from atlas.sampling.params import SamplingParams

# one salt per use of a position's randomness, so the draws are independent of each other; decode and a
# verify's bonus/correction rows use SAMPLE_SALT, so they draw exactly what a plain decode would
SAMPLE_SALT = 0x5EC0_0000
ACCEPT_SALT = 0x5EC0_0001
RESIDUAL_SALT = 0x5EC0_0002
DRAFT_SALT = 0x5EC0_0003

COLUMNS = 7  # packed row: temperature, top_p, log_min_p, repetition_penalty (float64 bits), top_k, seed, position
_NEG_INF = float("-inf")


@attrs.frozen
class Rows:
    """Per-row sampling parameters as device tensors [B], and the host-known path flags."""

    temperature: torch.Tensor  # float64, 0 = greedy
    top_p: torch.Tensor  # float64, 1 = off
    log_min_p: torch.Tensor  # float64, -inf = off
    penalty: torch.Tensor  # float64 repetition penalty, 1 = off
    top_k: torch.Tensor  # int64, 0 = off
    seed: torch.Tensor  # int64: the request seed mod 2^64
    position: torch.Tensor  # int64: the position of the token being sampled
    sampled: bool = True  # some row has temperature > 0 (else: argmax only)
    filtered: bool = True  # some sampled row has top_k or top_p (needs the sort)

    @classmethod
    def unpack(cls, packed: torch.Tensor, sampled: bool = True, filtered: bool = True) -> Rows:
        """From a packed [B, COLUMNS] int64 tensor (see RowBatch): views only, capturable."""
        f = packed[:, :4].contiguous().view(torch.float64)
        return cls(f[:, 0], f[:, 1], f[:, 2], f[:, 3], packed[:, 4], packed[:, 5], packed[:, 6], sampled, filtered)

    def rows(self, lo: int, hi: int) -> Rows:
        """Rows lo..hi - 1."""
        return Rows(self.temperature[lo:hi], self.top_p[lo:hi], self.log_min_p[lo:hi], self.penalty[lo:hi],
                    self.top_k[lo:hi], self.seed[lo:hi], self.position[lo:hi], self.sampled, self.filtered)

    def at(self, position: torch.Tensor, repeat: int) -> Rows:
        """Every row repeated `repeat` times (row-major), with the positions given [B * repeat]."""
        r = lambda t: t[:, None].expand(-1, repeat).reshape(-1)  # noqa: E731 - no output-size sync
        return Rows(r(self.temperature), r(self.top_p), r(self.log_min_p), r(self.penalty), r(self.top_k),
                    r(self.seed), position, self.sampled, self.filtered)


@attrs.frozen
class RowBatch:
    """The host side of Rows: one packed int64 tensor (a single host->device copy) and the path flags."""

    packed: torch.Tensor  # [B, COLUMNS] int64 on the CPU
    sampled: bool
    filtered: bool

    @property
    def mode(self) -> str:
        return "filtered" if self.filtered else "sampled" if self.sampled else "greedy"

    @classmethod
    def of(cls, params: Sequence[SamplingParams], positions: Sequence[int], pin: bool = False) -> RowBatch:
        n = len(params)
        # numpy from flat tuples: torch.tensor of nested lists was 43.6 us at 64 rows (this box), this 27.8
        # a temperature below the floor is greedy (SamplingParams.greedy): packed as 0, so every path agrees
        floats = np.array([(0.0 if p.greedy else p.temperature, p.top_p, math.log(p.min_p) if p.min_p > 0 else _NEG_INF,
                            p.repetition_penalty) for p in params], dtype=np.float64).reshape(n, 4)
        ints = np.array([(p.top_k, seed64(p.seed), pos) for p, pos in zip(params, positions, strict=True)],
                        dtype=np.int64).reshape(n, 3)
        packed = torch.from_numpy(np.concatenate([floats.view(np.int64), ints], axis=1))
        sampled = any(not p.greedy for p in params)
        filtered = any(not p.greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params)
        return cls(packed.pin_memory() if pin else packed, sampled, filtered)

    def to(self, device: torch.device | str) -> Rows:
        return Rows.unpack(self.packed.to(device, non_blocking=self.packed.is_pinned()), self.sampled, self.filtered)


class RowPacker:
    """RowBatch.of for the decode group, whose rows repeat step after step: the packed rows of the last call's
    parameters (compared by identity: a request keeps its SamplingParams object) are kept, so a steady step
    writes only the positions. With `pin`, into one pinned buffer per batch size, reused by the next call: the
    caller's step has waited for the copy out of it by then (picks.sample_rows copies the tokens back after it)."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self._params: tuple[SamplingParams, ...] = ()
        self._base: np.ndarray | None = None
        self._flags = (False, False)
        self._buffers: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # per batch size: the buffer, its numpy view

    def of(self, params: Sequence[SamplingParams], positions: Sequence[int]) -> RowBatch:
        n = len(params)
        known = self._params
        if self._base is None or len(known) != n or not all(map(operator.is_, params, known)):
            fresh = RowBatch.of(params, [0] * n)
            self._params, self._base, self._flags = tuple(params), fresh.packed.numpy(), (fresh.sampled,
                                                                                         fresh.filtered)
        held = self._buffers.get(n)
        if held is None:
            buffer = torch.empty((n, COLUMNS), dtype=torch.int64, pin_memory=self.pin)
            held = self._buffers[n] = (buffer, buffer.numpy())
        buffer, rows = held
        rows[:] = self._base
        rows[:, COLUMNS - 1] = positions
        return RowBatch(buffer, *self._flags)


def rows_of(params: Sequence[SamplingParams], positions: Sequence[int], device: torch.device | str = "cpu") -> Rows:
    """The rows on `device`: through pinned memory on a CUDA device (a queued copy; a pageable one waits for the
    whole stream)."""
    return RowBatch.of(params, positions, pin=torch.device(device).type == "cuda").to(device)


def token_mask(ids_or_mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A [B, V] bool mask from a bool mask (as is) or from token ids [B, L] padded with -1 (fixed shape)."""
    if ids_or_mask.dtype == torch.bool:
        return ids_or_mask
    ids = torch.where(ids_or_mask < 0, vocab, ids_or_mask)
    mask = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, ids, True)[:, :vocab]


def penalised(logits: torch.Tensor, rows: Rows, banned: torch.Tensor | None = None,
              seen: torch.Tensor | None = None, adjust: Adjust | None = None) -> torch.Tensor:
    """The logits [B, V] after logit_bias, the repetition penalty on `seen` tokens (`adjust.seen` when not given),
    the frequency and presence penalties and -inf on `banned` tokens (`seen` and `banned` each a [B, V] bool mask or
    [B, L] ids padded with -1; `adjust`: atlas.sampling.adjust.Adjust): the sampler's `key`. Without any of them it
    stays in the logits' own dtype (bf16/fp32 convert to float64 exactly, so float64(key) is the exact value and
    sorted(key) / T is sorted(x / T) bit for bit): no float64 copy for greedy rows, a sort of half the width or
    less (one CPU core, V = 65,536: fp32 5.3 ms, fp64 10.3 ms), and the fused kernel reads it without a cast pass."""
    vocab = logits.shape[-1]
    key = logits
    if adjust is not None:
        if adjust.bias is not None:
            key = key.to(torch.float64) + adjust.bias
        seen = adjust.seen if seen is None else seen
    if seen is not None:
        x = key.to(torch.float64)
        pen = rows.penalty[:, None]
        hit = token_mask(seen, vocab) & (pen != 1.0)
        key = torch.where(hit, torch.where(x > 0, x / pen, x * pen), x)
    if adjust is not None and adjust.offset is not None:
        key = key.to(torch.float64) + adjust.offset
    if banned is not None:
        key = key.masked_fill(token_mask(banned, vocab), _NEG_INF)
    return key


def scaled(x: torch.Tensor, rows: Rows) -> torch.Tensor:
    """z = x / temperature (greedy rows divided by 1: their z is only ever argmax'd)."""
    return x / row_temperature(rows)[:, None]


def row_temperature(rows: Rows) -> torch.Tensor:
    return torch.where(rows.temperature > 0, rows.temperature, 1.0)


def threshold(key: torch.Tensor, rows: Rows) -> torch.Tensor:
    """`last` [B] float64: the scaled value of the last token top_k and top_p keep (after min_p), so the kept set
    is {z - z_max >= log_min_p} & {z >= last}. `key` is the penalised logits (see penalised). On a GPU with
    atlas_kernels, 16-bit keys take the histogram kernels (atlas_kernels.keyed_threshold: no sort, tested to give
    threshold_sorted's value); ATLAS_SAMPLER_KERNEL=0 keeps the sort."""
    if key.is_cuda and key.dtype in (torch.bfloat16, torch.float16):
        binned = _binned()
        if binned is not None:
            zmax = key.max(dim=-1).values.to(torch.float64) / row_temperature(rows)
            return binned(key, rows.temperature, rows.log_min_p, rows.top_k, rows.top_p, zmax)
    return threshold_sorted(key, rows)


def threshold_sorted(key: torch.Tensor, rows: Rows) -> torch.Tensor:
    """threshold() by sorting the row: the reference (and the path of float32 / float64 keys)."""
    vocab = key.shape[-1]
    s = torch.sort(key, dim=-1, descending=True).values.to(torch.float64) / row_temperature(rows)[:, None]
    d = s - s[:, :1]  # z - z_max: s[:, 0] = fl(max(x) / T) == max(fl(x / T)), rounding is monotone
    k = torch.where(rows.top_k > 0, rows.top_k.clamp(max=vocab), vocab)
    prefix = (d >= rows.log_min_p[:, None]) & (s >= s.gather(1, (k - 1)[:, None]))  # both monotone in s
    cum = torch.cumsum(torch.where(prefix, torch.exp(d), 0.0), dim=-1)
    # the smallest prefix reaching top_p: token j is kept while the mass before it, cum[j - 1], is below
    # top_p * total (token 0 always); top_p == 1 is off outright (rounding must not drop tiny tokens)
    reach = 1 + (cum[:, :-1] < rows.top_p[:, None] * cum[:, -1:]).sum(dim=-1)
    n = prefix.sum(dim=-1)
    n = torch.where(rows.top_p >= 1.0, n, torch.minimum(n, reach))
    return s.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]


def kept_mask(z: torch.Tensor, rows: Rows, last: torch.Tensor | None) -> torch.Tensor:
    """The kept set [B, V] bool of scaled logits z: min_p, then z >= last (top_k and top_p) when given."""
    keep = (z - z.max(dim=-1, keepdim=True).values) >= rows.log_min_p[:, None]
    return keep if last is None else keep & (z >= last[:, None])


def kept(key: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The kept set [B, V] bool: min_p, top_k, then top_p over what those keep (`key`: penalised logits)."""
    z = scaled(key.to(torch.float64), rows)
    return kept_mask(z, rows, threshold(key, rows) if rows.filtered else None)


def keyed_argmax(key: torch.Tensor, rows: Rows, last: torch.Tensor | None, salt: int) -> torch.Tensor:
    """Per row: temperature > 0: argmax over the kept set of z + keyed Gumbel noise, one exact draw from
    softmax(z) on that set (z = float64(key) / T); temperature 0: argmax of key, the lowest index among ties.
    On a GPU with atlas_kernels importable this is one fused kernel (atlas_kernels.keyed_sample, tested to
    give the same tokens); ATLAS_SAMPLER_KERNEL=0 keeps the torch ops."""
    fused = _fused() if key.is_cuda else None
    if fused is not None:
        t = row_temperature(rows)
        zmax = key.max(dim=-1).values.to(torch.float64) / t
        bound = torch.full_like(zmax, _NEG_INF) if last is None else last
        return fused(key, rows.temperature, rows.log_min_p, bound, zmax, rows.seed, rows.position, salt)
    return keyed_argmax_torch(key, rows, last, salt)


# elements per pass on a CPU: [4, 65,536] int64 temporaries stay in cache (B = 16, V = 65,536: 225 -> 116 ms)
_CPU_ELEMENTS = 1 << 18


def keyed_argmax_torch(key: torch.Tensor, rows: Rows, last: torch.Tensor | None, salt: int) -> torch.Tensor:
    step = max(1, _CPU_ELEMENTS // key.shape[-1])
    if not key.is_cuda and key.shape[0] > step:  # a few rows at a time is the same function: no row sees another
        return torch.cat([keyed_argmax_torch(key[i : i + step], rows.rows(i, i + step),
                                              None if last is None else last[i : i + step], salt)
                          for i in range(0, key.shape[0], step)])
    z = scaled(key.to(torch.float64), rows)
    keep = kept_mask(z, rows, last)
    ka, kb = row_keys(rows.seed, rows.position, salt)
    g = gumbel(token_words(ka, kb, z.shape[-1]))
    drawn = torch.where(keep, g.add_(z), _NEG_INF).argmax(dim=-1)
    return torch.where(rows.temperature > 0, drawn, key.argmax(dim=-1))


_KERNELS: dict[str, object] = {}


def _kernel(module: str, name: str):  # a launcher of atlas_kernels, or None (not importable, or switched off)
    if name not in _KERNELS:
        fn = None
        if os.environ.get("ATLAS_SAMPLER_KERNEL", "1") != "0":
            try:
                fn = getattr(importlib.import_module(f"atlas_kernels.{module}"), name)
            except ImportError:
                fn = None
        _KERNELS[name] = fn
    return _KERNELS[name]


def _fused():  # the draw's launcher, or None
    return _kernel("keyed_sample", "keyed_argmax")


def _binned():  # the 16-bit threshold's launcher, or None
    return _kernel("keyed_threshold", "keyed_threshold")


def sample(logits: torch.Tensor, rows: Rows, *, banned: torch.Tensor | None = None,
           seen: torch.Tensor | None = None, adjust: Adjust | None = None, salt: int = SAMPLE_SALT) -> torch.Tensor:
    """The token [B] int64 of every row of logits [B, V] (any float dtype, any device)."""
    key = penalised(logits, rows, banned, seen, adjust)
    if not rows.sampled:
        return key.argmax(dim=-1)  # first maximum: the lowest index among ties, on every device
    return keyed_argmax(key, rows, threshold(key, rows) if rows.filtered else None, salt)


def distribution(logits: torch.Tensor, rows: Rows, *, banned: torch.Tensor | None = None,
                 seen: torch.Tensor | None = None, adjust: Adjust | None = None) -> torch.Tensor:
    """The target distribution [B, V] float64 that `sample` draws from (greedy rows: the point mass on the
    argmax)."""
    key = penalised(logits, rows, banned, seen, adjust)
    z = scaled(key.to(torch.float64), rows)
    keep = kept_mask(z, rows, threshold(key, rows) if rows.filtered else None)
    e = torch.where(keep, torch.exp(z - z.max(dim=-1, keepdim=True).values), 0.0)
    p = e / e.sum(dim=-1, keepdim=True)
    point = torch.zeros_like(p).scatter_(1, key.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where((rows.temperature > 0)[:, None], p, point)


def keyed_uniform(rows: Rows, salt: int) -> torch.Tensor:
    """One uniform [B] float64 in (0, 1) per row for (seed, position, salt): token word 0."""
    ka, kb = row_keys(rows.seed, rows.position, salt)
    return uniform(token_words(ka, kb, 1)[:, 0])


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of `tokens` [B] under the raw model distribution (float64 [B]) and the `top` best
    alternatives (values [B, top], ids [B, top]), on the logits' device."""
    lp = torch.log_softmax(logits.to(torch.float64), dim=-1)
    chosen = lp.gather(1, tokens[:, None].to(torch.int64))[:, 0]
    if not top:
        empty = lp[:, :0]
        return chosen, empty, empty.to(torch.int64)
    v, i = torch.topk(lp, top, dim=-1)
    return chosen, v, i


# -- one row on the host: what the CPU reference backend and the engine call --------------------------------


def _one(params: SamplingParams, position: int, device: torch.device) -> Rows:
    return rows_of([params], [position], device)


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int,
                 seen: Sequence[int] | None = None, *, history: Sequence[int] = (), prompt_len: int = 0) -> int:
    """The token for `position` (its index in the sequence) from one row of logits [vocab]. `history`: every token
    before it (the prompt's `prompt_len`, then the output so far), which the repetition, frequency and presence
    penalties read; `seen` overrides the repetition penalty's set."""
    row = logits.detach()[None]
    mask = None if seen is None else torch.tensor([list(seen) or [-1]], dtype=torch.int64, device=row.device)
    adjust = Adjust.of([params], [history], [prompt_len], row.shape[-1], row.device)
    return int(sample(row, _one(params, position, row.device), seen=mask, adjust=adjust)[0])


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution of one row [vocab] float64 after temperature, min_p, top_k and top_p."""
    row = logits.detach()[None]
    return distribution(row, _one(params, 0, row.device))[0]


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The log-probability of `token` under the raw model distribution, and the `top` best alternatives."""
    row = logits.detach()[None]
    lp, v, i = logprobs(row, torch.tensor([token], device=row.device), top)
    alts = tuple((int(a), float(b)) for a, b in zip(i[0].tolist(), v[0].tolist(), strict=True))
    return float(lp[0]), alts
