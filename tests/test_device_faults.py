"""Fatal by probe, not by text (issue 13, deliverable 5), through the CUDA backend's CPU path: every error inside a
step is followed by a device probe; a dead context (the probe fails) kills the engine whatever the error's
wording, a live one (out of memory for one step) fails only that step's requests. The real sticky error and the
real OOM on an H200 are tests/test_cuda_gpu.py::test_a_dead_context_is_found_by_the_probe_and_an_oom_is_not."""

from __future__ import annotations

import pytest
import torch

import atlas.backends.cuda.runner as runner
from atlas.backends.cuda.faults import FaultGuard, probe_device
from atlas.config import EngineConfig
from atlas.engine.records import RecordingSink
from atlas.errors import DeviceFault, EngineDead
from atlas.registry import build_engine
from atlas.sampling.params import SamplingParams
from atlas.state.events import EngineFaulted

# the CUDA errors the old text rule took for recoverable, each leaving the context dead (CUDA's own wording)
STICKY = {
    "launch timeout": "CUDA error: the launch timed out and was terminated",
    "invalid PC": "CUDA error: an illegal instruction was encountered at an invalid program counter",
    "hardware stack error": "CUDA error: hardware stack error",
    "cuBLAS execution failure": "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, "
                                "opa, opb, m, n, k, &falpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, ...)`",
}


def _engine(sink: RecordingSink):
    torch.set_num_threads(1)
    return build_engine("atlas-tiny", "cuda-fp32", EngineConfig(max_seq_len=64, max_batch_size=2), sink=sink,
                        backend_options={"device": "cpu", "cuda_graphs": False})


def _inject(monkeypatch: pytest.MonkeyPatch, error: BaseException, *, times: int = 1) -> list[int]:
    run_group = runner.CudaBackend._run_group
    fired: list[int] = []

    def broken(self, packed, shape):
        if len(fired) < times:
            fired.append(1)
            raise error
        return run_group(self, packed, shape)

    monkeypatch.setattr(runner.CudaBackend, "_run_group", broken)
    return fired


@pytest.mark.parametrize("kind", sorted(STICKY))
def test_an_error_after_which_the_device_is_dead_kills_the_engine(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sink = RecordingSink()
    engine = _engine(sink)
    _inject(monkeypatch, RuntimeError(STICKY[kind]))
    probes: list[str] = []

    def dead_context(self) -> str:  # what probe_device reports on a context that cannot run a kernel
        probes.append(kind)
        return "AcceleratorError: CUDA error: unspecified launch failure"

    monkeypatch.setattr(runner.CudaBackend, "probe", dead_context)
    engine.add_request("a", list(b"hello"), SamplingParams(max_tokens=3))
    with pytest.raises(EngineDead, match="context is unusable"):
        for _ in range(4):
            engine.step()
    assert engine.dead and probes == [kind]
    faulted = [e for _, _, e, _ in sink.rows if isinstance(e, EngineFaulted)]
    assert faulted and faulted[-1].fatal, faulted
    with pytest.raises(EngineDead):  # nothing runs on a dead engine
        engine.add_request("b", list(b"hi"), SamplingParams(max_tokens=1))


def test_out_of_memory_for_one_step_fails_that_request_and_the_engine_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    sink = RecordingSink()
    engine = _engine(sink)
    fired = _inject(monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.00 TiB"))
    engine.add_request("a", list(b"hello"), SamplingParams(max_tokens=3))
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert fired and not engine.dead
    assert [(o.request_id, o.finish_reason.value) for o in done] == [("a", "error")]
    assert "OutOfMemoryError" in (done[0].finish_detail or "")
    engine.add_request("b", list(b"hello"), SamplingParams(max_tokens=3))  # the next request is served
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.finish_reason.value, o.completion_tokens) for o in done] == [("b", "length", 3)]


def test_the_probe_not_the_wording_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message that reads fatal on a device that still runs the probe is an ordinary step error."""
    engine = _engine(RecordingSink())
    _inject(monkeypatch, RuntimeError("CUDA error: an illegal memory access was encountered"))
    engine.add_request("a", list(b"hello"), SamplingParams(max_tokens=2))
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert not engine.dead and done[0].finish_reason.value == "error"


def test_the_guard_probes_once_per_error_and_never_without_one() -> None:
    calls: list[int] = []

    def probe() -> str | None:
        calls.append(1)
        return None

    guard = FaultGuard(probe)
    with guard:
        pass
    assert calls == [] and guard.probes == 0
    with pytest.raises(ValueError), guard:
        raise ValueError("block table too short")
    assert calls == [1]
    with pytest.raises(DeviceFault) as caught, FaultGuard(lambda: "the probe kernel computed 0, expected 84"):
        raise RuntimeError("anything")
    assert caught.value.fatal and "probe: the probe kernel computed 0" in str(caught.value)
    assert probe_device(torch.device("cpu")) is None  # the probe itself runs and checks its value
