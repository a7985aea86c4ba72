"""The Engine API contract: admission, stop conditions, cancellation, faults, errors and cursor checks."""

from __future__ import annotations

import attrs
import pytest

from atlas.backends.null import ByteTokenizer, NullBackend
from atlas.config import EngineConfig
from atlas.engine.engine import Engine
from atlas.engine.outputs import FinishReason, RequestOutput
from atlas.engine.records import RecordingSink
from atlas.errors import AdmissionError, DeviceFault, EngineDead, InvariantViolation, QueueFull
from atlas.plan import BackendCursors, SeqOutcome, StepPlan, StepResult
from atlas.sampling.params import SamplingParams

CONFIG = EngineConfig(max_seq_len=64, max_batch_size=4, prefill_chunk_tokens=16, block_size=4, max_waiting=3)


class ScriptedBackend(NullBackend):
    """Emits the given tokens in order for every sampled sequence; can fail or lie about its cursors."""

    def __init__(self, script: list[int], fail_at_step: int | None = None, fatal: bool = False,
                 skew_cursor_at_step: int | None = None) -> None:
        super().__init__()
        self.script = script
        self.fail_at_step = fail_at_step
        self.fatal = fatal
        self.skew_cursor_at_step = skew_cursor_at_step
        self.emitted: dict[int, int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        if plan.step == self.fail_at_step:
            raise DeviceFault("illegal memory access", fatal=True) if self.fatal else RuntimeError("kernel oops")
        result = super().execute(plan)
        outcomes = []
        for o in result.outcomes:
            token = o.token
            if token is not None:
                i = self.emitted.get(o.seq_id, 0)
                token = self.script[i % len(self.script)]
                self.emitted[o.seq_id] = i + 1
            cursors = o.cursors
            if plan.step == self.skew_cursor_at_step:
                cursors = BackendCursors(cursors.kv_tokens, cursors.qsa_ingested - 1, cursors.ssm_position,
                                         cursors.ple_position)
            outcomes.append(SeqOutcome(o.seq_id, cursors, token))
        return attrs.evolve(result, outcomes=tuple(outcomes))


def engine_with(backend: NullBackend | None = None, config: EngineConfig = CONFIG) -> Engine:
    return Engine(backend or NullBackend(), tokenizer=ByteTokenizer(), config=config, sink=RecordingSink(),
                  full_audit=True)


def drain(engine: Engine, limit: int = 500) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not drain")


def final(outs: list[RequestOutput]) -> RequestOutput:
    assert outs[-1].finished and sum(o.finished for o in outs) == 1
    return outs[-1]


def test_admission_names_the_numbers_and_the_knob() -> None:
    engine = engine_with()
    with pytest.raises(AdmissionError, match="prompt 60 \\+ max_tokens 5 exceeds max_seq_len 64") as info:
        engine.add_request("a", [1] * 60, SamplingParams(max_tokens=5))
    assert info.value.param == "max_tokens"
    with pytest.raises(AdmissionError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(AdmissionError, match="prompt 64 leaves no room"):
        engine.add_request("a", [1] * 64, SamplingParams())
    with pytest.raises(AdmissionError, match="outside the vocabulary"):
        engine.add_request("a", [1, 999], SamplingParams())
    with pytest.raises(AdmissionError, match="prompt token id -1 is outside the vocabulary"):  # the lower bound
        engine.add_request("a", [3, -1, 2], SamplingParams())
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(AdmissionError, match="already in use"):
        engine.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    assert not engine.sink.rows[1:]  # refusals record nothing


def test_a_long_prompt_converts_through_one_array_as_map_int_would() -> None:
    """prompt_ints' numpy path (LONG_PROMPT tokens or more) gives tuple(map(int, ids)) and its bounds for every input
    numpy holds as integers, and leaves everything else to the per-element way (same values, same refusals)."""
    import numpy as np

    from atlas.engine.engine import LONG_PROMPT, prompt_ints

    n = LONG_PROMPT
    cases = [list(range(n)), tuple(range(5, 5 + n)), [np.int32(3)] * n, [True] + [7] * (n - 1),
             [2**63 + 1] * n, [-(2**63)] + [1] * (n - 1), [1.0] * n, ["4"] * n, [1, 2**70] * (n // 2), list(range(n - 1))]
    for ids in cases:
        want = tuple(map(int, ids))
        got, bounds = prompt_ints(ids)
        assert got == want and bounds == (min(want), max(want))
        assert all(type(t) is int for t in got)  # exact ints: RequestArrived's converter takes the tuple as it is
    assert prompt_ints([]) == ((), None)
    with pytest.raises(ValueError):  # refused as map(int) refuses it
        prompt_ints(["x"] * n)
    # the engine's refusals of a long prompt name the same token as a short one's
    engine = engine_with(config=attrs.evolve(CONFIG, max_seq_len=2 * n))
    with pytest.raises(AdmissionError, match="prompt token id 999 is outside the vocabulary"):
        engine.add_request("a", [1] * (n - 1) + [999], SamplingParams(max_tokens=1))
    with pytest.raises(AdmissionError, match="prompt token id -3 is outside the vocabulary"):
        engine.add_request("a", np.array([2] * (n - 1) + [-3]).tolist(), SamplingParams(max_tokens=1))
    engine.add_request("a", [np.int64(2)] * n, SamplingParams(max_tokens=1))
    assert engine.sink.rows[-1] is not None and engine.state.seqs[0].cursor.prompt_len == n


def test_a_full_waiting_queue_raises_queue_full() -> None:
    engine = engine_with()
    for i in range(3):
        engine.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1))
    with pytest.raises(QueueFull, match="max_waiting 3"):
        engine.add_request("r3", [1, 2, 3], SamplingParams(max_tokens=1))


def test_without_max_tokens_the_budget_is_what_capacity_leaves_and_ends_with_length() -> None:
    engine = engine_with(ScriptedBackend([65]))
    engine.add_request("a", [1] * 60, SamplingParams())
    out = final(drain(engine)["a"])
    assert (out.finish_reason, out.completion_tokens) == (FinishReason.LENGTH, 4)
    assert "max_seq_len" in out.finish_detail


def test_eos_stops_unless_ignored_and_stop_token_ids_stop() -> None:
    script = [65, 66, 256, 67, 68, 69]
    engine = engine_with(ScriptedBackend(script))
    engine.add_request("eos", [1], SamplingParams(max_tokens=6))
    engine.add_request("ignore", [1], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("stop_id", [1], SamplingParams(max_tokens=6, stop_token_ids=(66,)))
    outs = drain(engine)
    eos = final(outs["eos"])
    assert (eos.finish_reason, eos.finish_detail, eos.completion_tokens) == (FinishReason.STOP, "eos", 3)
    assert [t for o in outs["eos"] for t in o.new_token_ids] == [65, 66, 256]
    assert "".join(o.new_text for o in outs["eos"]) == "AB"  # EOS adds no text
    ignore = final(outs["ignore"])
    assert (ignore.finish_reason, ignore.completion_tokens) == (FinishReason.LENGTH, 6)
    assert final(outs["stop_id"]).finish_detail == "stop token 66"


def test_a_stop_string_cuts_the_text_before_it_and_never_streams_its_prefix() -> None:
    engine = engine_with(ScriptedBackend(list(b"hello END world")))
    engine.add_request("a", [1], SamplingParams(max_tokens=20, stop=("END",)))
    outs = drain(engine)["a"]
    out = final(outs)
    assert (out.finish_reason, out.finish_detail) == (FinishReason.STOP, "stop string 'END'")
    assert "".join(o.new_text for o in outs) == "hello "
    assert out.completion_tokens == len("hello END")


def test_multibyte_characters_are_streamed_whole() -> None:
    engine = engine_with(ScriptedBackend(list("né€".encode())))
    engine.add_request("a", [1], SamplingParams(max_tokens=6))
    outs = drain(engine)["a"]
    assert all("\ufffd" not in o.new_text for o in outs)
    assert "".join(o.new_text for o in outs) == "né€"


def test_cancel_frees_blocks_and_emits_one_final_cancelled_output() -> None:
    engine = engine_with()
    engine.add_request("a", [1] * 10, SamplingParams(max_tokens=30))
    engine.add_request("b", [2] * 10, SamplingParams(max_tokens=3))
    engine.step()
    engine.step()
    used = engine.stats().kv_blocks_used
    engine.cancel("a")
    assert engine.stats().kv_blocks_used < used
    engine.cancel("a")  # a second cancel of a finished request is a no-op
    outs = drain(engine)
    a = final(outs["a"])
    assert (a.finish_reason, a.completion_tokens) == (FinishReason.CANCELLED, 2)  # prefill + 1 decode
    assert final(outs["b"]).finish_reason is FinishReason.LENGTH
    assert engine.stats().kv_blocks_used == 0 and engine.backend.live_sequences() == []


def test_an_injected_step_error_ends_the_named_request_with_error_and_the_rest_go_on() -> None:
    engine = engine_with()
    engine.add_request("a", [1] * 5, SamplingParams(max_tokens=5))
    engine.add_request("b", [2] * 5, SamplingParams(max_tokens=5))
    engine.step()
    engine.inject_fault("step_error", "a")
    outs = drain(engine)
    a = final(outs["a"])
    assert (a.finish_reason, a.finish_detail) == (FinishReason.ERROR, "injected step_error")
    assert final(outs["b"]).finish_reason is FinishReason.LENGTH


def test_an_unnamed_step_error_fails_every_running_request() -> None:
    engine = engine_with()
    for rid in "ab":
        engine.add_request(rid, [1] * 5, SamplingParams(max_tokens=5))
    engine.step()
    engine.inject_fault("step_error")
    outs = drain(engine)
    assert all(final(outs[r]).finish_reason is FinishReason.ERROR for r in "ab")


def test_a_backend_exception_ends_that_steps_requests_with_error_and_the_engine_goes_on() -> None:
    engine = engine_with(ScriptedBackend([70], fail_at_step=1))
    engine.add_request("a", [1] * 5, SamplingParams(max_tokens=5))
    engine.step()
    outs = engine.step()
    assert [(o.request_id, o.finish_reason, o.finish_detail) for o in outs] == [
        ("a", FinishReason.ERROR, "RuntimeError: kernel oops")]
    engine.add_request("b", [1] * 5, SamplingParams(max_tokens=2))
    assert final(drain(engine)["b"]).finish_reason is FinishReason.LENGTH
    assert engine.backend.live_sequences() == []


@pytest.mark.parametrize("how", ["injected", "device"])
def test_a_fatal_fault_records_flushes_and_kills_the_engine(how: str) -> None:
    engine = engine_with(ScriptedBackend([70], fail_at_step=1, fatal=how == "device"))
    engine.add_request("a", [1] * 5, SamplingParams(max_tokens=5))
    engine.step()
    if how == "injected":
        engine.inject_fault("fatal")
    with pytest.raises(EngineDead):
        engine.step()
    kinds = [e.kind for _, _, e, _ in engine.sink.rows]
    assert kinds[-2:] == ["engine_faulted", "request_finished"]
    assert engine.sink.rows[-2][2].fatal and engine.sink.rows[-1][2].reason == "error"
    for call in (engine.step, lambda: engine.add_request("b", [1], SamplingParams()), lambda: engine.cancel("a")):
        with pytest.raises(EngineDead):
            call()


def test_a_backend_cursor_desync_is_caught_at_the_step_that_made_it() -> None:
    engine = engine_with(ScriptedBackend([70], skew_cursor_at_step=3))
    engine.add_request("a", [1] * 5, SamplingParams(max_tokens=10))
    for _ in range(3):
        engine.step()
    with pytest.raises(InvariantViolation) as info:
        engine.step()
    v = info.value
    assert v.machine == "BackendCursors" and v.fields["step"] == 3 and v.fields["backend"]["qsa_ingested"] == 7
    last = engine.sink.rows[-1][2]
    assert last.kind == "invariant_violated" and last.event_index == v.event_index
    assert engine.sink.rows[v.event_index][2].kind == "step_executed"
    with pytest.raises(EngineDead):
        engine.step()


def test_stats_count_tokens_blocks_and_checks() -> None:
    engine = engine_with()
    engine.add_request("a", [1] * 9, SamplingParams(max_tokens=3))
    engine.step()
    s = engine.stats()
    assert (s.num_running, s.kv_blocks_used, s.prompt_tokens_total, s.generation_tokens_total) == (1, 3, 9, 1)
    assert s.invariant_checks == s.trace_events_written == 3  # arrived, planned, executed
    assert s.kv_usage == 3 / s.kv_blocks_total
