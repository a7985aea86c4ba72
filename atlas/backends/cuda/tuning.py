"""The CUDA backend's arrangement of a step: which implementation each part uses.

`Tuning()` is the fastest arrangement measured (docs/PERFORMANCE.md: H100, qwen4exp-2p7b bf16, decode b1 3.09 ms
in 733 kernels, prefill 2,048 tokens 23.9 ms), what every entry point uses without flags. Each field is one part
of it, on (the default) or off (plain torch); `EAGER`, every part off, is the reference arrangement: the layer
stack an op at a time, no torch.compile, no Triton kernel but the GDN one (`CudaBackend(kernels=)`), which the
fp32 parity mode and a backend on a CPU device take when no tuning is given. A part off computes the same step up
to rounding (each kernel is tested against the torch path on random inputs, each part against the layer stack:
tests/test_cuda_tuning.py, tests/test_cuda_regions.py), so the fields let a test or a debugging session switch one
part at a time. Batch invariance is not a tuning but a backend mode (`cuda-invariant`: every decode group padded
to one shape, atlas.backends.cuda.runner). The arrangements measured and rejected are listed in
docs/PERFORMANCE.md.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Tuning:
    # the decode groups and prefill chunks of hyper-connection models as regions (atlas.backends.cuda.regions): the
    # layer stack cut at the state writes, each piece between two writes one function (off: the shared layer stack
    # of atlas.backends.decoder, an op at a time)
    regions: bool = True
    # the regions through torch.compile with Inductor's combo kernels (one compiled graph per region kind, a decode
    # group's prologue, PLE layers and columns as regions too, a prefill chunk's token dimension symbolic); inside
    # them a one-row decode group's small products as reductions with a long K's sum split (primitives.linear) and a
    # prefill chunk's causal convs as one time-major Triton kernel each on a CUDA device (off: the regions eagerly,
    # bit for bit the layer stack's result)
    compile: bool = True
    # the routed experts through the device-routed grouped Triton kernels (atlas_kernels.moe_grouped; no host sync,
    # each chosen expert's weights read once, in place), decode and prefill (off: decode gathers the chosen experts'
    # weights or runs every expert on every row; prefill groups by expert with one host sync a layer)
    moe_kernels: bool = True
    # a dense decode group's attention through the split-K Triton kernel over the KV pools in place
    # (atlas_kernels.paged_attention; QSA-selected groups take sdpa), a prefill chunk's through
    # F.scaled_dot_product_attention (off: materialised fp32 scores)
    attention_kernels: bool = True
    # a prefill chunk's eager causal convs through cuDNN's depthwise conv1d (never in the batch-invariant modes:
    # primitives.conv_step) (off: the reference's fp32 windowed product)
    library_conv: bool = True
    # prefill chunks of a recurring shape replayed from CUDA graphs (the chunk's key blocks rounded up to a power of
    # two, a shape captured the second time it is fed, at most graphs.PREFILL_GRAPHS shapes); needs moe_kernels
    # (no host sync)
    prefill_graphs: bool = True

    def __attrs_post_init__(self) -> None:
        if self.prefill_graphs and not self.moe_kernels:
            raise ValueError("Tuning.prefill_graphs captures prefill chunks in CUDA graphs, and with moe_kernels off "
                             "the prefill MoE syncs with the host every layer: turn moe_kernels on or prefill_graphs "
                             "off")


# the reference arrangement: every part plain torch
EAGER = Tuning(regions=False, compile=False, moe_kernels=False, attention_kernels=False, library_conv=False,
               prefill_graphs=False)

# the arrangements a user picks by name (`--tuning`, `atlas bench gpu --variants`): the default and the reference
TUNINGS: dict[str, Tuning] = {"default": Tuning(), "eager": EAGER}
