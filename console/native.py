"""Native routes at the root, beside the OpenAI ones: /tokenize and /detokenize in vLLM's
shapes, /generate and /generate_stream in Text Generation Inference's. They share the
OpenAI routes' door (API key, readiness), request path (console/api.py `_submit`), errors,
metrics and access log."""

from __future__ import annotations

import dataclasses

from collections.abc import AsyncIterator
from typing import Any, TypeVar

from litestar import Request, Response, get, post

from console import schemas as S
from console.api import Job, _chat_prompt, _check_model, _failure, _max_tokens, _sse, _submit, \
    run_watching_disconnect, sse_response
from console.errors import APIError, error_body
from runtime.model.sampling import SamplingParams


T = TypeVar("T")


# --- tokenizer endpoints (vLLM's shapes, at the root as vLLM serves them) -----------------------------

async def _body(request: Request, struct: type[T]) -> T:
    """The decoded body; its optional `model` must be the served one."""
    body = S.decode_body(await request.body(), struct)
    if body.model is not None:  # type: ignore[attr-defined]
        _check_model(request, body.model)  # type: ignore[attr-defined]
    return body


@post("/tokenize", status_code=200, operation_class=S.operation(S.TokenizeRequest, S.TokenizeResponse),
      summary="Tokenize a prompt, or chat messages with the chat template")
async def tokenize(request: Request) -> Response:
    body = await _body(request, S.TokenizeRequest)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "prompt: send exactly one of prompt or messages", param="prompt")
    engine = request.app.state.engine
    tok = engine.tokenizer
    if body.messages is not None:
        ids = _chat_prompt(body.messages, tok, body.add_generation_prompt)
    else:
        ids = tok.encode(body.prompt)
        if not body.add_special_tokens and ids and getattr(tok, "add_bos", False) and ids[0] == tok.bos_token_id:
            ids = ids[1:]
    strs = [tok.decode([t], skip_special_tokens=False) for t in ids] if body.return_token_strs else None
    return Response(S.encode(S.TokenizeResponse(len(ids), engine.max_model_len, ids, strs)),
                    media_type="application/json")


@post("/detokenize", status_code=200, operation_class=S.operation(S.DetokenizeRequest, S.DetokenizeResponse),
      summary="Token ids back to text")
