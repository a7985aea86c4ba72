"""EngineConfig (the few knobs a user sets) and Capacities (every size, derived once from them and the model).

Sizes that must agree (chunk width vs per-layer scratch rows vs QSA index capacity vs KV blocks) are never
set independently: `derive_capacities` computes all of them in one place, an override below its derived
floor is refused at load naming both numbers, and the derived table is logged at start.
"""

from __future__ import annotations

import math
import os
from typing import Any

import attrs

from atlas.errors import CapacityError


def _positive(_inst: object, attr: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 1:
        raise CapacityError(f"{attr.name} must be >= 1, got {value}")


DRAFTERS = ("mtp", "ngram", "scripted")
MAX_DRAFTS = 8


def _check_drafter(_inst: object, _attr: attrs.Attribute, value: str) -> None:
    if value not in DRAFTERS:
        raise CapacityError(f"drafter must be one of {', '.join(DRAFTERS)}, got {value!r}")


def _check_drafts(_inst: object, _attr: attrs.Attribute, value: int) -> None:
    if not 0 <= value <= MAX_DRAFTS:
        raise CapacityError(f"num_drafts must be in [0, {MAX_DRAFTS}] (0 turns speculation off), got {value}")


def _non_negative(_inst: object, attr: attrs.Attribute, value: int | None) -> None:
    if value is not None and value < 0:
        raise CapacityError(f"{attr.name} must be >= 0, got {value}")


def _cost_rows(value: Any) -> tuple[tuple[int, tuple[float, ...]], ...] | None:
    if value is None:
        return None
    return tuple((int(batch), tuple(float(c) for c in costs)) for batch, costs in value)


@attrs.frozen
class EngineConfig:
    """What a user sets. Everything else is derived by `derive_capacities`."""

    max_seq_len: int = attrs.field(default=4096, validator=_positive)
    max_batch_size: int = attrs.field(default=64, validator=_positive)
    # the per-step token budget: decodes take one token each, prefill chunks share the rest
    prefill_chunk_tokens: int = attrs.field(default=2048, validator=_positive)
    # prefill chunks end at multiples of this many prompt tokens (or the prompt's end, or a branch point), so a
    # prompt is chunked the same way under any load (atlas.engine.scheduler). None: on for the batch-invariant
    # backends (derived: the largest multiple of block_size that fits beside a full batch of decodes, 1,984 at
    # the defaults), off elsewhere, where chunks follow the budget the other sequences leave (a chunk never
    # waits a step for room: better TTFT under load); 0: off
    prefill_align: int | None = attrs.field(default=None, validator=_non_negative)
    block_size: int = attrs.field(default=16, validator=_positive)
    num_kv_blocks: int | None = attrs.field(default=None, validator=_positive)  # None = derived
    max_waiting: int = attrs.field(default=1024, validator=_positive)  # bound of the waiting queue
    # later issues: speculative decoding (drafts per verify), the SSM snapshot ring, its interval
    num_drafts: int = attrs.field(default=0, validator=_check_drafts)  # drafts per verify; 0 = speculation off
    drafter: str = attrs.field(default="mtp", validator=_check_drafter)  # "mtp" | "ngram" | "scripted"
    # boundary snapshots per sequence (0: no ring, every rollback declines), taken at the prompt's end and
    # every snapshot_interval tokens past it
    ring_slots: int = attrs.field(default=0, validator=_non_negative)
    snapshot_interval: int = attrs.field(default=64, validator=_positive)
    # the content-loop watchdog (atlas.engine.watchdog): off by default; its thresholds, and how many
    # rollbacks one request may take before a loop ends it with `stop`
    loop_watchdog: bool = False
    watchdog_max_period: int = attrs.field(default=64, validator=_positive)
    watchdog_min_repeats: int = attrs.field(default=8, validator=_positive)
    watchdog_min_span: int = attrs.field(default=256, validator=_positive)
    watchdog_window: int = attrs.field(default=768, validator=_positive)
    max_rollbacks: int = attrs.field(default=2, validator=_non_negative)
    # overrides of derived sizes (None = derived); each is checked against its floor
    qsa_index_capacity: int | None = attrs.field(default=None, validator=_positive)
    # PLE: slots of the n-gram row cache (a table larger than the n-gram budget is served through it; floor:
    # max_batch_tokens x n-gram heads) and the scratch rows a PLE layer is sized for (floor: max_batch_tokens)
    ngram_cache_slots: int | None = attrs.field(default=None, validator=_positive)
    ple_scratch_rows: int | None = attrs.field(default=None, validator=_positive)
    # prefix caching (atlas.state.prefix_index): off by default because a config without the field (every
    # trace recorded before it) must replay as recorded; `atlas serve` and `atlas generate` turn it on.
    # prefix_snapshots: recurrent snapshots the cache keeps (LRU; None = derived, 4 x max_batch_size).
    enable_prefix_caching: bool = False
    prefix_snapshots: int | None = attrs.field(default=None, validator=_positive)
    # the MTP drafter's prompt context: the drafter is prefilled over the prompt, and a finished turn's rows
    # are carried to the next warm turn. One switch for both (carry without prefill is unreachable); resolved
    # from ATLAS_NO_MTP_DRAFTER_CONTEXT at engine start (resolve_drafter_context)
    drafter_context: bool = True
    # the drafts each step verifies are chosen from 0..num_drafts by a cost model (atlas.engine.drafters.policy):
    # ((batch, (a step with 1 draft over a plain decode step, 2 drafts, ...)), ...). None: measured by the backend
    # when the engine is built (build_engine) and recorded here, so a replay decides as the run did; (): no cost
    # model, every step verifies num_drafts (what a trace recorded before the policy did)
    verify_costs: tuple[tuple[int, tuple[float, ...]], ...] | None = attrs.field(default=None, converter=_cost_rows)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> EngineConfig:
        known = {f.name for f in attrs.fields(cls)}
        knobs = {k: v for k, v in d.items() if k in known}
        # a config recorded before aligned prefill chunks chunked by the budget alone: replay it that way
        knobs.setdefault("prefill_align", 0)
        # ... and one recorded before the draft-count policy verified num_drafts every step
        knobs.setdefault("verify_costs", ())
        return cls(**knobs)


@attrs.frozen
class Capacities:
    """Every size the engine and the backends use, derived from EngineConfig and the model spec."""

    max_seq_len: int
    max_batch_size: int
    max_batch_tokens: int  # tokens fed per step, all sequences together
    block_size: int
    num_kv_blocks: int
    kv_blocks_per_seq: int  # blocks one sequence of max_seq_len needs (sizes the CUDA block tables)
    verify_width: int  # num_drafts + 1: rows per verify, and per-token intermediates a backend holds per sequence
    drafter: str  # "" when speculation is off
    drafter_rows: int  # MTP drafter pair keys one sequence may hold (max_seq_len - 1), 0 without an MTP drafter
    qsa_index_capacity: int  # raw index keys one sequence may hold
    qsa_ratio: int  # tokens per pooled QSA block (1 when the model has no QSA layers)
    qsa_budget: int  # tokens QSA selects from complete blocks (0 = no QSA)
    num_qsa_layers: int  # whether the QSA inert bound applies (the speculative lane's latch)
    ngram_size: int  # PLE n-gram order (0 = no PLE): a prefill chunk carries the previous ngram_size-1 tokens
    ring_slots: int
    snapshot_interval: int
    max_waiting: int
    # one ring slot: GDN conv + recurrent state of every GDN layer, PLE context + short-conv state (KV, QSA
    # keys and drafter rows are positional: a restore only moves their cursors). The backends size their ring and
    # prefix-snapshot storage by it and refuse a snapshot of another size. Defaults: older traces.
    ring_slot_bytes: int = 0
    prefix_caching: bool = False
    prefix_snapshots: int = 0  # recurrent snapshots the prefix cache keeps (0: prefix caching off)
    drafter_context: bool = True  # MTP drafter prefilled over the prompt and carried across turns
    prefill_align: int = 0  # prefill chunks end at multiples of it (0: off; the default of older traces)
    # PLE (0 without it): n-gram ids a token has per PLE layer; the row cache's slots per PLE layer (at least
    # max_batch_tokens x ngram_heads: one step's rows are all resident at once); a PLE layer's scratch rows (the
    # most tokens one step feeds it: at least max_batch_tokens, checked again where a backend is built)
    ngram_heads: int = 0
    ngram_cache_slots: int = 0
    ple_scratch_rows: int = 0

    def table(self) -> dict[str, int | str]:
        return attrs.asdict(self)

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> Capacities:
        """A trace's recorded capacities; fields an older engine derived and this one does not are dropped."""
        known = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in table.items() if k in known})


