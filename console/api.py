"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models.

A request fans out into one engine request per (prompt, choice); `Generation` merges
their output queues. Every engine request is submitted before the first byte is sent,
so admission errors (400/429) are real HTTP statuses even with `stream: true`.
A client that goes away aborts its engine requests: streaming through the cancelled
generator (Litestar cancels it on http.disconnect), non-streaming through a watcher on
the ASGI receive channel (`run_watching_disconnect`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec

from litestar import Request, Response, get, post
from litestar.response import Stream

from console import schemas as S
from console.errors import APIError, ClientDisconnected, error_body
from console.format import Formatter
from console.structured import ToolPlan, guide_from_body, plan_tools, render_messages
from console.tool_calls import of_tokenizer
from runtime.core.async_engine import AsyncEngine
from runtime.core.engine import RequestOutput
from runtime.fleet.errors import KV_TRANSFER_FAILED, REPLICA_FAILED
from runtime.model.sampling import SamplingParams
from runtime.core.scheduler import Overloaded
from runtime.model.structured import Guide

log = logging.getLogger(__name__)
MAX_JOBS = 64  # prompts x n per HTTP request
ACCESS_KEY = "pagedjax.access"  # ASGI scope key of the request's AccessRecord


@dataclasses.dataclass
class AccessRecord:
    """What the access log and HTTP metrics report; the middleware (console/app.py) creates
    it, the handlers fill in the token counts and time to first token."""

    request_id: str
    route: str
    method: str
    start: float = dataclasses.field(default_factory=time.monotonic)
    status: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    key: str | None = None               # the API key's name (never the secret)
    grant: Any = None                    # its admission (console/keys.py), settled when the response ends


def record_of(request: Request) -> AccessRecord:
    rec = request.scope.get(ACCESS_KEY)  # type: ignore[call-overload]
    if rec is None:  # a test app without the middleware
        rec = request.scope[ACCESS_KEY] = AccessRecord(secrets.token_hex(8), request.url.path,  # type: ignore
                                                       request.method)
    return rec


@dataclasses.dataclass(eq=False)
class Job:
    """One engine request: a (prompt, choice) pair, with its output accumulated."""

    index: int
    prompt: int
    request_id: str
    queue: asyncio.Queue
    prompt_ids: list[int]
    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Any] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[Any] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: Any = None
    error: str | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    spec: tuple[int, int] = (0, 0)  # speculative decoding: tokens proposed, kept
    offset: int = 0  # characters of text already covered by logprob text_offset

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        self.logprobs.extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.cached_tokens, self.completion_tokens = out.cached_tokens, out.completion_tokens
        self.spec = out.spec
        if out.finished:
            self.finished, self.finish_reason, self.error = True, out.finish_reason, out.error
            self.stop_reason = out.stop_reason


@dataclasses.dataclass
class Generation:
    """The engine requests behind one HTTP request, merged into one output stream."""

    engine: AsyncEngine
    record: AccessRecord
    jobs: list[Job] = dataclasses.field(default_factory=list)

    async def outputs(self) -> AsyncIterator[tuple[Job, RequestOutput]]:
        """(job, output) in arrival order; leaving early (disconnect) aborts what is unfinished."""
        getters = {asyncio.ensure_future(j.queue.get()): j for j in self.jobs if not j.finished}
        try:
            while getters:
                done, _ = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    job, out = getters.pop(fut), fut.result()
                    job.add(out)
                    if not out.finished:
                        getters[asyncio.ensure_future(job.queue.get())] = job
                    self._account(out)
                    yield job, out
        finally:
            for fut in getters:
                fut.cancel()
            self.abort_unfinished()

    def _account(self, out: RequestOutput) -> None:
        rec = self.record
        if rec.ttft_s is None and out.token_ids:
            rec.ttft_s = time.monotonic() - rec.start
        rec.completion_tokens = sum(j.completion_tokens for j in self.jobs)
        rec.cached_tokens = self.usage().prompt_tokens_details.cached_tokens

    async def collect(self) -> None:
        async for _ in self.outputs():
            pass

    def abort_unfinished(self) -> None:
        for j in self.jobs:
            if not j.finished:
                self.engine.abort(j.request_id)

    def usage(self) -> S.Usage:
        """Prompt tokens count once per prompt (not per choice); cached tokens per prompt are
        the best any of its choices got."""
        prompts: dict[int, tuple[int, int]] = {}
        for j in self.jobs:
            n, c = prompts.get(j.prompt, (len(j.prompt_ids), 0))
            prompts[j.prompt] = (n, max(c, j.cached_tokens))
        p = sum(n for n, _ in prompts.values())
        c = sum(j.completion_tokens for j in self.jobs)
        proposed, kept = sum(j.spec[0] for j in self.jobs), sum(j.spec[1] for j in self.jobs)
        return S.Usage(p, c, p + c, S.PromptTokensDetails(sum(x for _, x in prompts.values())),
                       S.SpeculativeUsage(proposed, kept) if proposed else msgspec.UNSET)


