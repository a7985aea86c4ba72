"""Triton kernels for the CUDA backend, importable as `atlas_kernels`.

Each kernel has a reference in the CPU backend it is tested against on random inputs.
"""
