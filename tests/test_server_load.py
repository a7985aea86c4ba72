"""Bounded load on loopback: every request ends honestly, every block comes back, the books balance."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

from atlas.config import EngineConfig
from atlas.engine.engine import Engine
from atlas.registry import build_engine
from atlas.server.bench import BenchConfig, format_report, run_bench
from atlas.server.serve import serve_in_thread

NUM_REQUESTS = 240
CONCURRENCY = 32


def _engine() -> Engine:
    # a batch smaller than the concurrency and a tight KV pool, so requests wait, and may be preempted
    config = EngineConfig(max_seq_len=512, max_batch_size=12, num_kv_blocks=64)
    return build_engine("atlas-tiny", backend="null", config=config)


# every 9th request (odd, so streamed and whole ones alike) has an injected step error: errors must end
# honestly under load too
FAULTED_EVERY = 9


def _request(i: int, rng: random.Random) -> tuple[str, dict]:
    body: dict = {"max_tokens": rng.randint(1, 48), "stream": i % 2 == 0, "seed": i}
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    if rng.random() < 0.3:
        body["stop"] = [rng.choice("aeiou ")]
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    if body["stream"]:  # so the client can count every token the server says it made
        body["stream_options"] = {"include_usage": True}
    prompt = "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randint(1, 120)))
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


async def _send(client: httpx.AsyncClient, path: str, body: dict, headers: dict) -> dict:
    """One request; returns how it ended, as the client saw it."""
    if not body["stream"]:
        r = await client.post(path, json=body, headers=headers)
        if r.status_code == 500 and r.json()["error"]["code"] == "engine_error":
            return {"outcome": "error_500"}
        if r.status_code != 200:
            return {"outcome": "http_error", "status": r.status_code, "body": (await r.aread())[:300]}
        data = r.json()
        return {"outcome": data["choices"][0]["finish_reason"], "usage": data["usage"]}
    finishes, errors, usage, done_seen, after_done = [], [], None, False, 0
    async with client.stream("POST", path, json=body, headers=headers) as r:
        if r.status_code != 200:
            return {"outcome": "http_error", "status": r.status_code, "body": (await r.aread())[:300]}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if done_seen:
                after_done += 1
            data = line[len("data: "):]
            if data == "[DONE]":
                done_seen = True
                continue
            event = json.loads(data)
            if "error" in event:
                errors.append(event["error"])
            finishes += [c["finish_reason"] for c in event.get("choices", []) if c["finish_reason"]]
            usage = event.get("usage") or usage
    endings = len(finishes) + len(errors)
    if not done_seen or after_done or endings != 1:
        return {"outcome": "malformed_stream", "finishes": finishes, "errors": errors, "done": done_seen}
    return {"outcome": finishes[0] if finishes else "stream_error", "usage": usage}


def _faulted(i: int) -> bool:
    return i % FAULTED_EVERY == FAULTED_EVERY - 1


def _metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


async def _drive(url: str) -> tuple[list[dict], list[dict]]:
    rng = random.Random(2024)
    requests = [_request(i, rng) for i in range(NUM_REQUESTS)]
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=60,
                                 limits=httpx.Limits(max_connections=CONCURRENCY + 2)) as client:

        async def one(i: int, path: str, body: dict) -> dict:
            headers = {"x-atlas-inject-fault": "step_error"} if _faulted(i) else {}
            async with limit:
                return await _send(client, path, body, headers)

        results = await asyncio.gather(*(one(i, p, b) for i, (p, b) in enumerate(requests)))
    return [b for _, b in requests], list(results)


def test_load_every_request_ends_once_and_the_books_balance() -> None:
    with serve_in_thread(_engine(), enable_fault_injection=True) as served:
        bodies, all_results = asyncio.run(_drive(served.url))
        faulted = [r for i, r in enumerate(all_results) if _faulted(i)]
        results = [r for i, r in enumerate(all_results) if not _faulted(i)]
        # 0 failures and 0 malformed streams; every injected error ended as an error, never stop/length
        outcomes = Counter(r["outcome"] for r in results)
        assert set(outcomes) <= {"stop", "length"}, (outcomes, [r for r in results if r["outcome"] not in
                                                                ("stop", "length")][:3])
        assert sum(outcomes.values()) == NUM_REQUESTS - len(faulted)
        assert Counter(r["outcome"] for r in faulted) == {"error_500": len(faulted) // 2,
                                                          "stream_error": len(faulted) // 2}
        for body, result in zip(bodies, all_results, strict=True):
            if result["outcome"] == "length":
                assert result["usage"]["completion_tokens"] == body["max_tokens"]

        metrics = httpx.get(f"{served.url}/metrics").text
        for reason in ("stop", "length"):
            assert _metric(metrics, "atlas:request_success_total", finished_reason=reason) == outcomes[reason]
        assert _metric(metrics, "atlas:request_success_total", finished_reason="error") == len(faulted)
        assert _metric(metrics, "atlas:request_success_total", finished_reason="cancelled") == 0
        assert _metric(metrics, "atlas:e2e_request_latency_seconds_count") == NUM_REQUESTS
        # token books: the faulted requests failed at their first step, before any token was sampled
        usages = [r["usage"] for r in results]
        assert _metric(metrics, "atlas:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
        assert _metric(metrics, "atlas:time_to_first_token_seconds_count") == len(results)
        stats = served.engine_loop.latest_stats
        assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
        assert _metric(metrics, "atlas:kv_blocks_used") == 0 and _metric(metrics, "atlas:num_requests_running") == 0


def test_bench_serve_reports_latency_figures() -> None:
    # the CPU backend: its steps take long enough that every token arrives in a chunk of its own
    engine = build_engine("atlas-tiny", backend="cpu", config=EngineConfig(max_seq_len=256, max_batch_size=8))
    with serve_in_thread(engine) as served:
        cfg = BenchConfig(base_url=served.url, num_prompts=16, input_len=16, output_len=8, max_concurrency=8,
                          request_rate=200.0)
        result = asyncio.run(run_bench(cfg))
    assert result["completed"] == 16 and result["failed"] == 0
    assert result["output_token_throughput"] > 0
    for key in ("ttft", "tpot", "itl", "e2e"):
        assert all(math.isfinite(v) and v >= 0 for v in result[key].values()), key
    assert result["ttft"]["p50_ms"] <= result["ttft"]["p99_ms"]
    assert "P99 ITL (ms):" in format_report(result, cfg)


async def _abandon_after(client: httpx.AsyncClient, body: dict, chunks: int) -> str:
    """Stream, but walk away after `chunks` data lines (or at the end, if it ends first)."""
    seen = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if line == "data: [DONE]":
                    return "finished"
                if seen >= chunks:
                    return "abandoned"
    return "finished"


def test_clients_walking_away_mid_stream_leave_nothing_behind() -> None:
    rng = random.Random(7)
    config = EngineConfig(max_seq_len=2048, max_batch_size=8, num_kv_blocks=256)
    with serve_in_thread(build_engine("atlas-tiny", backend="null", config=config)) as served:

        async def churn() -> list[str]:
            limit = asyncio.Semaphore(16)
            async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:

                async def one(i: int) -> str:
                    body = {"prompt": "w" * rng.randint(1, 200), "max_tokens": rng.randint(1, 1500),
                            "ignore_eos": True, "stream": True, "seed": i}
                    async with limit:
                        return await _abandon_after(client, body, rng.randint(1, 40))

                return list(await asyncio.gather(*(one(i) for i in range(80))))

        endings = Counter(asyncio.run(churn()))
        assert endings["abandoned"] > 0
        metrics = ""
        for _ in range(200):  # cancellations land within a step or two; wait until the engine is idle
            stats = served.engine_loop.latest_stats
            metrics = httpx.get(f"{served.url}/metrics").text
            if stats.num_running == stats.num_waiting == stats.kv_blocks_used == 0 and \
                    _metric(metrics, "atlas:e2e_request_latency_seconds_count") == 80:
                break
            asyncio.run(asyncio.sleep(0.05))
        ended = {r: _metric(metrics, "atlas:request_success_total", finished_reason=r)
                 for r in ("stop", "length", "cancelled", "error")}
        # an abandoned request was either cancelled, or had already finished when its client left
        assert ended["error"] == ended["stop"] == 0
        assert ended["length"] + ended["cancelled"] == 80
        assert 0 < ended["cancelled"] <= endings["abandoned"]
        stats = served.engine_loop.latest_stats
        assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