async def run_watching_disconnect(request: Request, work: Awaitable[None]) -> None:
    """Await `work`, cancelling it (which aborts its engine requests) if the client hangs up.
    The body is already read, so the next ASGI message can only be http.disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientDisconnected()
        task.result()
    finally:
        watcher.cancel()
        task.cancel()


# --- request -> engine requests --------------------------------------------------------------------

def _check_model(request: Request, model: str) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model); 404 for anything else."""
    st = request.app.state
    served = st.settings.model_name
    if model == served:
        return None
    has_lora = getattr(st.engine, "has_lora", None)
    if has_lora is not None and has_lora(model):
        return model
    raise APIError(404, f"model: the model {model!r} does not exist; this server serves {served!r}"
                        + (" and its LoRA adapters (GET /v1/models)" if has_lora is not None else ""),
                   param="model", code="model_not_found", type="invalid_request_error")  # (OpenAI's 404 shape)


def _completion_prompts(prompt: Any, tok: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tok.encode(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [tok.encode(p) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise APIError(400, "prompt: must be a string, a list of strings, a list of token ids or a list of "
                        "token-id lists (not a mix)", param="prompt")


def _chat_prompt(messages: list[S.ChatMessage], tok: Any, add_generation_prompt: bool = True,
                 tools: ToolPlan | None = None) -> list[int]:
    for i, m in enumerate(messages):
        # As OpenAI: only an assistant turn may come without content (tool calls); a user or
        # system message without it would silently generate from nothing.
        if m.content is None and m.role != "assistant":
            raise APIError(400, f"messages[{i}].content: a {m.role} message needs content",
                           param=f"messages[{i}].content")
        if m.tool_calls and m.role != "assistant":
            raise APIError(400, f"messages[{i}].tool_calls: only an assistant message has tool calls",
                           param=f"messages[{i}].tool_calls")
    chat = getattr(tok, "chat", None)
    renders_calls = chat is not None and "tool_calls" in chat.source
    msgs, specs = render_messages(messages, tools or ToolPlan("none", format=of_tokenizer(tok)),
                                  getattr(tok, "renders_tools", False), renders_calls)
    try:
        return tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt,
                                                  **({"tools": specs} if specs else {})))
    except ValueError as exc:
        raise APIError.from_value_error(exc, default_param="messages") from None
    except Exception as exc:  # noqa: BLE001 -- a template tripping on odd input is the input's fault
        raise APIError(400, f"messages: the chat template could not render them ({type(exc).__name__})",
                       param="messages") from None


def _max_tokens(request: Request, prompt_len: int, asked: int | None, default: int | None,
                prompt_param: str, param: str = "max_tokens") -> int:
    """An explicit max_tokens must fit the context; a default is clamped to what fits."""
    limit = request.app.state.engine.context_limit
    if prompt_len >= limit:
        raise APIError(400, f"{prompt_param}: the prompt is {prompt_len} tokens; this model's maximum context "
                            f"length is {limit} tokens, including at least one generated token",
                       param=prompt_param, code="context_length_exceeded")
    if asked is None:
        return min(default or limit, limit - prompt_len)
    if prompt_len + asked > limit:
        raise APIError(400, f"{param}: prompt ({prompt_len} tokens) + {param} ({asked}) exceeds this model's "
                            f"maximum context length of {limit} tokens", param=param, code="context_length_exceeded")
    return asked


def _sampling(body: S.CompletionRequest | S.ChatCompletionRequest, max_tokens: int,
              logprobs: int | None, vocab: int, guide: Guide | None = None) -> SamplingParams:
    kw = {k: v for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                         "repetition_penalty") if (v := getattr(body, k)) is not None}
    if body.logit_bias:
        bad = next((k for k in body.logit_bias if not k.isdigit()), None)
        if bad is not None:
            raise APIError(400, f"logit_bias: keys are token ids, got {bad!r}", param="logit_bias")
        kw["logit_bias"] = tuple((int(k), v) for k, v in body.logit_bias.items())
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens: {body.min_tokens} is more than max_tokens ({max_tokens})",
                       param="min_tokens")
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if body.top_k is not None and body.top_k >= vocab:
        kw["top_k"] = 0  # keeping the whole vocabulary is no filter at all
    try:
        return SamplingParams(max_tokens=max_tokens, stop=stop, stop_token_ids=tuple(body.stop_token_ids or ()),
                              ignore_eos=body.ignore_eos, logprobs=logprobs, min_tokens=body.min_tokens,
                              speculative=body.speculative,
                              guide=guide or guide_from_body(body),
                              seed=None if body.seed is None else body.seed % 2**32, **kw)
    except ValueError as exc:
        raise APIError.from_value_error(exc) from None


