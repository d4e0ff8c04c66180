"""OpenAI request/response bodies as msgspec structs.

Bodies are decoded strictly (`"5"` is not an integer), so the published OpenAPI schema
(generated from these same structs by msgspec, see console/openapi in app.py) is exactly
what the server accepts. Unknown fields are ignored, as OpenAI clients send many.
Extensions over OpenAI: top_k, min_p, repetition_penalty, priority, ignore_eos,
stop_token_ids.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from console.errors import APIError, msgspec_error

MAX_N = 16           # choices per request; each is an engine request
MAX_STOP = 16
MAX_LOGPROBS = 20    # = runtime.sampling.MAX_LOGPROBS

PositiveInt = Annotated[int, Meta(ge=1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
StopField = Annotated[str, Meta(min_length=1)] | Annotated[list[Annotated[str, Meta(min_length=1)]],
                                                          Meta(max_length=MAX_STOP)]


class StreamOptions(Struct):
    include_usage: bool = False


class _Sampling(Struct, kw_only=True):
    """Fields shared by both endpoints."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    stop: StopField | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extensions
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    priority: Literal["interactive", "batch"] = "interactive"
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None


PromptItem = str | Annotated[int, Meta(ge=0)] | Annotated[list[Annotated[int, Meta(ge=0)]], Meta(min_length=1)]


class CompletionRequest(_Sampling, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | Annotated[list[PromptItem], Meta(min_length=1)]
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False


class TextPart(Struct):
    type: Literal["text"]
    text: str


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None


# --- responses -------------------------------------------------------------------------------

class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


FinishReason = Literal["stop", "length", "abort", "error"]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob] | None


class ChatResponseMessage(Struct):
    content: str | None
    role: Literal["assistant"] = "assistant"


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None


class ChatDelta(Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str
    max_model_len: int
    root: str
    object: Literal["model"] = "model"


class ModelList(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class Health(Struct):
    status: Literal["ok", "warming_up", "draining", "failed"]
    model: str
    detail: str | None = None


# --- decoding ------------------------------------------------------------------------------------

T = TypeVar("T")
_decoders: dict[type, msgspec.json.Decoder] = {}


def decode_body(body: bytes, type_: type[T]) -> T:
    """Strict decode; any problem is a 400 naming the field."""
    if not body.strip():
        raise APIError(400, "request body is empty; send a JSON object", code="invalid_json")
    dec = _decoders.get(type_)
    if dec is None:
        dec = _decoders[type_] = msgspec.json.Decoder(type_, strict=True)
    try:
        return dec.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise msgspec_error(exc) from None


_encoder = msgspec.json.Encoder()


def encode(obj: object) -> bytes:
    return _encoder.encode(obj)
