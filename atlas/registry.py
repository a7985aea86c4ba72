"""One registry builds an Engine for every backend name: `build_engine(model, backend, config, ...)`.

Names (what a trace's run row records, so a replay rebuilds the same data plane and numerics):
- "cpu": the reference backend (atlas.backends.cpu);
- "null": no tensors, a deterministic token function (control-plane tests and benchmarks);
- "cuda", "cuda-fp32", "cuda-invariant", "cuda-fp32-invariant": the CUDA backend's modes (bf16 / fp32 parity,
  batch-invariant or not);
- "null-looping", "cpu-looping", "cpu-row-blind": the failure library's scenario backends (below: `SCENARIOS`).
`LLM`, the CLI, the server and replay all build through here; the backend's capabilities are checked
against the config once, in `Engine.__init__` (atlas.backends.base.Capabilities.check).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from atlas.config import Capacities, EngineConfig, derive_capacities, resolve_drafter_context
from atlas.plan import StepPlan, StepResult
from atlas.version import __version__

if TYPE_CHECKING:
    from atlas.engine.engine import Engine
    from atlas.engine.records import EventSink
    from atlas.replay.run_rows import RunRecord

TINY_MODEL = "atlas-tiny"
CUDA_BACKENDS = ("cuda", "cuda-fp32", "cuda-invariant", "cuda-fp32-invariant")
SCENARIO_BACKENDS = ("null-looping", "cpu-looping", "cpu-row-blind")
BACKENDS = ("cpu", "null", *CUDA_BACKENDS, *SCENARIO_BACKENDS)


@attrs.frozen
class DataPlane:
    """A built backend and what the engine needs to know about the model it serves."""

    backend: Any
    tokenizer: Any
    spec: Any
    caps: Capacities
    model_name: str
    fingerprint: str


def _load(model: str, loaded: Any, dtype: Any) -> Any:
    if loaded is not None:
        return loaded
    from atlas.model import load_model

    return load_model(model) if dtype is None else load_model(model, dtype=dtype)


def _cpu(model: str, config: EngineConfig, *, loaded: Any = None, dtype: Any = None, **options: Any) -> DataPlane:
    from atlas.backends.cpu import CpuBackend

    loaded = _load(model, loaded, None)
    caps = derive_capacities(config, loaded.spec, activation_bytes=(dtype or loaded.dtype).itemsize)
    backend = CpuBackend.for_capacities(loaded, caps, dtype=dtype, **options)
    return DataPlane(backend, loaded.tokenizer, loaded.spec, caps, loaded.name, loaded.fingerprint)


def _null(model: str, config: EngineConfig, **_: Any) -> DataPlane:
    from atlas.backends.null import ByteTokenizer, NullBackend

    name = TINY_MODEL if model == TINY_MODEL else Path(model).name
    return DataPlane(NullBackend(), ByteTokenizer(), None, derive_capacities(config, None), name, f"null:{name}")


def _cuda(model: str, config: EngineConfig, *, backend: str, loaded: Any = None, dtype: Any = None,
          **options: Any) -> DataPlane:
    from atlas.backends.cuda.runner import CudaBackend, parse_backend

    act_dtype, invariant = parse_backend(backend)
    loaded = _load(model, loaded, None)
    caps = derive_capacities(config, loaded.spec, activation_bytes=act_dtype.itemsize, batch_invariant=invariant)
    data_plane = CudaBackend.for_capacities(loaded, caps, dtype=act_dtype, batch_invariant=invariant, name=backend,
                                            **options)
    return DataPlane(data_plane, loaded.tokenizer, loaded.spec, caps, loaded.name, loaded.fingerprint)


# The failure library's scenario backends (traces/): data planes that are deterministic and recordable by name, so
# that `atlas replay verify/against` rebuild exactly the engine that recorded a trace.
# - "null-looping": the null backend whose sampler is caught in a content loop (LOOP_TOKEN from position LOOP_FROM
#   on) until a rollback bans the looping token there; then the model's own re-steered token.
# - "cpu-looping": the CPU reference on atlas-tiny with the same scripted loop (real GDN, PLE, QSA and KV state
#   behind every rollback, so a restore that misses one of them shows in that layer's position stamp);
# - "cpu-row-blind": the CPU backend declaring it cannot apply QSA selection per verify row
#   (per_row_qsa_verify=False: it refuses a verify whose rows cross the inert bound, as a backend that attends
#   densely per verify would have to: atlas.backends.base.check_dense_verify), under its own name.
LOOP_TOKEN = 65  # "A": a period-1 loop, the shortest the watchdog can see
LOOP_FROM = 6  # sampled positions from here on loop


def loop(plan: StepPlan, result: StepResult, steered: set[int]) -> StepResult:
    """The scripted loop: every sampled position from LOOP_FROM on samples LOOP_TOKEN, until a rollback bans it
    there; then the model's own token, and the sequence has left the loop (`steered`)."""
    for seq_id in (*plan.release, *plan.reset):
        steered.discard(seq_id)
    outcomes = []
    for work, o in zip(plan.work, result.outcomes, strict=True):
        if o.token is not None and not work.drafts and work.end >= LOOP_FROM and work.seq_id not in steered:
            if LOOP_TOKEN in work.banned:  # the re-steer: the model's own (non-banned) token, loop left
                steered.add(work.seq_id)
            else:
                o = attrs.evolve(o, token=LOOP_TOKEN)
        outcomes.append(o)
    return attrs.evolve(result, outcomes=tuple(outcomes))


