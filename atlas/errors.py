"""Every error Atlas raises on purpose, in one module that every layer may import (it imports nothing).

Request-level errors become HTTP 4xx/5xx in the server; engine-level ones end the engine. A message always
names the knob or field at fault and both numbers where there are two.
"""

from __future__ import annotations

from typing import Any


class AdmissionError(ValueError):
    """A request refused before anything ran (HTTP 400). The message names the knob and the numbers."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class QueueFull(RuntimeError):
    """The waiting queue is at its bound (EngineConfig.max_waiting): try again later (HTTP 503/429)."""


class EngineDead(RuntimeError):
    """The engine hit a fatal fault; nothing more can run in this process."""


class CapacityError(ValueError):
    """A knob, or an override, is below what the rest of the configuration needs. Names both numbers."""


class CapabilityError(CapacityError):
    """The configuration asks for a feature the backend does not declare (backends.base.Capabilities)."""


class ModelLoadError(ValueError):
    """A checkpoint Atlas cannot serve: the message names the file, tensor, field or value at fault."""


class TransitionRefused(RuntimeError):
    """A state machine's transition precondition does not hold; nothing was changed."""

    def __init__(self, machine: str, why: str, **fields: Any) -> None:
        super().__init__(f"{machine}: {why}")
        self.machine = machine
        self.why = why
        self.fields = fields


class InvariantViolation(EngineDead):
    """A state machine broke an invariant. Carries the event index, the machine and the field values.

    It is an EngineDead: the control plane can no longer be trusted, so the engine stops."""

    def __init__(self, event_index: int, machine: str, message: str, fields: dict[str, Any]) -> None:
        shown = ", ".join(f"{k}={v}" for k, v in fields.items())
        super().__init__(f"invariant violated at event {event_index} in {machine}: {message} ({shown})")
        self.event_index = event_index
        self.machine = machine
        self.message = message
        self.fields = fields


class UnknownEvent(ValueError):
    """A recorded event this engine cannot read (unknown kind, or a version newer than its own)."""


class DeviceFault(RuntimeError):
    """A fault raised by the data plane. `fatal` faults (a dead device context) mean the engine must stop."""

    def __init__(self, message: str, *, fatal: bool) -> None:
        super().__init__(message)
        self.fatal = fatal


class VerifyRefused(ValueError):
    """A verify's verdicts cannot be turned into an exact commit, or the backend's pre-validation of the
    commit failed: nothing moved, and the request ends with `error`, never `stop`."""


class RestoreRefused(ValueError):
    """A snapshot, restore or prefix-snapshot order whose preconditions do not hold; nothing was changed."""


class SlotsExhausted(RuntimeError):
    """Every per-sequence state slot of a backend is held (max_batch_size)."""


class StateDigestMismatch(RuntimeError):
    """Audit mode: restored or committed state bytes differ from the digest recorded when they were saved or
    computed. The engine records it as an invariant violation (machine "StateDigest")."""

    def __init__(self, seq_id: int, what: str, differs: tuple[str, ...]) -> None:
        super().__init__(f"sequence {seq_id}: {what}: the state differs from what was recorded in "
                         f"{', '.join(differs) or 'nothing named'}")
        self.seq_id, self.what, self.differs = seq_id, what, differs


class TraceFileError(ValueError):
    """A trace (or its JSON lines) that Atlas cannot read or write: missing, corrupt, truncated, foreign, of another
    schema, a row whose payload is not its event, or a full disk. The message names the file and what is wrong; the
    CLI prints it as one line and exits 2."""


class TraceMissing(TraceFileError, FileNotFoundError):
    """A trace path with no file: a TraceFileError, and the FileNotFoundError a caller may expect."""
