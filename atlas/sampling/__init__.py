"""Sampling: request parameters (params, torch-free) and the keyed samplers every backend shares."""