async def detokenize(request: Request) -> Response:
    body = await _body(request, S.DetokenizeRequest)
    engine = request.app.state.engine
    bad = next((t for t in body.tokens if t >= engine.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens: token id {bad} is outside the vocabulary (0..{engine.vocab_size - 1})",
                       param="tokens")
    return Response(S.encode(S.DetokenizeResponse(engine.tokenizer.decode(body.tokens, skip_special_tokens=False))),
                    media_type="application/json")


@get("/tokenizer_info", operation_class=S.operation(None, S.TokenizerInfo),
      summary="The tokenizer's special tokens and chat template (vLLM's /tokenizer_info)")
async def tokenizer_info(request: Request) -> Response:
    engine = request.app.state.engine
    tok = engine.tokenizer

    def name(i: int | None) -> str | None:
        return None if i is None else tok.decode([i], skip_special_tokens=False)

    eos = tok.eos_token_ids[0] if tok.eos_token_ids else None
    info = S.TokenizerInfo(name(eos), name(tok.bos_token_id), name(eos), tok.chat.source if tok.chat else None,
                           engine.max_model_len, getattr(tok, "add_bos", False))
    return Response(S.encode(info), media_type="application/json")


# --- native generate (Text Generation Inference's shapes) -------------------------------------------

TGI_DEFAULT_MAX_NEW_TOKENS = 100


def _tgi_sampling(request: Request, p: S.GenerateParameters, prompt_len: int) -> SamplingParams:
    """TGI samples when asked (do_sample) or when any sampling knob is set; otherwise greedy."""
    sample = p.do_sample or any(v is not None for v in (p.temperature, p.top_k, p.top_p))
    kw: dict[str, Any] = {"temperature": (p.temperature if p.temperature is not None else 1.0) if sample else 0.0}
    if sample and p.top_p is not None:
        kw["top_p"] = p.top_p
    if sample and p.top_k is not None and p.top_k < request.app.state.engine.vocab_size:
        kw["top_k"] = p.top_k
    if p.repetition_penalty is not None:
        kw["repetition_penalty"] = p.repetition_penalty
    mt = _max_tokens(request, prompt_len, p.max_new_tokens, TGI_DEFAULT_MAX_NEW_TOKENS, "inputs",
                     "parameters.max_new_tokens")
    try:
        return SamplingParams(max_tokens=mt, stop=tuple(p.stop or ()), logprobs=0,
                              seed=None if p.seed is None else p.seed % 2**32, **kw)
    except ValueError as exc:
        raise APIError.from_value_error(exc, default_param="parameters") from None


def _tgi_finish(job: Job) -> str:
    if job.finish_reason == "length":
        return "length"
    return "stop_sequence" if isinstance(job.stop_reason, str) else "eos_token"


async def _tgi(request: Request, body: S.GenerateRequest, stream: bool) -> Response:
    p = body.parameters or S.GenerateParameters()
    if p.decoder_input_details and stream:  # as TGI
        raise APIError(400, "parameters.decoder_input_details: not supported when streaming tokens",
                       param="parameters.decoder_input_details")
    tok = request.app.state.engine.tokenizer
    ids = tok.encode(body.inputs)
    sp = _tgi_sampling(request, p, len(ids))
    if p.decoder_input_details:
        sp = dataclasses.replace(sp, prompt_logprobs=0)
    gen = await _submit(request, [ids], [sp], 1, "interactive")
    job = gen.jobs[0]
    special = {*tok.eos_token_ids, *([tok.bos_token_id] if tok.bos_token_id is not None else [])}
    prefix = body.inputs if p.return_full_text else ""

    def token(t: int, text: str, lp: Any) -> S.GenToken:
        return S.GenToken(t, text, lp[0] if lp else None, t in special)

    if not stream:
        await run_watching_disconnect(request, gen.collect())
        if job.finish_reason in ("abort", "error"):
            raise _failure(job)
        details = None
        if p.details:
            toks = [token(t, tok.decode([t], skip_special_tokens=False), lp)
                    for t, lp in zip(job.token_ids, job.logprobs or [None] * len(job.token_ids))]
            prefill = None
            if p.decoder_input_details:
                prefill = [S.PrefillToken(t, tok.decode([t], skip_special_tokens=False), lp[0] if lp else None)
                           for t, lp in zip(job.prompt_ids, job.prompt_logprobs or [None] * len(job.prompt_ids))]
            details = S.GenDetails(_tgi_finish(job), job.completion_tokens, p.seed, toks, prefill)
        return Response(S.encode(S.GenerateResponse(prefix + "".join(job.text), details)),
                        media_type="application/json")

    async def events() -> AsyncIterator[bytes]:
        # One event per token, its text the incremental decoder's (a token that completes no
        # character has ""); the event before the last is held so the last can carry the
        # whole text and the details.
        held: list[Any] | None = None  # [index, id, text, logprob]
        n = 0
        try:
            async for j, out in gen.outputs():
                if out.finished and out.finish_reason in ("abort", "error"):
                    e = _failure(j)
                    yield _sse(error_body(e.status_code, e.message, code=e.code))
                    return
                lps = out.logprobs or [None] * len(out.token_ids)
                for t, lp in zip(out.token_ids, lps):
                    if held is not None:
                        yield _sse(S.GenerateStreamEvent(held[0], token(held[1], held[2], held[3])))
                    held, n = [n, t, "", lp], n + 1
                if held is not None:
                    held[2] += out.text
                if out.finished and held is not None:
                    yield _sse(S.GenerateStreamEvent(held[0], token(held[1], held[2], held[3]),
                                                     prefix + "".join(j.text),
                                                     S.StreamDetails(_tgi_finish(j), j.completion_tokens, p.seed)))
        finally:
            gen.abort_unfinished()

    return sse_response(events())


@post("/generate", status_code=200, operation_class=S.operation(S.GenerateRequest, S.GenerateResponse),
      summary="Generate text (Text Generation Inference's shape; stream: true answers as /generate_stream)")
async def generate(request: Request) -> Response:
    body = S.decode_body(await request.body(), S.GenerateRequest)
    return await _tgi(request, body, body.stream)


@post("/generate_stream", status_code=200,
      operation_class=S.operation(S.GenerateRequest, S.GenerateStreamEvent),
      summary="Generate text as server-sent events, one per token (Text Generation Inference's shape)")
async def generate_stream(request: Request) -> Response:
    body = S.decode_body(await request.body(), S.GenerateRequest)
    return await _tgi(request, body, True)


ROOT_ROUTES = [tokenize, detokenize, tokenizer_info, generate, generate_stream]