def _spec_get(spec: Any, name: str, default: Any) -> Any:
    value = getattr(spec, name, None) if spec is not None else None
    if value is None and isinstance(spec, dict):
        value = spec.get(name)
    return default if value is None else value


@attrs.frozen
class _ModelShape:
    attention: int = 0
    qsa: int = 0
    gdn: int = 0
    qsa_ratio: int = 1
    qsa_budget: int = 0
    ngram_size: int = 0
    max_positions: int | None = None
    ngram_heads: int = 0


def _model_shape(spec: Any) -> _ModelShape:
    """What capacities need from a model: atlas.model.ModelSpec, or a config.json-shaped object/dict."""
    if spec is None:
        return _ModelShape()
    layer_types = list(_spec_get(spec, "layer_types", []))
    gdn = sum(1 for t in layer_types if t == "linear_attention")
    attention = len(layer_types) - gdn
    qsa_spec = getattr(spec, "qsa", None)  # ModelSpec: QsaSpec on every full-attention layer, or None
    ple_spec = getattr(spec, "ple", None)
    if qsa_spec is not None:
        qsa, ratio, budget = attention, int(qsa_spec.ratio), int(qsa_spec.budget)
    elif _spec_get(spec, "indexer_n_heads", None) is not None:  # config.json shape
        qsa = attention
        ratio, budget = int(_spec_get(spec, "indexer_compress_ratio", 1)), int(_spec_get(spec, "indexer_budget", 0))
    else:
        qsa, ratio, budget = 0, 1, 0
    if ple_spec is not None:
        ngram, heads = int(ple_spec.ngram_size), int(ple_spec.num_heads)
    elif _spec_get(spec, "ple_layer_ids", []):
        ngram = int(_spec_get(spec, "ngram_size", 3))
        heads = (ngram - 1) * int(_spec_get(spec, "heads_per_ngram", 8))
    else:
        ngram, heads = 0, 0
    return _ModelShape(attention, qsa, gdn, ratio, budget, ngram, _spec_get(spec, "max_position_embeddings", None),
                       heads)