async def _submit(request: Request, prompts: list[list[int]], params: list[SamplingParams], n: int,
            priority: str, lora: str | None = None) -> Generation:
    st = request.app.state
    rec = record_of(request)
    if len(prompts) * n > MAX_JOBS:
        raise APIError(400, f"n: {len(prompts)} prompts x n={n} is more than {MAX_JOBS} generations", param="n")
    gen = Generation(st.engine, rec)
    try:
        for p_idx, ids in enumerate(prompts):
            for j in range(n):
                sp = params[p_idx]
                if n > 1 and sp.seed is not None:  # distinct but repeatable choices
                    sp = dataclasses.replace(sp, seed=(sp.seed + j) % 2**32)
                rid = f"{rec.request_id}-{len(gen.jobs)}"  # the console shows these; X-Request-Id-N
                # (the API key's check, first in the request's ledger: runtime/core/ledger.py)
                decisions = [("api_key", f"key {rec.key!r}: within its limits", {})] if rec.key else []
                more = {"lora": lora} if lora is not None else {}
                _, queue = await st.engine.asubmit(ids, sp, request_id=rid, priority=priority, decisions=decisions,
                                                   **more)
                gen.jobs.append(Job(len(gen.jobs), p_idx, rid, queue, ids))
    except Overloaded as exc:
        gen.abort_unfinished()
        # When the engine has measured steps, how long its queue takes to drain; else the setting.
        drain = st.engine.retry_after() if hasattr(st.engine, "retry_after") else None
        after = st.settings.retry_after_s if drain is None else max(1, math.ceil(drain))
        raise APIError(429, f"the server is overloaded ({exc}); retry later", code=exc.reason,
                       headers={"Retry-After": str(after)}) from None
    except LookupError as exc:  # its adapter was unloaded since the check
        gen.abort_unfinished()
        raise APIError(404, str(exc), param="model", code="model_not_found") from None
    except ValueError as exc:
        gen.abort_unfinished()
        if str(exc).startswith("request_id:"):
            raise APIError(400, f"x-request-id: {rec.request_id!r} belongs to a request still running; send a "
                                f"unique X-Request-Id", param="x-request-id", code="duplicate_request_id") from None
        raise APIError.from_value_error(exc, default_param="prompt") from None
    rec.prompt_tokens = sum(len(p) for p in prompts)
    return gen


# --- responses ----------------------------------------------------------------------------------------

def _failure(job: Job) -> APIError:
    if job.finish_reason == "abort":
        return APIError(503, "the request was aborted (by an operator, or the server is shutting down)",
                        code="aborted")
    if (job.error or "").startswith(REPLICA_FAILED):  # a fleet replica died under this request
        return APIError(503, "the replica serving this request failed; retry the request", code=REPLICA_FAILED,
                        headers={"Retry-After": "1"})
    if (job.error or "").startswith(KV_TRANSFER_FAILED):  # disaggregated fleet: the message names the stage
        return APIError(503, job.error, code=KV_TRANSFER_FAILED, headers={"Retry-After": "1"})
    # The engine's own message (job.error) is for the server log, not for clients.
    return APIError(500, f"generation failed in the engine; the server log has the details "
                         f"(request {job.request_id})", code="engine_error")


def _sse(obj: object) -> bytes:
    return b"data: " + S.encode(obj) + b"\n\n"


def sse_response(events: AsyncIterator[bytes]) -> Stream:
    """A server-sent-events response that proxies must not buffer."""
    return Stream(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                  "X-Accel-Buffering": "no"})


