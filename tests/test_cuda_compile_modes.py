"""The compiled regions' mode (atlas.backends.cuda.compiled.COMPILE_MODE, Tuning.compile): Inductor's combo kernels
as options scoped to the compiled function; a function compiled under it gives the eager values, and Inductor's
global config is left as it was."""

from __future__ import annotations

import torch

from atlas.backends.cuda import compiled as module


def test_the_mode_is_combo_with_its_options_only() -> None:
    assert module.COMPILE_MODE == "combo"
    assert dict(module.INDUCTOR_OPTIONS[module.COMPILE_MODE]) == {"combo_kernels": True}
    assert module.compiled(torch.sin, "none") is torch.sin  # eager regions: the function itself


def test_the_mode_compiles_to_the_eager_values_without_touching_the_global_config() -> None:
    import torch._inductor.config as inductor

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # two independent reductions, a mix, a dependent norm
        h = torch.sigmoid((x * w).sum(-1, keepdim=True)) * x + x.float().pow(2).mean(-1, keepdim=True)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)

    before = inductor.combo_kernels
    x, w = torch.randn(3, 64), torch.randn(64)
    module._compile.cache_clear()
    torch._dynamo.reset()
    try:
        fn = module.compiled(block, module.COMPILE_MODE)
        assert fn is not block
        assert torch.allclose(fn(x, w), block(x, w), atol=1e-5)
    finally:
        module._compile.cache_clear()
        torch._dynamo.reset()
    assert inductor.combo_kernels == before
