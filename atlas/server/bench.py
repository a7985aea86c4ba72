"""`atlas bench serve`: a load generator for an OpenAI-compatible server, after vLLM's `bench serve`.

Random prompts of a given token length are sent as token ids to /v1/completions (so the server sees
exactly that many prompt tokens), streamed, with ignore_eos so every request generates exactly the
requested output length. Arrivals are a Poisson process at --request-rate (inf: all at once), capped
by --max-concurrency. Reports TTFT, TPOT, ITL (mean, p50, p99), end-to-end latency and throughput.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs
import httpx


class AuthRefused(RuntimeError):
    """The server answered 401/403: every request would fail the same way, so the run stops at the first."""


class ServerUnreachable(RuntimeError):
    """The first request (GET /v1/models) found no server at the URL, or one that is not OpenAI-compatible: nothing
    was sent, the run stops there."""

CONNECT_TIMEOUT_S = 10.0  # a dead host that drops packets is reported after this, not after the request timeout


def _auth_refusal(status: int, body: bytes) -> AuthRefused:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:120].decode(errors="replace")
    return AuthRefused(f"the server refused the request (HTTP {status}: {message}); pass the server's key with "
                       f"--api-key-file PATH, --api-key or ATLAS_API_KEY")


@attrs.define
class RequestRecord:
    ok: bool = False
    error: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itls: list[float] = attrs.Factory(list)


@attrs.frozen
class BenchConfig:
    base_url: str
    num_prompts: int = 100
    input_len: int = 64
    output_len: int = 32
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 600.0


def random_prompts(n: int, input_len: int, seed: int) -> list[list[int]]:
    # printable ASCII ids: valid in the byte tokenizer and in any real vocabulary
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(input_len)] for _ in range(n)]


async def _one_request(client: httpx.AsyncClient, cfg: BenchConfig, prompt: list[int]) -> RequestRecord:
    record = RequestRecord(prompt_tokens=len(prompt))
    body: dict[str, Any] = {
        "prompt": prompt, "max_tokens": cfg.output_len, "ignore_eos": True, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    if cfg.model:
        body["model"] = cfg.model
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code in (401, 403):
                raise _auth_refusal(response.status_code, await response.aread())
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    record.error = str(event["error"].get("message"))
                    continue
                now = time.perf_counter()
                if event.get("usage"):
                    record.output_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices", []):
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                    elif choice.get("text") or choice.get("logprobs"):
                        if record.ttft is None:
                            record.ttft = now - start
                        else:
                            record.itls.append(now - last)
                        last = now
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.e2e = time.perf_counter() - start
    record.ok = record.error is None and record.finish_reason in ("stop", "length")
    return record


async def run_bench(cfg: BenchConfig, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """`progress(done, total)` is called as each request ends."""
    prompts = random_prompts(cfg.num_prompts, cfg.input_len, cfg.seed)
    rng = random.Random(cfg.seed + 1)
    limit = asyncio.Semaphore(cfg.max_concurrency or cfg.num_prompts)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    pool = httpx.Limits(max_connections=(cfg.max_concurrency or cfg.num_prompts) + 4)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, CONNECT_TIMEOUT_S))
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=timeout, limits=pool) as client:
        try:  # a wrong key or a dead URL fails here, before any load is sent
            probe = await client.get("/v1/models")
        except httpx.TransportError as exc:
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise ServerUnreachable(f"--base-url {cfg.base_url}: no server answered ({type(exc).__name__}: "
                                    f"{reason}); start one (atlas serve) or fix the URL") from None
        if probe.status_code in (401, 403):
            raise _auth_refusal(probe.status_code, probe.content)
        if probe.status_code != 200:
            raise ServerUnreachable(f"--base-url {cfg.base_url}: GET /v1/models answered HTTP {probe.status_code}: "
                                    "not an OpenAI-compatible server (or not at this URL's path)")

        done = 0

        async def limited(prompt: list[int]) -> RequestRecord:
            nonlocal done
            async with limit:
                record = await _one_request(client, cfg, prompt)
            done += 1
            if progress is not None:
                progress(done, cfg.num_prompts)
            return record

        tasks = []
        start = time.perf_counter()
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(cfg.request_rate):
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
        try:
            records = await asyncio.gather(*tasks)
        except AuthRefused:  # the first refusal ends the run: the rest would only repeat it
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        duration = time.perf_counter() - start
    return summarize(records, duration)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": float("nan"), "p50_ms": float("nan"), "p99_ms": float("nan")}
    ordered = sorted(values)

    def pct(q: float) -> float:  # nearest-rank, as vLLM's numpy percentile does closely enough here
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]

    return {"mean_ms": 1000 * statistics.fmean(values), "p50_ms": 1000 * pct(50), "p99_ms": 1000 * pct(99)}


def summarize(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    done = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.ttft is not None and r.output_tokens > 1]
    return {
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_token_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft": _percentiles([r.ttft for r in done if r.ttft is not None]),
        "tpot": _percentiles(tpots),
        "itl": _percentiles([x for r in done for x in r.itls]),
        "e2e": _percentiles([r.e2e for r in done]),
    }


def format_report(result: dict[str, Any], cfg: BenchConfig) -> str:
    rate = "inf" if math.isinf(cfg.request_rate) else f"{cfg.request_rate:g}"
    lines = [
        f"{'=' * 16} Serving Benchmark Result {'=' * 16}",
        f"{'Requests (rate / max concurrency):':<40} {rate} / {cfg.max_concurrency or 'unbounded'}",
        f"{'Input / output tokens per request:':<40} {cfg.input_len} / {cfg.output_len}",
        f"{'Successful requests:':<40} {result['completed']}",
        f"{'Failed requests:':<40} {result['failed']}",
        f"{'Benchmark duration (s):':<40} {result['duration_s']:.2f}",
        f"{'Request throughput (req/s):':<40} {result['request_throughput']:.2f}",
        f"{'Output token throughput (tok/s):':<40} {result['output_token_throughput']:.2f}",
        f"{'Total token throughput (tok/s):':<40} {result['total_token_throughput']:.2f}",
    ]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2e", "End-to-end Latency")):
        lines.append(f"{'-' * 10} {title} {'-' * 10}")
        for stat in ("mean_ms", "p50_ms", "p99_ms"):
            label = f"{stat.split('_')[0].capitalize()} {key.upper()} (ms):"
            lines.append(f"{label:<40} {result[key][stat]:.2f}")
    for error in result["errors"]:
        lines.append(f"error: {error}")
    lines.append("=" * 58)
    return "\n".join(lines)


def bench_serve(cfg: BenchConfig, *, launch: dict[str, Any] | None = None,
                progress: Callable[[int, int], None] | None = None, threads: int | None = None) -> dict[str, Any]:
    """Run the benchmark; with `launch` (engine_for_serving's arguments), against an in-process server."""
    if launch is None:
        return asyncio.run(run_bench(cfg, progress))
    from atlas.server.serve import engine_for_serving, serve_in_thread, set_engine_threads

    set_engine_threads(threads)  # the engine shares this process with the server and the load generator

    with serve_in_thread(engine_for_serving(**launch), api_key=cfg.api_key) as served:
        return asyncio.run(run_bench(attrs.evolve(cfg, base_url=served.url), progress))