async def _respond(request: Request, gen: Generation, stream: bool, include_usage: bool,
                   full: Callable[[], object], head: Callable[[], list[object]],
                   chunk: Callable[[Job, Any], object], usage_chunk: Callable[[S.Usage], object],
                   continuous_usage: bool = False) -> Response:
    """Non-streaming: wait for every choice, answer `full()`. Streaming: `head()` events,
    then the `chunk(job, output)` events of each output, an error event for a choice that failed,
    the usage chunk when asked, and `[DONE]`; `continuous_usage` puts the usage so far on every
    head and output chunk too."""
    if not stream:
        await run_watching_disconnect(request, gen.collect())
        bad = next((j for j in gen.jobs if j.finish_reason in ("abort", "error")), None)
        if bad is not None:
            raise _failure(bad)
        return Response(S.encode(full()), media_type="application/json")

    def sse(obj: Any) -> bytes:
        return _sse(msgspec.structs.replace(obj, usage=gen.usage()) if continuous_usage else obj)

    async def events() -> AsyncIterator[bytes]:
        try:
            for obj in head():
                yield sse(obj)
            async for job, out in gen.outputs():
                if out.finished and out.finish_reason in ("abort", "error"):
                    e = _failure(job)
                    yield _sse(error_body(e.status_code, e.message, code=e.code))
                elif out.text or out.finished or out.logprobs or out.prompt_logprobs:
                    for obj in chunk(job, out):
                        yield sse(obj)
            if include_usage:
                yield _sse(usage_chunk(gen.usage()))
            yield b"data: [DONE]\n\n"
        finally:  # a client gone before (or while) the outputs flowed
            gen.abort_unfinished()

    return sse_response(events())


@post("/completions", status_code=200, operation_class=S.operation(S.CompletionRequest, S.CompletionResponse),
      summary="Create a completion")
async def completions(request: Request) -> Response:
    body = S.decode_body(await request.body(), S.CompletionRequest)
    lora = _check_model(request, body.model)
    if body.user:
        log.info("request %s: user %r", record_of(request).request_id, body.user[:200])
    tok = request.app.state.engine.tokenizer
    prompts = _completion_prompts(body.prompt, tok)
    vocab = request.app.state.engine.vocab_size
    # echo + logprobs scores the prompt too (evaluation harnesses); prompt_logprobs is vLLM's way
    echo_lp = body.echo and body.logprobs is not None
    plp = max(body.prompt_logprobs or 0, body.logprobs or 0) if echo_lp or body.prompt_logprobs is not None else None
    params = [dataclasses.replace(_sampling(body, _max_tokens(request, len(p), body.max_tokens, 16, "prompt"),
                                            body.logprobs, vocab), prompt_logprobs=plp) for p in prompts]
    gen = await _submit(request, prompts, params, body.n, body.priority, lora)
    rid, created, model = f"cmpl-{gen.record.request_id}", int(time.time()), body.model
    fmt = Formatter(tok, body.logprobs is not None, echo=body.echo, prompt_top=body.prompt_logprobs)

    def resp(choices: list[S.CompletionChoice], usage: S.Usage | None = None) -> S.CompletionResponse:
        return S.CompletionResponse(rid, created, model, choices, usage)

    return await _respond(
        request, gen, body.stream, _include_usage(body), continuous_usage=_continuous_usage(body),
        full=lambda: resp([fmt.completion_choice(j) for j in gen.jobs], gen.usage()),
        # with prompt logprobs the echo waits for them (they come with the first token)
        head=lambda: [resp([fmt.completion_echo(j)]) for j in gen.jobs] if body.echo and not echo_lp else [],
        chunk=lambda j, out: [*([resp([fmt.completion_echo(j)])] if echo_lp and out.prompt_logprobs else []),
                              resp([fmt.completion_delta(j, out)])],
        usage_chunk=lambda u: resp([], u))


@post("/chat/completions", status_code=200,
      operation_class=S.operation(S.ChatCompletionRequest, S.ChatCompletionResponse),
      summary="Create a chat completion")
