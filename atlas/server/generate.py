"""/v1/completions and /v1/chat/completions: admission, then a JSON body or an SSE stream.

Honest endings: a request the engine failed is a 500 error (or, mid-stream, an error event and then
`[DONE]`), never a choice with finish_reason stop or length. Admission problems are refused before
anything is streamed. A client that goes away cancels its request in the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from atlas.errors import AdmissionError, EngineDead, QueueFull
from atlas.sampling.params import SamplingParams, choice_seed
from atlas.server.echo import echoed_logprobs, vllm_prompt_logprobs
from atlas.server.errors import APIError, bad_request, engine_dead, shutting_down
from atlas.server.fanout import merged, summed_usage
from atlas.server.loop_messages import EngineStopped, FaultKind, RequestStream
from atlas.server.schemas import ChatCompletionRequest, CompletionRequest
from atlas.server.serving import Generation, Kind, ServingContext

log = structlog.get_logger(__name__)
DONE = b"data: [DONE]\n\n"
FAULT_HEADER = "x-atlas-inject-fault"  # honoured only when the app enables fault injection


async def _submit(ctx: ServingContext, request: Request, request_id: str, prompt: list[int],
                  params: SamplingParams, *, stream: bool = False, prompt_logprobs: int | None = None
                  ) -> RequestStream:
    if not prompt:
        raise bad_request("prompt: is empty; give at least one token", param="prompt", code="empty_prompt")
    fault: FaultKind | None = None
    if ctx.fault_injection and request.headers.get(FAULT_HEADER) in ("step_error", "fatal"):
        fault = request.headers[FAULT_HEADER]  # type: ignore[assignment]
    extra = {} if prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs}
    try:
        return await ctx.engine_loop.submit(request_id, prompt, params, inject_fault=fault, stream=stream, **extra)
    except AdmissionError as exc:
        raise bad_request(str(exc), param=exc.param, code="admission_refused") from None
    except QueueFull as exc:
        raise APIError(503, f"the engine's waiting queue is full, retry later: {exc}", code="queue_full") from None
    except EngineDead as exc:
        raise engine_dead(str(exc)) from None
    except EngineStopped as exc:
        raise shutting_down(str(exc)) from None


def _quietly(future: asyncio.Future[Any]) -> None:
    """Retrieve a cancelled gather's outcome: its CancelledError was logged as 'never retrieved' otherwise."""
    if not future.cancelled():
        future.exception()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _respond_whole(ctx: ServingContext, request: Request, streams: list[RequestStream], gens: list[Generation],
                         kind: Kind, request_id: str, body: CompletionRequest | ChatCompletionRequest,
                         prompts: list[list[int]]) -> Response:
    """One JSON answer for every prompt of the request (one choice each, `index` in prompt order)."""

    async def consume(stream: RequestStream, gen: Generation) -> None:
        async for batch in stream.batches():
            for out in batch:
                gen.absorb(out)
                gen.token_ids.extend(out.new_token_ids)
                gen.token_logprobs.extend(out.new_logprobs)
                gen.tops.extend(out.new_top_logprobs)

    consumer = asyncio.ensure_future(asyncio.gather(*(consume(st, g) for st, g in zip(streams, gens, strict=True))))
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is itself cancelled (a shutdown): the requests must not run on
        watcher.cancel()
        client_left = not consumer.done()
        if client_left:
            consumer.cancel()
            for st in streams:
                st.cancel()
    if client_left:  # nobody will read an answer: one line, no traceback
        consumer.add_done_callback(_quietly)
        log.info("client disconnected: request cancelled", request_id=request_id)
        return Response(status_code=499)
    try:
        consumer.result()
    except EngineDead as exc:
        raise engine_dead(str(exc)) from None
    except EngineStopped as exc:
        raise shutting_down(str(exc)) from None
    for gen in gens:
        failure = gen.failure()
        if failure is not None:
            raise failure
    choices = [_whole_choice(ctx, gen, kind, body, prompt, index)
               for index, (gen, prompt) in enumerate(zip(gens, prompts, strict=True))]
    usage = _usage(gens)
    out = {"id": request_id, "object": "chat.completion" if kind == "chat" else "text_completion",
           "created": int(time.time()), "model": ctx.model_name, "choices": choices, "usage": usage}
    return JSONResponse(out, headers={"x-request-id": request_id})