def _check_floor(name: str, value: int | None, floor: int, why: str) -> int:
    if value is None:
        return floor
    if value < floor:
        raise CapacityError(f"{name} {value} is below its derived floor {floor} ({why})")
    return value


def ring_slot_bytes(spec: Any, activation_bytes: int = 2) -> int:
    """Bytes of one boundary snapshot for a ModelSpec (0 for anything else): conv and PLE state in the
    activation dtype, the GDN recurrent state in fp32 (or wider, like the data plane keeps it)."""
    gdn_layers = getattr(spec, "gdn_layers", None)
    if gdn_layers is None:
        return 0
    recurrent = spec.gdn_v_heads * spec.gdn_k_dim * spec.gdn_v_dim * max(4, activation_bytes)
    conv = spec.gdn_conv_dim * spec.gdn_conv_kernel * activation_bytes
    total = len(gdn_layers) * (recurrent + conv)
    ple = getattr(spec, "ple", None)
    if ple is not None:
        streams = max(1, spec.hc_count) * spec.hidden_size
        total += ple.context_len * 8 + len(ple.layers) * streams * ple.conv_state_len * activation_bytes
    return total


def derive_capacities(config: EngineConfig, spec: Any = None, *, activation_bytes: int = 2,
                      batch_invariant: bool = False) -> Capacities:
    """Derive every size once. `spec` is the model's spec (attributes as in its config.json) or None;
    `activation_bytes` is the data plane's element size (2 for bf16), for the ring's memory."""
    shape = _model_shape(spec)
    max_pos = shape.max_positions
    if max_pos is not None and config.max_seq_len > max_pos:
        raise CapacityError(
            f"max_seq_len {config.max_seq_len} exceeds the model's max_position_embeddings {max_pos}"
        )
    if config.max_seq_len < 2:
        raise CapacityError(f"max_seq_len {config.max_seq_len} is below its floor 2 (a prompt and one token)")
    # a step must be able to feed one decode token for every running sequence
    if config.prefill_chunk_tokens < config.max_batch_size:
        raise CapacityError(
            f"prefill_chunk_tokens {config.prefill_chunk_tokens} is below its floor "
            f"max_batch_size {config.max_batch_size} (one decode token per running sequence)"
        )
    if config.loop_watchdog and config.watchdog_window < config.watchdog_min_span:
        raise CapacityError(f"watchdog_window {config.watchdog_window} is below watchdog_min_span "
                            f"{config.watchdog_min_span}: no loop could ever be seen")
    kv_blocks_per_seq = math.ceil(config.max_seq_len / config.block_size)
    num_kv_blocks = config.num_kv_blocks
    if num_kv_blocks is None:
        num_kv_blocks = kv_blocks_per_seq * config.max_batch_size
    _check_floor(
        "num_kv_blocks",
        num_kv_blocks,
        kv_blocks_per_seq,
        f"one sequence of max_seq_len {config.max_seq_len} in blocks of {config.block_size}",
    )
    verify_width = config.num_drafts + 1
    max_batch_tokens = config.prefill_chunk_tokens
    prefill_align = _prefill_align(config, max_batch_tokens, verify_width, batch_invariant)
    qsa_index_capacity = _check_floor(
        "qsa_index_capacity",
        config.qsa_index_capacity,
        config.max_seq_len,
        f"max_seq_len {config.max_seq_len}: every token's raw index key is kept",
    )
    scratch_rows, cache_slots = _ple_sizes(config, max_batch_tokens, shape.ngram_heads)
    return Capacities(
        max_seq_len=config.max_seq_len,
        max_batch_size=config.max_batch_size,
        max_batch_tokens=max_batch_tokens,
        block_size=config.block_size,
        num_kv_blocks=num_kv_blocks,
        kv_blocks_per_seq=kv_blocks_per_seq,
        verify_width=verify_width,
        drafter=config.drafter if config.num_drafts else "",
        drafter_rows=config.max_seq_len - 1 if config.num_drafts and config.drafter == "mtp" else 0,
        qsa_index_capacity=qsa_index_capacity,
        qsa_ratio=shape.qsa_ratio,
        qsa_budget=shape.qsa_budget,
        num_qsa_layers=shape.qsa,
        ngram_size=shape.ngram_size,
        ring_slots=config.ring_slots,
        snapshot_interval=config.snapshot_interval,
        ring_slot_bytes=ring_slot_bytes(spec, activation_bytes),
        max_waiting=config.max_waiting,
        prefix_caching=config.enable_prefix_caching,
        prefix_snapshots=(config.prefix_snapshots or 4 * config.max_batch_size) if config.enable_prefix_caching else 0,
        drafter_context=config.drafter_context,
        prefill_align=prefill_align,
        ngram_heads=shape.ngram_heads,
        ngram_cache_slots=cache_slots,
        ple_scratch_rows=scratch_rows,
    )