async def chat_completions(request: Request) -> Response:
    body = S.decode_body(await request.body(), S.ChatCompletionRequest)
    lora = _check_model(request, body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    tok = request.app.state.engine.tokenizer
    plan = plan_tools(body, guide_from_body(body) is not None, of_tokenizer(tok))
    ids = _chat_prompt(body.messages, tok, tools=plan)
    if body.user:
        log.info("request %s: user %r", record_of(request).request_id, body.user[:200])
    lp = (body.top_logprobs or 0) if body.logprobs else None
    by_new_name = body.max_completion_tokens is not None
    mt = _max_tokens(request, len(ids), body.max_completion_tokens if by_new_name else body.max_tokens, None,
                     "messages", "max_completion_tokens" if by_new_name else "max_tokens")
    vocab = request.app.state.engine.vocab_size
    gen = await _submit(request, [ids], [_sampling(body, mt, lp, vocab, plan.guide)], body.n, body.priority, lora)
    rid, created, model = f"chatcmpl-{gen.record.request_id}", int(time.time()), body.model
    fmt = Formatter(tok, lp is not None, tools=plan if plan.active else None)

    def chunk(choices: list[S.ChatChunkChoice], usage: S.Usage | None = None) -> S.ChatCompletionChunk:
        return S.ChatCompletionChunk(rid, created, model, choices, usage)

    return await _respond(
        request, gen, body.stream, _include_usage(body), continuous_usage=_continuous_usage(body),
        full=lambda: S.ChatCompletionResponse(rid, created, model, [fmt.chat_choice(j) for j in gen.jobs],
                                              gen.usage()),
        head=lambda: [chunk([S.ChatChunkChoice(j.index, S.ChatDelta("assistant", ""), None, None)
                             for j in gen.jobs])],
        chunk=lambda j, out: [chunk([fmt.chat_delta(j, out)])],
        usage_chunk=lambda u: chunk([], u))


def _include_usage(body: S.CompletionRequest | S.ChatCompletionRequest) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _continuous_usage(body: S.CompletionRequest | S.ChatCompletionRequest) -> bool:
    return _include_usage(body) and bool(body.stream_options.continuous_usage_stats)


@get("/models", operation_class=S.operation(None, S.ModelList), summary="List the served model")
async def list_models(request: Request) -> Response:
    st = request.app.state
    base = st.settings.model_name
    cards = [S.ModelCard(base, int(st.started_at), "pagedjax", st.engine.max_model_len, str(st.settings.checkpoint))]
    adapters = getattr(st.engine, "lora_adapters", None)
    cards += [S.ModelCard(a["name"], int(a["loaded_at"]), "pagedjax", st.engine.max_model_len, a["path"], parent=base)
              for a in (adapters() if adapters is not None else [])]
    return Response(S.encode(S.ModelList(cards)), media_type="application/json")


@post("/admission/quote", status_code=200, summary="Would this request be admitted now, and how soon served?")
async def admission_quote(request: Request) -> Response:
    """A completions or chat body (nothing is generated): the engine's quote from its live
    state and its own step-time model (runtime/core/step_model.py)."""
    raw = await request.body()
    try:
        is_chat = isinstance(obj := json.loads(raw or b"null"), dict) and "messages" in obj
    except ValueError:
        is_chat = False  # (decode_body reports the JSON error)
    tok = request.app.state.engine.tokenizer
    body: S.CompletionRequest | S.ChatCompletionRequest
    if is_chat:
        body = S.decode_body(raw, S.ChatCompletionRequest)
        _check_model(request, body.model)
        ids = _chat_prompt(body.messages, tok, tools=plan_tools(body, guide_from_body(body) is not None,
                                                                   of_tokenizer(tok)))
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        mt = _max_tokens(request, len(ids), asked, None, "messages")
    else:
        body = S.decode_body(raw, S.CompletionRequest)
        _check_model(request, body.model)
        prompts = _completion_prompts(body.prompt, tok)
        if len(prompts) != 1:
            raise APIError(400, "prompt: a quote is for one prompt", param="prompt")
        ids = prompts[0]
        mt = _max_tokens(request, len(ids), body.max_tokens, 16, "prompt")
    penalties = any(getattr(body, k) not in (None, 0, 0.0, 1.0) for k in ("presence_penalty", "frequency_penalty",
                                                                          "repetition_penalty"))
    engine = request.app.state.engine
    try:  # (a single server's engine answers at once; a fleet's gateway asks the replica it would route to)
        q = engine.quote(ids, mt, body.priority, uses_prefix_cache=not penalties)
        if inspect.isawaitable(q):
            q = await q
    except ValueError as exc:
        raise APIError.from_value_error(exc, default_param="prompt") from None
    return Response(q if isinstance(q, dict) else q.to_json(), media_type="application/json",
                    headers={"Cache-Control": "no-store"})


ROUTES = [completions, chat_completions, list_models, admission_quote]
