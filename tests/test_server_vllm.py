"""vLLM's dialect: `atlas serve MODEL` and vLLM's flag names mapped onto Atlas's knobs (or refused in one line,
exit 2: never accepted and ignored), /metrics open to a Prometheus scrape with a key set, /version, /ping and
`atlas --version`."""

from __future__ import annotations

import json
import random
import signal
import sqlite3
from pathlib import Path

import httpx
import pytest
from fixtures.serving import ServeProcess
from prometheus_client.parser import text_string_to_metric_families

from atlas import __version__
from atlas.cli import run
from atlas.cli_checks import UsageError
from atlas.cli_serve import resolve_dtype, resolve_model
from atlas.config import EngineConfig
from atlas.registry import build_engine
from atlas.replay import codec
from atlas.server.serve import serve_in_thread

KEY = "vllm-dialect-key"


def test_the_vllm_command_line_serves(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    trace = tmp_path / "served.db"
    with ServeProcess(tmp_path, "atlas-mini", "--max-model-len", "2048", "--max-num-seqs", "8",
                      "--served-model-name", "m", "--api-key-file", str(key_file), "--trace", str(trace),
                      "--seed", "7", "--no-enable-prefix-caching", "--dtype", "auto",
                      "--tensor-parallel-size", "1") as server:
        server.wait_ready(timeout=180)
        auth = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=server.url, timeout=120) as http:
            r = http.post("/v1/completions", headers=auth,
                          json={"model": "m", "prompt": "def f(x):", "max_tokens": 4, "temperature": 1.0})
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "m" and r.json()["usage"]["completion_tokens"] >= 1
            card = http.get("/v1/models", headers=auth).json()["data"]
            assert [(c["id"], c["max_model_len"]) for c in card] == [("m", 2048)]
            assert http.get("/v1/models").status_code == 401  # the key still guards the API
            scrape = http.get("/metrics")  # as Prometheus configured for vLLM scrapes: no key
            assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
            families = {f.name: f for f in text_string_to_metric_families(scrape.text)}
            served = families["atlas:request_success"].samples
            assert sum(s.value for s in served if s.name.endswith("_total")) == 1
            assert {s.labels["model_name"] for s in served} == {"m"}
            assert http.get("/version").json() == {"version": __version__}
            assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
        server.signal(signal.SIGTERM)
        assert server.wait() == 0
        logs = server.logs()
    # the flags reached the engine's capacities
    caps = next(line for line in logs.splitlines() if "capacities derived" in line)
    for field in ("max_seq_len=2048", "max_batch_size=8", "prefix_caching=False", "model=atlas-mini"):
        assert field in caps, caps
    # --seed: in the run row, and the request without a seed drew the first of its sequence (in its arrival)
    with sqlite3.connect(f"file:{trace}?mode=ro", uri=True) as con:
        assert con.execute("select seed, backend from runs").fetchall() == [(7, "cpu")]
        kind, version, payload = con.execute(
            "select kind, version, payload from events where kind = 'request_arrived'").fetchone()
    arrived = json.loads(payload) if isinstance(payload, str) else codec.decode(kind, version, payload)
    params = arrived["params"] if isinstance(arrived["params"], dict) else json.loads(arrived["params"])
    assert params["seed"] == random.Random(7).getrandbits(63)
    assert run(["replay", "verify", str(trace)]) == 0  # and the run replays exactly


@pytest.mark.parametrize(("argv", "says"), [
    (["serve", "atlas-tiny", "--model", "atlas-mini"], "the model is given twice and differently"),
    (["serve", "--dtype", "float16"], "--dtype 'float16' is not supported"),
    (["serve", "--dtype", "bfloat16"], "the cpu backend computes in float32 only"),
    (["serve", "--backend", "null", "--dtype", "float32"], "the null backend computes no tensors"),
    (["serve", "--tensor-parallel-size", "2"], "--tensor-parallel-size 2 needs 2 GPUs; --backend cpu uses none"),
    (["serve", "--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1, got 0"),
    (["serve", "--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization 0.9 cannot be honoured"),
    (["serve", "--seed", "-3"], "--seed -3 is outside [0, 2^63)"),
])
def test_a_vllm_flag_atlas_cannot_honour_is_one_line_exit_2(argv: list[str], says: str, capsys) -> None:
    assert run(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err


def test_dtype_picks_the_backend_mode_that_computes_in_it() -> None:
    assert resolve_dtype("auto", "cuda") == "cuda"
    assert resolve_dtype("float32", "cuda") == "cuda-fp32"
    assert resolve_dtype("float", "cuda-invariant") == "cuda-fp32-invariant"
    assert resolve_dtype("bfloat16", "cuda-invariant") == "cuda-invariant"
    assert resolve_dtype("float32", "cpu") == "cpu"
    with pytest.raises(UsageError, match="contradicts --backend cuda-fp32"):
        resolve_dtype("bfloat16", "cuda-fp32")
    assert resolve_model("atlas-mini", "atlas-mini") == "atlas-mini"
    assert resolve_model(None, "atlas-mini") == "atlas-mini" and resolve_model(None, None) is None


def test_version_flag_and_command(capsys) -> None:
    assert run(["--version"]) == 0
    assert run(["version"]) == 0
    assert capsys.readouterr().out.split() == [__version__, __version__]


def test_metrics_auth_keeps_metrics_behind_the_key() -> None:
    engine = build_engine("atlas-tiny", backend="null", config=EngineConfig(max_seq_len=64))
    with serve_in_thread(engine, api_key=KEY, metrics_auth=True) as served, \
            httpx.Client(base_url=served.url, timeout=30) as anon:
        assert anon.get("/metrics").status_code == 401
        assert anon.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert anon.get("/ping").status_code == 200 and anon.get("/health").status_code == 200