def _scenario(model: str, config: EngineConfig, *, backend: str, loaded: Any = None, **options: Any) -> DataPlane:
    """The failure library's backends; the CPU ones take the CPU backend's options (state_audit= included)."""
    from atlas.backends.cpu import CpuBackend
    from atlas.backends.null import ByteTokenizer, NullBackend

    if backend == "null-looping":

        class LoopingNullBackend(NullBackend):
            name = "null-looping"

            def __init__(self) -> None:
                super().__init__()
                self.steered: set[int] = set()  # sequences a rollback re-steered out of the loop

            def execute(self, plan: StepPlan) -> StepResult:
                return loop(plan, super().execute(plan), self.steered)

        caps = derive_capacities(config, None)
        return DataPlane(LoopingNullBackend(), ByteTokenizer(), None, caps, model or TINY_MODEL, f"null:{model}")
    loaded = _load(model, loaded, None)
    caps = derive_capacities(config, loaded.spec, activation_bytes=loaded.dtype.itemsize)
    if backend == "cpu-looping":

        class LoopingCpuBackend(CpuBackend):
            name = "cpu-looping"

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.steered: set[int] = set()

            def execute(self, plan: StepPlan) -> StepResult:
                return loop(plan, super().execute(plan), self.steered)

        made = LoopingCpuBackend.for_capacities(loaded, caps, **options)
    else:

        class RowBlindCpuBackend(CpuBackend):
            name = "cpu-row-blind"

        made = RowBlindCpuBackend.for_capacities(loaded, caps, **{**options, "per_row_qsa_verify": False})
    return DataPlane(made, loaded.tokenizer, loaded.spec, caps, model or TINY_MODEL, loaded.fingerprint)


def data_plane(model: str, backend: str, config: EngineConfig, **options: Any) -> DataPlane:
    """The backend `backend` names, built for `model` and sized by `config`'s capacities."""
    factory: Callable[..., DataPlane]
    if backend == "cpu":
        factory = _cpu
    elif backend == "null":
        factory = _null
    elif backend in CUDA_BACKENDS:
        return _cuda(model, config, backend=backend, **options)
    elif backend in SCENARIO_BACKENDS:
        return _scenario(model, config, backend=backend, **options)
    else:
        raise ValueError(f"unknown backend {backend!r} ({', '.join(BACKENDS)})")
    return factory(model, config, **options)


def recorded_options(backend: str, options: dict[str, Any]) -> dict[str, Any]:
    """The backend options a trace records (beside the config, "backend_options"): the plain values among them
    (bool, int, float, str), and for a backend with the state-digest audit the audit it runs with (the option, else
    ATLAS_STATE_AUDIT), so that a replay rebuilds the same data plane, audit included (engine_for_run)."""
    out = {k: v for k, v in sorted(options.items()) if isinstance(v, bool | int | float | str)}
    if backend in AUDITED_BACKENDS and "state_audit" not in out:
        from atlas.backends.base import state_audit_default

        out["state_audit"] = state_audit_default()
    return out


