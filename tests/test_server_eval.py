"""What an evaluation harness needs from /v1/completions (issue 17, finding 8): `echo` with `logprobs`
(prompt-token logprobs first), vLLM's `prompt_logprobs`, `GET /tokenizer_info`, and a list of prompts per request.
The prompt logprobs must be those of the exact forward (atlas.LLM.logits) and replay as recorded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from atlas.config import EngineConfig
from atlas.model.tokenizer import ByteTokenizer
from atlas.registry import build_engine
from atlas.replay.verify import verify
from atlas.server.serve import Served, serve_in_thread

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("eval") / "served.db"


@pytest.fixture(scope="module")
def served(trace: Path) -> Iterator[Served]:
    # prefix caching on, small chunks: a prompt_logprobs request must neither take a prefix hit nor lose the
    # positions at chunk boundaries
    config = EngineConfig(max_seq_len=256, max_batch_size=4, prefill_chunk_tokens=8, enable_prefix_caching=True)
    engine = build_engine("atlas-tiny", "cpu", config, trace=str(trace))
    with serve_in_thread(engine) as s:
        yield s


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    """log p(prompt[i] | prompt[:i]) from atlas.LLM's exact forward, for PROMPT."""
    from atlas.llm import LLM

    logits = LLM("atlas-tiny").logits(PROMPT)
    return torch.log_softmax(logits.double(), dim=-1)


PROMPT = list(b"The capital of France is Paris")


def test_echo_with_logprobs_returns_the_prompts_token_logprobs(http: httpx.Client, reference: torch.Tensor) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                                           "echo": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"].startswith("The capital of France is Paris")
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(PROMPT) + 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(PROMPT)):
        assert lp["token_logprobs"][i] == pytest.approx(float(reference[i - 1, PROMPT[i]]), abs=1e-9)
        top = lp["top_logprobs"][i]
        best = int(reference[i - 1].argmax())
        assert top[ByteTokenizer().decode([best])] == pytest.approx(float(reference[i - 1, best]), abs=1e-9)
        assert max(top.values()) >= lp["token_logprobs"][i]  # what lm-eval's is_greedy compares
    assert lp["text_offset"][:3] == [0, 1, 2] and lp["text_offset"][-1] == len(PROMPT)


def test_prompt_logprobs_in_vllms_shape(http: httpx.Client, reference: torch.Tensor) -> None:
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                           "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    pl = r.json()["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(PROMPT) and pl[0] is None
    for i in range(1, len(PROMPT)):
        entry = pl[i]
        actual = entry[str(PROMPT[i])]
        assert actual["logprob"] == pytest.approx(float(reference[i - 1, PROMPT[i]]), abs=1e-9)
        ranked = sorted((v["rank"], int(k)) for k, v in entry.items() if v["rank"] is not None)
        assert [rank for rank, _ in ranked] == [1, 2]
        assert ranked[0][1] == int(reference[i - 1].argmax())


def test_a_list_of_prompts_gets_one_choice_each_in_order(http: httpx.Client) -> None:
    prompts = ["Hello", "The sky is", "abc"]
    singles = [http.post("/v1/completions", json={"prompt": p, "max_tokens": 4, "temperature": 0}).json()
               for p in prompts]
    r = http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert body["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    tokens = http.post("/v1/completions", json={"prompt": [PROMPT, PROMPT[:5]], "max_tokens": 1, "temperature": 0,
                                                "echo": True, "logprobs": 0})
    assert tokens.status_code == 200, tokens.text
    lengths = [len(c["logprobs"]["token_logprobs"]) for c in tokens.json()["choices"]]
    assert lengths == [len(PROMPT) + 1, 6]


def test_tokenizer_info_names_the_special_tokens_and_the_template(http: httpx.Client) -> None:
    r = http.get("/tokenizer_info")
    assert r.status_code == 200
    info = r.json()
    assert info["eos_token"] == "<|endoftext|>" and info["bos_token"] is None and "pad_token" in info
    assert "im_start" in info["chat_template"] and info["model_max_length"] == 256


def test_what_cannot_be_honoured_is_refused_not_ignored(http: httpx.Client) -> None:
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "prompt_logprobs": 1})
    assert chat.status_code == 400 and "prompt_logprobs" in chat.text
    streamed = http.post("/v1/completions", json={"prompt": ["a", "b"], "stream": True, "max_tokens": 2})
    assert streamed.status_code == 400 and "stream" in streamed.text
    echo_stream = http.post("/v1/completions", json={"prompt": "a", "stream": True, "echo": True, "max_tokens": 2})
    assert echo_stream.status_code == 400


def test_a_served_trace_with_prompt_logprobs_replays_identically(served: Served, http: httpx.Client,
                                                                 trace: Path) -> None:
    for _ in range(2):  # the same prompt twice: a prefix hit would skip the positions it must score
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                                               "echo": True})
        assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["token_logprobs"][1] is not None
    served.engine_loop.stop()  # flushes the trace
    report = verify(trace)
    assert report.identical, report.divergence and report.divergence.describe()
