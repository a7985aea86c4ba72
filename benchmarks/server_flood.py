"""A connection flood against `atlas serve`: idle connections plus slow-body clients, while /health and a
completion are timed. Prints figures; slow, so not in the default test run (tests/test_server_connections.py is
the CI-sized version).

    .venv/bin/python benchmarks/server_flood.py                      # 20,000 idle + 2,000 slow-body, 30 s
    .venv/bin/python benchmarks/server_flood.py --idle 2000 --slow 200 --duration 10 --backend cpu

The server runs in a child process (`atlas serve`, its own fd limit raised to the hard limit by the server),
the flood from worker processes (each under its own fd limit, from source addresses 127.0.0.2.. so that
ephemeral ports do not run out). Idle clients open a connection and send nothing; slow-body clients send
headers declaring a 100 kB body and then one byte a second. `--reconnect` reopens every connection the server
closes (an attacker who keeps at it). Reported: the fd limits (client, server), connections the workers held
at their peak, the server's own counts from /metrics (open, refused at the cap, header timeouts),
and /health and completion latency (p50, p99, max) and failures over the flood.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import re
import resource
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SLOW_HEAD = (b"POST /v1/completions HTTP/1.1\r\nhost: flood\r\ncontent-type: application/json\r\n"
             b"content-length: 100000\r\n\r\n")


def raise_nofile() -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    except (ValueError, OSError):
        pass
    return soft, hard


def _open(port: int, source: str) -> socket.socket | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((source, 0))
        s.settimeout(5)
        s.connect(("127.0.0.1", port))
        s.setblocking(False)
        return s
    except OSError:
        s.close()
        return None


def worker(kind: str, count: int, port: int, source: str, duration: float, reconnect: bool, report: mp.Queue) -> None:
    """Hold `count` connections of `kind` (idle | slow) for `duration` s; report the peak held and totals."""
    raise_nofile()
    sel = selectors.DefaultSelector()
    opened = failed = closed_by_server = 0
    peak = 0
    held: dict[socket.socket, float] = {}
    deadline = time.monotonic() + duration

    def add() -> None:
        nonlocal opened, failed
        s = _open(port, source)
        if s is None:
            failed += 1
            return
        opened += 1
        if kind == "slow":
            try:
                s.send(SLOW_HEAD)
            except OSError:
                pass
        held[s] = time.monotonic()
        sel.register(s, selectors.EVENT_READ)

    while len(held) < count and time.monotonic() < deadline:
        add()
    last_drip = time.monotonic()
    while time.monotonic() < deadline:
        peak = max(peak, len(held))
        for key, _ in sel.select(timeout=0.2):
            s = key.fileobj
            try:
                data = s.recv(4096)  # type: ignore[union-attr]
            except OSError:
                data = b""
            if not data:
                closed_by_server += 1
                sel.unregister(s)
                s.close()  # type: ignore[union-attr]
                held.pop(s, None)  # type: ignore[arg-type]
        if kind == "slow" and time.monotonic() - last_drip >= 1.0:
            last_drip = time.monotonic()
            for s in list(held):
                try:
                    s.send(b" ")
                except OSError:
                    pass
        while reconnect and len(held) < count and time.monotonic() < deadline:
            add()
    report.put({"kind": kind, "peak": peak, "opened": opened, "failed": failed, "closed_by_server": closed_by_server})
    for s in held:
        s.close()


def _metrics(url: str, http: httpx.Client | None = None) -> dict[str, float]:
    """The server's counts; during the flood through the probe's own connection (a new one is refused at the cap)."""
    try:
        text = (http.get("/metrics") if http is not None else httpx.get(f"{url}/metrics", timeout=10)).text
    except httpx.HTTPError:
        return {}
    out = {}
    for name in ("http_connections_open", "http_connections_refused_total",
                 "http_header_timeouts_total"):
        m = re.search(rf"^atlas:{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--idle", type=int, default=20_000)
    parser.add_argument("--slow", type=int, default=2_000)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds the flood is held")
    parser.add_argument("--per-worker", type=int, default=5_000, help="connections per worker process")
    parser.add_argument("--backend", default="null", help="the server's backend: null | cpu")
    parser.add_argument("--reconnect", action="store_true", help="reopen what the server closes")
    parser.add_argument("--server-args", default="", help="extra `atlas serve` flags, e.g. '--header-timeout 5'")
    parser.add_argument("--smoke", action="store_true", help="a seconds-long run (CI): 200 idle + 20 slow, 3 s")
    args = parser.parse_args()
    if args.smoke:
        args.idle, args.slow, args.duration, args.per_worker = 200, 20, 3.0, 200

    soft, hard = raise_nofile()
    print(f"client fd limit: soft {soft}, hard {hard} (the workers raise theirs the same way)")
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        log = Path(tmp) / "serve.log"
        server = subprocess.Popen(
            [sys.executable, "-c", "from atlas.cli import main; main()", "serve", "--backend", args.backend,
             "--port", str(port), *args.server_args.split()],
            stdout=log.open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        try:
            _wait_ready(url, server)
            server_limit = _proc_limit(server.pid)
            print(f"server fd limit: {server_limit}; {_serving_line(log)}")
            report: mp.Queue = mp.Queue()
            procs = []
            plan = [("idle", args.idle), ("slow", args.slow)]
            n = 0
            for kind, total in plan:
                while total > 0:
                    share = min(args.per_worker, total)
                    n += 1
                    procs.append(mp.Process(target=worker, args=(kind, share, port, f"127.0.0.{1 + n}",
                                                                 args.duration, args.reconnect, report)))
                    total -= share
            # the probe's connection is opened before the flood: at the cap a new connection is refused (503) and an
            # open one keeps working
            http = httpx.Client(base_url=url, timeout=10)
            http.get("/health")
            for p in procs:
                p.start()
            health: list[float] = []
            completion: list[float] = []
            failures: list[str] = []
            slow_calls: list[str] = []
            started = time.monotonic()
            peak_open = 0.0
            with contextlib.closing(http):
                while time.monotonic() - started < args.duration - 1:
                    for path, times in (("/health", health), ("/v1/completions", completion)):
                        t = time.monotonic()
                        try:
                            if path == "/health":
                                r = http.get(path)
                            else:
                                r = http.post(path, json={"prompt": "flood", "max_tokens": 8, "ignore_eos": True})
                            if r.status_code != 200:
                                failures.append(f"{path} {r.status_code}")
                        except httpx.HTTPError as exc:
                            failures.append(f"{path} {type(exc).__name__}")
                        times.append(time.monotonic() - t)
                        if times[-1] > 1.0:
                            slow_calls.append(f"{path} {times[-1]:.1f} s at t={t - started:.1f} s")
                    peak_open = max(peak_open, _metrics(url, http).get("http_connections_open", 0.0))
                    time.sleep(0.5)
            results = [report.get(timeout=args.duration + 60) for _ in procs]
            for p in procs:
                p.join(30)
            counts = _metrics(url)
            rss = _rss_mb(server.pid)
            server.send_signal(signal.SIGTERM)
            code = server.wait(60)
        finally:
            if server.poll() is None:
                server.kill()
        text = log.read_text(errors="replace")
    held = {k: sum(r["peak"] for r in results if r["kind"] == k) for k in ("idle", "slow")}
    print(f"flood: {args.idle} idle + {args.slow} slow-body clients for {args.duration:g} s"
          f"{' (reconnecting)' if args.reconnect else ''}; held at peak: {held['idle']} idle, {held['slow']} slow; "
          f"opened {sum(r['opened'] for r in results)}, failed to open {sum(r['failed'] for r in results)}, "
          f"closed by the server {sum(r['closed_by_server'] for r in results)}")
    print(f"server: open connections peak {peak_open:.0f}, "
          f"refused {counts.get('http_connections_refused_total', 0):.0f}, header timeouts "
          f"{counts.get('http_header_timeouts_total', 0):.0f}, RSS {rss:.0f} MB, exit {code}, "
          f"log {len(text) / 1024:.1f} KB ({text.count('Traceback')} tracebacks)")
    for name, times in (("/health", health), ("completion", completion)):
        print(f"{name:>11}: {len(times)} calls, p50 {1e3 * _pct(times, 50):.0f} ms, p99 {1e3 * _pct(times, 99):.0f} ms, "
              f"max {1e3 * max(times, default=float('nan')):.0f} ms, mean {1e3 * statistics.fmean(times or [0]):.0f} ms")
    print(f"failures: {len(failures)} {sorted(set(failures))[:5]}; calls over 1 s: {slow_calls[:8]}")
    worst = max(health + completion, default=float("inf"))
    print(f"verdict: {'PASS' if worst < 2.0 and not failures else 'FAIL'} (every /health and completion within 2 s)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode}")
        time.sleep(0.2)
    raise SystemExit("the server did not start")


def _proc_limit(pid: int) -> str:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return " ".join(line.split()[3:5])
    return "?"


def _serving_line(log: Path) -> str:
    m = re.search(r"max_connections=(\d+)", log.read_text(errors="replace"))
    return f"max_connections {m.group(1) if m else '?'}"


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


if __name__ == "__main__":
    main()
