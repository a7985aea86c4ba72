"""Fatal by probe, not by text (issue 13, deliverable 5).

After any error inside a step the backend asks the device itself whether it still works: a tiny kernel and a
synchronize (`probe_device`). A context that cannot run it is dead (a sticky error: an illegal address, a launch
timeout, an invalid PC, a hardware stack error, a device-side assert, a cuBLAS execution failure after one of
those ...): the error becomes DeviceFault(fatal=True) and the engine dies (503 on every route, trace flushed,
exit 3). A context that runs it is alive whatever the message said (out of memory for one request, a shape
error): the step's requests end with `error` and the engine goes on.

The previous rule matched message text against a list of known-fatal phrases; every phrase it lacked ("the
launch timed out", "an illegal instruction was encountered" in another wording, "CUBLAS_STATUS_EXECUTION_FAILED")
left the process serving a dead context (/health 200, every request 500: the seed's D-4 aftermath).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from atlas.errors import DeviceFault

Probe = Callable[[], str | None]  # None: the device works; else why it does not


def probe_device(device: torch.device) -> str | None:
    """Run one small kernel on `device` and wait for it: None when it ran and computed the right value."""
    try:
        x = torch.arange(8, device=device, dtype=torch.int32)
        total = (x * 3).sum()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        got = int(total.item())
    except Exception as exc:  # whatever the device raises, the context cannot run a kernel
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return None if got == 84 else f"the probe kernel computed {got}, expected 84"


class FaultGuard:
    """`with FaultGuard(probe):` around a step's device work. On an error it runs the probe once: a dead
    context turns the error into DeviceFault(fatal=True); a live one lets the error through unchanged (the
    engine fails that step's requests). `probes` counts the probes run (each costs one synchronize)."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.probes = 0

    def __enter__(self) -> FaultGuard:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if exc is None or isinstance(exc, DeviceFault) or not isinstance(exc, Exception):
            return False
        self.probes += 1
        dead = self.probe()
        if dead is not None:
            raise DeviceFault(f"the device context is unusable after {type(exc).__name__}: {exc} "
                              f"(probe: {dead})", fatal=True) from exc
        return False