def _whole_choice(ctx: ServingContext, gen: Generation, kind: Kind, body: CompletionRequest | ChatCompletionRequest,
                  prompt: list[int], index: int) -> dict[str, Any]:
    assert gen.finish is not None and gen.finish.finish_reason is not None
    logprobs = gen.logprobs(kind, gen.token_ids, gen.token_logprobs, gen.tops, 0)
    text = gen.text
    if isinstance(body, CompletionRequest) and body.echo:
        text = ctx.decode(prompt) + text
        if body.logprobs is not None:
            logprobs = echoed_logprobs(ctx.decode, prompt, gen.prompt_logprobs, logprobs, body.logprobs)
    # finish_detail (an extension, like vLLM's stop_reason): why it stopped, e.g. a declined loop rollback
    choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": gen.finish.finish_reason.value,
                              "finish_detail": gen.finish.finish_detail}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    if isinstance(body, CompletionRequest) and body.prompt_logprobs is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(ctx.decode, prompt, gen.prompt_logprobs or (),
                                                         body.prompt_logprobs)
    return choice


def _usage(gens: list[Generation]) -> dict[str, int]:
    return summed_usage([(g.prompt_tokens, g.completion_tokens, g.first_of_prompt) for g in gens])


# characters JSON leaves raw that line splitters modelled on str.splitlines (httpx's iter_lines) break a line at:
# escaped, an SSE event stays one line to every client (a 10k-request soak lost 1 to a generated U+0085)
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_data(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying `payload` as JSON (UTF-8, one line)."""
    return f"data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKS)}\n\n".encode()


async def _stream_events(ctx: ServingContext, stream: RequestStream, gen: Generation, kind: Kind,
                         request_id: str, include_usage: bool, index: int = 0, continuous: bool = False
                         ) -> AsyncIterator[bytes]:
    created = int(time.time())
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def chunk(text: str | None, finish: str | None, logprobs: dict | None, role: bool = False,
              detail: str | None = None) -> bytes:
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if detail is not None:
            choice["finish_detail"] = detail
        if kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        payload = {"id": request_id, "object": obj, "created": created, "model": ctx.model_name, "choices": [choice]}
        if continuous:  # stream_options.continuous_usage_stats: this choice's usage so far on every chunk
            payload["usage"] = gen.usage()
        return sse_data(payload)

    try:
        if kind == "chat":
            yield chunk("", None, None, role=True)
        offset = 0
        async for batch in stream.batches():  # what arrived while the client read: one chunk
            delta = "".join(gen.absorb(out) for out in batch)
            lp = None
            if gen.params.logprobs and any(out.new_token_ids for out in batch):
                lp = gen.logprobs(kind, [t for o in batch for t in o.new_token_ids],
                                  [x for o in batch for x in o.new_logprobs],
                                  [x for o in batch for x in o.new_top_logprobs], offset)
            if delta or lp is not None:
                yield chunk(delta, None, lp)
            offset += len(delta)
        failure = gen.failure()
        if failure is not None:
            yield failure.sse_event()
            yield DONE
            return
        assert gen.finish is not None and gen.finish.finish_reason is not None
        yield chunk(None if kind == "chat" else "", gen.finish.finish_reason.value, None,
                    detail=gen.finish.finish_detail)
        if include_usage:
            yield sse_data({"id": request_id, "object": obj, "created": created, "model": ctx.model_name,
                        "choices": [], "usage": gen.usage()})
        yield DONE
    except EngineDead as exc:
        yield engine_dead(str(exc)).sse_event()
        yield DONE
    except EngineStopped as exc:
        yield shutting_down(str(exc)).sse_event()
        yield DONE
    finally:
        _abandon(stream)  # a no-op once finished; when the client went away, the engine frees its blocks


class _EventStream(StreamingResponse):
    """Cancels its request however the response ends: a client that leaves before the first chunk
    stops the body generator before it starts, so the generator's own `finally` never runs."""

    def __init__(self, content: AsyncIterator[bytes], request_streams: list[RequestStream], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._request_streams = request_streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for stream in self._request_streams:
                _abandon(stream)


def _abandon(stream: RequestStream) -> None:
    """Cancel a request whose client went away (one log line); nothing once it finished."""
    if not stream.finished:
        log.info("client disconnected: request cancelled", request_id=stream.request_id)
        stream.cancel()


async def _run(ctx: ServingContext, request: Request, kind: Kind, body: CompletionRequest | ChatCompletionRequest,
               prompts: list[list[int]], snapshot_points: tuple[int, ...] = ()) -> Response:
    ctx.check_token_ids(body.stop_token_ids, param="stop_token_ids")
    ctx.check_token_ids(body.bias_token_ids(), param="logit_bias")
    for prompt in prompts:
        body.check_min_tokens_room(ctx.max_seq_len, len(prompt))
    params = ctx.sampling_params(body, snapshot_points=snapshot_points)
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    prompt_lp = body.engine_prompt_logprobs() if isinstance(body, CompletionRequest) else None
    # n choices per prompt, `index` = prompt * n + choice (OpenAI's and vLLM's order)
    choices = [(prompt, j) for prompt in prompts for j in range(body.n)]
    streams: list[RequestStream] = []
    try:
        for i, (prompt, j) in enumerate(choices):
            # every choice is its own engine request: with a seed in the body, choice j's is choice_seed(seed, j)
            # (the same for every prompt); without, each draws its own (the server's --seed sequence, else fresh),
            # which the trace records
            sub_id = request_id if len(choices) == 1 else f"{request_id}-{i}"
            if body.seed is not None:
                sub_params = attrs.evolve(params, seed=choice_seed(body.seed, j)) if j else params
            else:
                sub_params = params if i == 0 else ctx.sampling_params(body, snapshot_points=snapshot_points)
            # SSE requests get their tokens as sampled; the others are held back whole (a rollback can rewind)
            streams.append(await _submit(ctx, request, sub_id, prompt, sub_params, stream=bool(body.stream),
                                         prompt_logprobs=prompt_lp))
    except BaseException:
        for st in streams:  # admitted ones must not run for nobody
            st.cancel()
        raise
    gens = [Generation(ctx, params, request_id) for _ in choices]
    for gen, (prompt, j) in zip(gens, choices, strict=True):
        gen.prompt_tokens, gen.first_of_prompt = len(prompt), j == 0
    if not body.stream:
        return await _respond_whole(ctx, request, streams, gens, kind, request_id, body, [p for p, _ in choices])
    if len(streams) == 1:
        events = _stream_events(ctx, streams[0], gens[0], kind, request_id, body.include_usage,
                                continuous=body.continuous_usage)
    else:
        events = _fanned_events(ctx, streams, gens, kind, request_id, body)
    return _EventStream(events, streams, media_type="text/event-stream",
                        headers={"cache-control": "no-cache", "x-request-id": request_id})


async def _fanned_events(ctx: ServingContext, streams: list[RequestStream], gens: list[Generation], kind: Kind,
                         request_id: str, body: CompletionRequest | ChatCompletionRequest) -> AsyncIterator[bytes]:
    """n > 1 streamed: every choice's events (atlas.server.fanout), then one usage chunk summed over them."""
    async for event in merged([_stream_events(ctx, st, g, kind, request_id, False, index, body.continuous_usage)
                               for index, (st, g) in enumerate(zip(streams, gens, strict=True))]):
        yield event
    if body.include_usage and all(g.finish is not None and g.failure() is None for g in gens):
        yield sse_data({"id": request_id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                    "created": int(time.time()), "model": ctx.model_name, "choices": [], "usage": _usage(gens)})
    yield DONE



async def create_completion(ctx: ServingContext, request: Request, body: CompletionRequest) -> Response:
    ctx.check_model(body.model)
    if body.stream and (body.echo or body.prompt_logprobs is not None):
        raise bad_request("echo and prompt_logprobs are not supported with stream; send stream: false",
                          param="echo" if body.echo else "prompt_logprobs")
    token_lists = []
    for i, prompt in enumerate(body.prompts()):
        param = "prompt" if len(body.prompts()) == 1 else f"prompt.{i}"
        if isinstance(prompt, str):
            token_lists.append(ctx.encode(prompt, param=param))
        else:
            token_ids = list(prompt)
            ctx.check_token_ids(token_ids, param=param)
            token_lists.append(token_ids)
    return await _run(ctx, request, "completion", body, token_lists)


async def create_chat_completion(ctx: ServingContext, request: Request, body: ChatCompletionRequest) -> Response:
    ctx.check_model(body.model)
    prompt = ctx.encode_chat(body.messages, body.add_generation_prompt)
    return await _run(ctx, request, "chat", body, [prompt], ctx.message_boundaries(body.messages, prompt))
