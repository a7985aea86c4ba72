"""Tuning.compile_decode / compile_prefill's Inductor-option modes (atlas.backends.cuda.compiled.INDUCTOR_OPTIONS):
each is a valid Tuning value, a compiled function under one gives the eager values, and the options are scoped to
that function (Inductor's global config is left as it was)."""

from __future__ import annotations

import pytest
import torch

from atlas.backends.cuda import compiled as module
from atlas.backends.cuda.tuning import COMPILE, VARIANTS, Tuning


def test_every_option_mode_is_a_tuning_value_and_the_variants_use_them() -> None:
    assert set(module.INDUCTOR_OPTIONS) <= set(COMPILE)
    for mode in module.INDUCTOR_OPTIONS:
        assert Tuning(compile_decode=mode, compile_prefill=mode).compile_decode == mode
    assert VARIANTS["regions-tuned"].compile_decode == "tuned"
    assert VARIANTS["regions-compile"].compile_prefill == VARIANTS["regions-compile"].compile_decode == "combo"
    assert VARIANTS["regions-no-combo"].compile_decode == "default"
    with pytest.raises(ValueError, match="compile_decode must be one of"):
        Tuning(compile_decode="coordinate")


def test_an_option_mode_compiles_to_the_eager_values_without_touching_the_global_config() -> None:
    import torch._inductor.config as inductor

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # two independent reductions and a mix
        return torch.sigmoid((x * w).sum(-1, keepdim=True)) * x + x.float().pow(2).mean(-1, keepdim=True)

    before = (inductor.coordinate_descent_tuning, inductor.combo_kernels)
    x, w = torch.randn(3, 64), torch.randn(64)
    module._compile.cache_clear()
    torch._dynamo.reset()
    try:
        fn = module.compiled(block, "tuned-combo")
        assert fn is not block
        assert torch.allclose(fn(x, w), block(x, w), atol=1e-6)
    finally:
        module._compile.cache_clear()
        torch._dynamo.reset()
    assert (inductor.coordinate_descent_tuning, inductor.combo_kernels) == before
