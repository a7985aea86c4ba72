"""`atlas.LLM`: the public entry point for offline use.

    llm = atlas.LLM(model="atlas-tiny")          # or a checkpoint dir
    logits = llm.logits(token_ids, chunk_sizes=[5, 1, 7])   # [T, vocab]

`logits` prefills the sequence in the given chunk widths (one chunk if None) on a fresh sequence and
returns the logits of every position. `generate` runs prompts through the engine (atlas.engine):
continuous batching, chunked prefill, stop conditions, optionally a trace. `backend` is any name of
atlas.registry.BACKENDS that serves a model: "cpu" (the reference) or a CUDA mode ("cuda", "cuda-fp32", ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from atlas.config import EngineConfig, derive_capacities
from atlas.engine.offline import Generation
from atlas.model import LoadedModel, load_model
from atlas.model.tokenizer import Tokenizer
from atlas.plan import SeqWork
from atlas.sampling.params import SamplingParams

_LOGITS_SEQ_ID = -1  # the scratch sequence `logits` runs on; engine sequences are never negative


class LLM:
    def __init__(
        self,
        model: str | Path = "atlas-tiny",
        backend: str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        block_size: int = 16,
        num_kv_blocks: int = 256,
        threads: int | None = None,
    ) -> None:
        """`threads`: torch CPU threads, by the policy of atlas/threads.py (explicit, else OMP_NUM_THREADS,
        else 1: measured best for the exact path on a small machine). Logs go to stderr unless the caller
        configured structlog itself."""
        from atlas.cli_support import logs_to_stderr
        from atlas.registry import BACKENDS, data_plane
        from atlas.threads import apply_threads

        if backend not in BACKENDS or backend == "null":
            raise ValueError(f"backend {backend!r} cannot serve a model; one of "
                             f"{', '.join(b for b in BACKENDS if b != 'null')}")
        logs_to_stderr(force=False)
        self.threads = apply_threads(threads)
        self.model: LoadedModel = load_model(model, dtype=dtype)
        self._model_arg = str(model)  # what a trace records, so that a replay loads the same model
        self._backend_name = backend
        self._dtype = dtype
        # the backend `logits` runs on: sized for one scratch sequence of num_kv_blocks blocks
        config = EngineConfig(max_seq_len=min(num_kv_blocks * block_size, self.model.spec.max_position_embeddings
                                              or num_kv_blocks * block_size),
                              max_batch_size=1, prefill_chunk_tokens=max(1, num_kv_blocks * block_size),
                              block_size=block_size, num_kv_blocks=num_kv_blocks)
        derive_capacities(config, self.model.spec)  # refuses a size the model cannot take, naming it
        self.backend = data_plane(self._model_arg, backend, config, loaded=self.model,
                                  **({"dtype": dtype} if backend == "cpu" else {})).backend

    @property
    def tokenizer(self) -> Tokenizer:
        return self.model.tokenizer

    def _chunks(self, total: int, chunk_sizes: Sequence[int] | None) -> list[int]:
        sizes = [total] if chunk_sizes is None else list(chunk_sizes)
        if any(s <= 0 for s in sizes) or sum(sizes) != total:
            raise ValueError(f"chunk_sizes {sizes} must be positive and sum to the {total} tokens")
        return sizes

    def logits(self, token_ids: Sequence[int], chunk_sizes: Sequence[int] | None = None) -> torch.Tensor:
        """Prefill `token_ids` in `chunk_sizes` widths on a fresh sequence: logits [T, vocab]."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("token_ids is empty")
        block_size = self.backend.block_size
        needed = -(-len(ids) // block_size)
        blocks = self.backend.num_kv_blocks
        if needed > blocks:
            raise ValueError(f"{len(ids)} tokens need {needed} KV blocks of {block_size}; num_kv_blocks is {blocks}")
        table = tuple(range(needed))
        rows, start = [], 0
        try:
            for width in self._chunks(len(ids), chunk_sizes):
                chunk = SeqWork(_LOGITS_SEQ_ID, tuple(ids[start : start + width]), start, table, sample=False)
                rows.append(self.backend.forward([chunk])[0].float().cpu())
                start += width
        finally:
            self.backend.release(_LOGITS_SEQ_ID)
        return torch.cat(rows, dim=0)

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        config: EngineConfig | None = None,
        trace: str | None = None,
    ) -> list[Generation]:
        """Generate for a prompt, prompts, or token-id lists: per request token ids, text, finish reason.

        Each call runs a fresh engine (its own KV pool; `trace` records it as one run)."""
        from atlas.engine.offline import generate as run_generate
        from atlas.registry import build_engine

        if isinstance(prompts, str):
            prompts = [prompts]
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        config = config or EngineConfig(max_seq_len=2048, max_batch_size=16, prefill_chunk_tokens=512)
        engine = build_engine(self._model_arg, self._backend_name, config, trace=trace, loaded=self.model,
                              dtype=self._dtype if self._backend_name == "cpu" else None)
        try:
            return run_generate(engine, token_lists, params or SamplingParams())
        finally:
            engine.close()