def open_trace(trace: str, *, model: str, fingerprint: str, backend: str, config: EngineConfig,
               caps: Capacities, tuning: dict[str, str] | None = None, seed: int | None = None,
               options: dict[str, Any] | None = None) -> EventSink:
    """`tuning`: a CUDA backend's Tuning knobs (each part's implementation), recorded beside the config as
    "backend_tuning" so that a replay rebuilds the same arithmetic (engine_for_run); `options`: the backend's
    plain options (recorded_options), recorded as "backend_options". `seed`: the server's default seed (`atlas
    serve --seed`), recorded in the run row (each request's own seed is in its arrival)."""
    from atlas.replay.run_rows import TRACE_SCHEMA
    from atlas.replay.store import TraceWriter, git_revision

    extra: dict[str, Any] = {"backend_tuning": tuning} if tuning is not None else {}
    if options is not None:
        extra["backend_options"] = options
    return TraceWriter(trace, run={
        "engine_version": __version__, "git_revision": git_revision(), "model": model,
        "model_fingerprint": fingerprint, "backend": backend, "seed": seed,
        "config": {**config.to_json(), "trace_schema": TRACE_SCHEMA, **extra}, "capacities": caps.table(),
    })


def build_engine(model: str = TINY_MODEL, backend: str = "cpu", config: EngineConfig | None = None,
                 trace: str | None = None, *, sink: EventSink | None = None, loaded: Any = None, dtype: Any = None,
                 backend_options: dict[str, Any] | None = None, seed: int | None = None,
                 **engine_kwargs: Any) -> Engine:
    """The engine for (model, backend, config). `trace` records a new run (a SQLite path or any SQLAlchemy URL);
    `sink` collects events in memory instead. `loaded`: an already loaded model (atlas.model.LoadedModel), with
    `model` the name or dir the trace records so that a replay can load it again. `backend_options` go to the
    backend's constructor (e.g. device=, cuda_graphs= for CUDA); `seed` to the trace's run row; `engine_kwargs`
    to Engine."""
    from atlas.engine.engine import Engine

    config = resolve_drafter_context(config or EngineConfig())  # once, at start, before the trace's run row
    options = dict(backend_options or {})
    if loaded is not None:
        options["loaded"] = loaded
    if dtype is not None:
        options["dtype"] = dtype
    made = data_plane(model, backend, config, **options)
    if config.verify_costs is None and config.num_drafts:  # the backend's, before the trace's run row records it
        cost_model = getattr(made.backend, "verify_costs", None)  # (replay reads it back)
        config = attrs.evolve(config, verify_costs=cost_model(config.num_drafts) if cost_model is not None else ())
    if trace is not None:
        tuning = getattr(made.backend, "tuning", None)
        sink = open_trace(trace, model=model, fingerprint=made.fingerprint, backend=backend, config=config,
                          caps=made.caps, tuning=attrs.asdict(tuning) if tuning is not None else None, seed=seed,
                          options=recorded_options(backend, options))
    return Engine(made.backend, tokenizer=made.tokenizer, config=config, capacities=made.caps, spec=made.spec,
                  model_name=made.model_name, sink=sink, fingerprint=made.fingerprint, **engine_kwargs)


# the ones with a state-digest audit mode (state_audit=; atlas.backends.audit)
AUDITED_BACKENDS = ("cpu", "cpu-looping", "cpu-row-blind", *CUDA_BACKENDS)


def engine_for_run(run: RunRecord, sink: EventSink, **kwargs: Any) -> Engine:
    """A fresh engine like the one that recorded `run` (atlas.replay.run_rows.RunRecord), its events going to `sink`:
    the backend options the trace recorded (recorded_options) are restored, for every backend, under the ones the
    caller passes; replay runs the backend's state-digest audit mode (a snapshot or commit whose bytes drift is a
    violation) whether or not the recording did, so a replay never audits less than the run it replays."""
    recorded_opts = dict(run.config.get("backend_options") or {})
    if run.backend in AUDITED_BACKENDS:
        recorded_opts["state_audit"] = True
    kwargs["backend_options"] = {**recorded_opts, **kwargs.get("backend_options", {})}
    recorded = run.config.get("backend_tuning")
    if recorded is not None and run.backend in CUDA_BACKENDS:  # the recorded run's implementations, unless told
        from atlas.backends.cuda.tuning import Tuning

        known = {f.name for f in attrs.fields(Tuning)}  # a knob a later version dropped is ignored
        kwargs["backend_options"] = {"tuning": Tuning(**{k: v for k, v in recorded.items() if k in known}),
                                     **kwargs.get("backend_options", {})}
    return build_engine(run.model, run.backend, EngineConfig.from_json(run.config), sink=sink, **kwargs)


def __getattr__(name: str) -> Any:
    """`TUNINGS`: the CUDA backend's named arrangements (atlas.backends.cuda.tuning; `--tuning`), for the registry's
    users, loaded when asked (the CUDA package imports torch)."""
    if name == "TUNINGS":
        from atlas.backends.cuda.tuning import TUNINGS

        return TUNINGS
    raise AttributeError(name)