def _ple_sizes(config: EngineConfig, max_batch_tokens: int, heads: int) -> tuple[int, int]:
    """(PLE scratch rows, n-gram row cache slots): the widest step's tokens, and every n-gram row of it resident at
    once (derived: that rounded up to a power of two). Both 0 without PLE."""
    if not heads:
        return 0, 0
    scratch = _check_floor("ple_scratch_rows", config.ple_scratch_rows, max_batch_tokens,
                           f"max_batch_tokens {max_batch_tokens}: the most tokens one step feeds a PLE layer")
    floor = max_batch_tokens * heads
    slots = config.ngram_cache_slots
    if slots is None:
        return scratch, 1 << (floor - 1).bit_length()
    return scratch, _check_floor("ngram_cache_slots", slots, floor,
                                 f"max_batch_tokens {max_batch_tokens} x {heads} n-gram heads: one step's rows "
                                 "all resident at once")


def check_ple_capacities(caps: Capacities) -> None:
    """At load (a backend built from `caps`): the PLE scratch and the row cache hold the widest step. One error
    naming both numbers."""
    if not caps.ngram_heads:
        return
    if caps.ple_scratch_rows < caps.max_batch_tokens:
        raise CapacityError(f"ple_scratch_rows {caps.ple_scratch_rows} is below its floor max_batch_tokens "
                            f"{caps.max_batch_tokens}: a step that wide could not be fed to a PLE layer")
    floor = caps.max_batch_tokens * caps.ngram_heads
    if caps.ngram_cache_slots < floor:
        raise CapacityError(f"ngram_cache_slots {caps.ngram_cache_slots} is below its floor {floor} (max_batch_tokens "
                            f"{caps.max_batch_tokens} x {caps.ngram_heads} n-gram heads)")


