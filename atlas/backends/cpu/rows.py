"""Row-exact batched math: several rows through one op call, each row's bits those of a one-row call.

The exact CPU reference's bits must depend only on a token and its prefix, never on how many rows an op saw
(commit and rollback are checked bitwise against a token-by-token decode). Two things break that when rows go
through an op together, both measured on this backend (fp32, one thread):
- a 1-row product `x @ w.T` is a GEMV; an n-row one is a GEMM, whose reduction order differs in the last bit for
  every row. A batched product of n one-row GEMVs (`torch.bmm` over an expanded weight) gives each row exactly
  the one-row product's bits, at about the cost of the GEMM for these sizes (3 rows of 256 x 4096: 188 us vs
  176 us, where 3 separate products take 199 us). Below 400 multiply-adds a batch element, torch's bmm takes a
  naive loop of its own instead: such a tiny product (atlas-tiny's gate projections) is computed row by row.
- an elementwise transcendental (exp, sigmoid, silu, softplus) takes its vectorised kernel in the SIMD body of
  a contiguous tensor (whole steps of two vectors) and its scalar kernel in the tail, which differ in the last
  bit. A row whose width is a multiple of 64 lands wholly in the body whatever the row count. A row narrower
  than one step (a GDN head's gates, the hyper mixers' low rank, a router's experts) is wholly in the tail when
  it is alone: n of them go through the scalar kernel together as a strided view (torch runs a non-contiguous
  operand through the scalar loop). Rows that are views apart (parts of a joined product,
  atlas.backends.cpu.weights) are each their own inner loop, split as a lone row's is. Any other width goes row
  by row. exp and softmax over the last dim give every row its own bits at any row count (measured) and need
  none of this.
`CHUNK` is the plain arithmetic of whole chunks (exact=False): one GEMM, agreeing to ~1e-6.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import torch

_BODY = 64  # a row this wide (a multiple of every SIMD step) never reaches a tail
_NAIVE_BMM = 400  # torch's bmm computes a batch element of fewer multiply-adds with its own naive kernel
# the vectorised loop's step (two vectors of fp32) per CPU capability; a one-row op narrower than this is scalar
_STEP = {"AVX512": 32, "AVX2": 16}.get(torch.backends.cpu.get_cpu_capability(), 0)


@attrs.frozen
class RowMath:
    exact: bool

    def mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [n, K] @ w.T [K, N]; with `exact`, each row as the one-row product computes it."""
        n = len(x)
        if not self.exact or n == 1:
            return x @ w.T
        views = getattr(w, "_rows_expanded", None)  # w.T expanded to [n, K, N] per n, kept on the weight
        view = None if views is None else views.get(n)
        if view is None:
            if w.numel() < _NAIVE_BMM:
                return torch.cat([r @ w.T for r in x.split(1)])
            view = w.T.expand(n, -1, -1)
            if w._base is None:  # a weight tensor of its own, not a view made for this call (an expert's slice)
                if views is None:
                    views = w._rows_expanded = {}
                views[n] = view
        return torch.bmm(x.unsqueeze(1), view).squeeze(1)

    def each(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """fn, one elementwise op, over x [n, ...]; with `exact`, each row's bits those of fn over that row alone.
        A row that is a view apart from the next (a part of a joined product: its row stride is not its width)
        is its own inner loop already, with a one-row op's split into SIMD body and scalar tail."""
        shape = x.shape
        if not self.exact or shape[0] == 1:
            return fn(x)
        width = math.prod(shape[1:])
        if width % _BODY == 0 or (len(shape) == 2 and x.stride(1) == 1 and x.stride(0) != width):
            return fn(x)
        if width < _STEP:
            strided = torch.empty(*shape, 2, dtype=x.dtype)
            strided[..., 0] = x
            return fn(strided[..., 0])
        return torch.cat([fn(r) for r in x.split(1)])


EXACT = RowMath(exact=True)
CHUNK = RowMath(exact=False)
