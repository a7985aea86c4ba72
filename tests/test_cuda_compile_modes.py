"""Tuning.compile_decode / compile_prefill's Inductor-option modes (atlas.backends.cuda.compiled.INDUCTOR_OPTIONS):
each is a valid Tuning value, a compiled function under one gives the eager values, and the options are scoped to
that function (Inductor's global config is left as it was)."""

from __future__ import annotations

import re

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


@pytest.mark.parametrize("mode", ["tuned-combo", "combo-pdl"])
def test_an_option_mode_compiles_to_the_eager_values_without_touching_the_global_config(mode: str) -> None:
    """combo-pdl (variant regions-pdl): on the CPU Inductor writes C++ (PDL is a Triton / sm_90 matter), so what is
    tested here is that torch.compile takes the option; its PDL kernels are tested on the GPU by
    test_compiled_regions_give_the_reference_tokens_on_the_gpu[regions-pdl]."""
    import torch._inductor.config as inductor

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # two independent reductions, a mix, a dependent norm
        h = torch.sigmoid((x * w).sum(-1, keepdim=True)) * x + x.float().pow(2).mean(-1, keepdim=True)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)

    def config() -> tuple[bool, ...]:
        return inductor.coordinate_descent_tuning, inductor.combo_kernels, inductor.triton.enable_pdl

    before = config()
    x, w = torch.randn(3, 64), torch.randn(64)
    module._compile.cache_clear()
    torch._dynamo.reset()
    try:
        fn = module.compiled(block, mode)
        assert fn is not block
        assert torch.allclose(fn(x, w), block(x, w), atol=1e-5)
    finally:
        module._compile.cache_clear()
        torch._dynamo.reset()
    assert config() == before


def test_combo_persistent_makes_inner_reductions_of_up_to_2048_persistent_and_defers_the_rest() -> None:
    """compile mode "combo-persistent" (compiled.PERSISTENT_INNER): its Inductor choices call an inner reduction of
    up to 2,048 elements persistent (Inductor's own limit is 1,024: a hyper site's per-stream norm of H = 2,048 looped,
    then a second kernel re-read the streams), and give Inductor's answer for everything else."""
    import sympy
    from torch._inductor.choices import InductorChoices
    from torch._inductor.runtime.hints import ReductionHint
    from torch._inductor.virtualized import V

    class Sizes:
        @staticmethod
        def statically_known_leq(a, b):  # type: ignore[no-untyped-def]
            return bool(sympy.sympify(a) <= sympy.sympify(b))

    class Graph:
        sizevars = Sizes()

    class Features:
        def __init__(self, hint: ReductionHint, numel: int) -> None:
            self.hint, self.reduction_numel, self.numel = hint, sympy.Integer(numel), sympy.Integer(64)

        def get_reduction_hint(self) -> ReductionHint:
            return self.hint

    choices = module._persistent_choices(module.PERSISTENT_INNER)
    with V.set_graph_handler(Graph()):  # type: ignore[arg-type]
        decide = choices.should_use_persistent_reduction
        assert decide(Features(ReductionHint.INNER, 2048), False)
        assert decide(Features(ReductionHint.INNER, 512), False)
        for hint, numel in ((ReductionHint.INNER, 4096), (ReductionHint.OUTER, 2048), (ReductionHint.OUTER, 32)):
            feats = Features(hint, numel)
            assert decide(feats, False) == InductorChoices.should_use_persistent_reduction(feats, False)
        assert not decide(Features(ReductionHint.INNER, 4096), False)
        assert not InductorChoices.should_use_persistent_reduction(Features(ReductionHint.INNER, 2048), False)


def test_combo_persistent_sets_its_choices_only_inside_the_call_and_computes_the_eager_values() -> None:
    from torch._inductor.virtualized import V

    seen = []
    choices = module._persistent_choices(module.PERSISTENT_INNER)

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(V.choices)
        return x + 1

    wrapped = module._with_choices(probe, choices)
    assert torch.equal(wrapped(torch.zeros(2)), torch.ones(2))
    assert seen == [choices] and V.choices is not choices

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # a row norm over 2,048 elements, then its use
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * w

    x, w = torch.randn(3, 2048), torch.randn(2048)
    module._compile.cache_clear()
    torch._dynamo.reset()
    try:
        fn = module.compiled(block, "combo-persistent")
        assert torch.allclose(fn(x, w), block(x, w), atol=1e-5)
    finally:
        module._compile.cache_clear()
        torch._dynamo.reset()
    assert V.choices is not choices


def test_combo_pdl_is_combo_with_inductors_pdl_option_in_regions_pdl() -> None:
    assert dict(module.INDUCTOR_OPTIONS["combo-pdl"]) == {"combo_kernels": True, module.PDL_OPTION: True}
    assert VARIANTS["regions-pdl"].compile_decode == VARIANTS["regions-pdl"].compile_prefill == "combo-pdl"


def test_combo_pdl_without_inductors_option_is_one_line_naming_the_mode_and_torch(monkeypatch: pytest.MonkeyPatch
                                                                                   ) -> None:
    assert module._inductor_knows(module.PDL_OPTION) and module._inductor_knows("combo_kernels")
    assert not module._inductor_knows("triton.no_such_option")
    monkeypatch.setattr(module, "_inductor_knows", lambda option: False)  # an Inductor without the option
    module._compile.cache_clear()
    try:
        want = f"compile mode 'combo-pdl' needs Inductor's triton.enable_pdl option, which torch {torch.__version__}"
        with pytest.raises(ValueError, match=re.escape(want)) as info:
            module.compiled(lambda x: x + 1, "combo-pdl")
        assert "\n" not in str(info.value)
    finally:
        module._compile.cache_clear()