def _prefill_align(config: EngineConfig, max_batch_tokens: int, verify_width: int, batch_invariant: bool) -> int:
    """The prefill chunk alignment: at most what a step's budget leaves beside every other sequence's verify (so
    an aligned chunk always fits beside them); derived (for a batch-invariant backend, when not set) as the
    largest multiple of block_size under that (chunk ends then fall on full KV blocks, which the prefix cache can
    match), 0 (off) when not even one block fits."""
    ceiling = max_batch_tokens - (config.max_batch_size - 1) * verify_width
    if config.prefill_align is None:
        if not batch_invariant:
            return 0
        return max(0, ceiling) // config.block_size * config.block_size
    if config.prefill_align > ceiling:
        raise CapacityError(
            f"prefill_align {config.prefill_align} is above its ceiling {ceiling} (prefill_chunk_tokens "
            f"{max_batch_tokens} less one verify of {verify_width} tokens for each of the other "
            f"{config.max_batch_size - 1} sequences: a chunk that large could wait forever); 0 turns alignment off"
        )
    return config.prefill_align


NO_DRAFTER_CONTEXT_ENV = "ATLAS_NO_MTP_DRAFTER_CONTEXT"
# the opt-in switches the drafter context replaced: ignored, and warned about at start, so a stale launch script
# cannot leave an operator believing its value took effect
OBSOLETE_DRAFTER_ENVS = ("ATLAS_MTP_DRAFTER_PREFILL", "ATLAS_MTP_CARRY_DRAFTER")


def resolve_drafter_context(config: EngineConfig, environ: Any = None) -> EngineConfig:
    """The drafter-context switch, resolved once at engine start: only ATLAS_NO_MTP_DRAFTER_CONTEXT=1
    disables it (prefill and carry together); any other value, or none, leaves the config as it is."""
    env = os.environ if environ is None else environ
    for name in OBSOLETE_DRAFTER_ENVS:
        if name in env:
            _log().warning("obsolete switch ignored: the MTP drafter context (prefill and carry) is on by default; "
                           f"{NO_DRAFTER_CONTEXT_ENV}=1 turns it off", switch=name, value=env[name])
    if env.get(NO_DRAFTER_CONTEXT_ENV) == "1" and config.drafter_context:
        config = attrs.evolve(config, drafter_context=False)
    if config.num_drafts and config.drafter == "mtp":  # the line means nothing for n-gram or no drafting
        _log().info("MTP drafter context", prefill=config.drafter_context, carry=config.drafter_context,
                 switch=f"{NO_DRAFTER_CONTEXT_ENV}={env.get(NO_DRAFTER_CONTEXT_ENV, '')}")
    return config


def log_capacities(caps: Capacities, *, model: str, backend: str) -> None:
    _log().info("capacities derived", model=model, backend=backend, **caps.table())


def _log():  # structlog is imported on first use: the control plane imports this module and must stay light
    import structlog

    return structlog.get_logger("atlas.config")
