"""Speculative decoding behind the server: completions equal speculation off's, and /metrics carries the
acceptance statistics per draft position."""

from __future__ import annotations

import httpx

from atlas.config import EngineConfig
from atlas.registry import build_engine
from atlas.server.serve import serve_in_thread


def completion(url: str, prompt: str) -> str:
    body = {"model": "atlas-tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_metrics_report_acceptance_by_position() -> None:
    texts = {}
    for drafts in (0, 2):
        config = EngineConfig(max_seq_len=128, max_batch_size=4, num_drafts=drafts, drafter="mtp")
        with serve_in_thread(build_engine("atlas-tiny", backend="cpu", config=config)) as served:
            texts[drafts] = [completion(served.url, p) for p in ("speculate", "the cat sat on the mat")]
            metrics = httpx.get(f"{served.url}/metrics", timeout=60).text
    assert texts[2] == texts[0]
    lines = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
             if line.startswith("atlas:spec_decode")}
    assert lines['atlas:spec_decode_num_verify_steps_total{model_name="atlas-tiny"}'] > 0
    assert lines['atlas:spec_decode_num_draft_tokens_total{model_name="atlas-tiny"}'] > 0
    for position in ("1", "2"):
        for kind in ("unconditional", "conditional"):
            key = f'atlas:spec_decode_acceptance_rate{{kind="{kind}",model_name="atlas-tiny",position="{position}"}}'
            assert 0.0 <= lines[key] <= 1.0, key
    assert 1.0 <= lines['atlas:spec_decode_tokens_per_verify{model_name="atlas-tiny"}'] <= 3.0
