"""Request bodies to SamplingParams: OpenAI's names and defaults, mapped exactly."""

from __future__ import annotations

import pytest

from atlas.sampling.params import SamplingParams
from atlas.server.errors import APIError
from atlas.server.schemas import ChatCompletionRequest, CompletionRequest, parse_body

USER = [{"role": "user", "content": "hi"}]


def test_completion_fields_map_onto_sampling_params() -> None:
    body = parse_body(CompletionRequest, {
        "prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": -1, "max_tokens": 7, "seed": 3, "stop": "END",
        "logprobs": 2, "ignore_eos": True, "stop_token_ids": [5]})
    assert body.sampling_params() == SamplingParams(
        temperature=0.5, top_p=0.9, top_k=0, max_tokens=7, seed=3, stop=("END",), stop_token_ids=(5,),
        ignore_eos=True, logprobs=True, top_logprobs=2)


def test_defaults_follow_openai_and_an_absent_seed_is_fresh_per_request() -> None:
    a = parse_body(CompletionRequest, {"prompt": "x"}).sampling_params()
    b = parse_body(CompletionRequest, {"prompt": "x"}).sampling_params()
    assert a.temperature == 1.0 and a.top_p == 1.0 and a.max_tokens is None and not a.logprobs
    assert a.seed != b.seed  # recorded with the request in the trace, so replay still reproduces it


def test_chat_max_completion_tokens_wins_and_logprobs_are_opt_in() -> None:
    body = parse_body(ChatCompletionRequest, {"messages": USER, "max_tokens": 5, "max_completion_tokens": 9,
                                              "logprobs": True})
    params = body.sampling_params()
    assert params.max_tokens == 9 and params.logprobs and params.top_logprobs == 0
    params = parse_body(ChatCompletionRequest, {"messages": USER, "logprobs": True, "top_logprobs": 4}).sampling_params()
    assert params.top_logprobs == 4
    assert not parse_body(ChatCompletionRequest, {"messages": USER}).sampling_params().logprobs


def test_prompt_shapes() -> None:
    assert parse_body(CompletionRequest, {"prompt": [1, 2]}).prompts() == [[1, 2]]
    assert parse_body(CompletionRequest, {"prompt": ["one"]}).prompts() == ["one"]
    assert parse_body(CompletionRequest, {"prompt": [[3, 4]]}).prompts() == [[3, 4]]
    assert parse_body(CompletionRequest, {"prompt": [[3], [4]]}).prompts() == [[3], [4]]  # one choice each
    with pytest.raises(APIError, match="at most 128 prompts"):
        parse_body(CompletionRequest, {"prompt": ["a"] * 129})
    with pytest.raises(APIError, match="stream with 2 prompts"):
        parse_body(CompletionRequest, {"prompt": ["a", "b"], "stream": True})


def test_content_parts_are_joined() -> None:
    body = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert body.messages[0].text() == "ab"
