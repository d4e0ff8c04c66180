"""OpenAI request/response bodies as msgspec structs.

Bodies are decoded strictly (`"5"` is not an integer), so the published OpenAPI schema
(generated from these same structs by msgspec, see `operation` below) is exactly
what the server accepts. A field this server does not implement is a 400 naming it,
never silently ignored (OpenAI clients send only the fields their callers set).
Extensions over OpenAI, as vLLM names them: top_k, min_p, repetition_penalty, min_tokens,
stop_token_ids, ignore_eos, structured_outputs, prompt_logprobs; priority; vLLM's
/tokenize and /detokenize bodies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from litestar.openapi.spec import Operation, Schema
from msgspec import Meta, Struct

from console.errors import APIError, ErrorResponse, msgspec_error

MAX_N = 16           # choices per request; each is an engine request
MAX_STOP = 16
MAX_LOGPROBS = 20    # = runtime.model.sampling.MAX_LOGPROBS

PositiveInt = Annotated[int, Meta(ge=1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
StopField = Annotated[str, Meta(min_length=1)] | Annotated[list[Annotated[str, Meta(min_length=1)]],
                                                          Meta(max_length=MAX_STOP)]


class StreamOptions(Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    # vLLM's extension (guidellm sends it): with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    schema: dict[str, Any] | None = None     # none: any JSON object
    strict: bool | None = None               # outputs always follow the schema here
    description: str | None = None


class ResponseFormat(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: exactly one of these."""

    json: dict[str, Any] | str | None = None      # a JSON schema (object or JSON text)
    regex: str | None = None
    choice: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(min_length=1)] | None = None
    grammar: Annotated[str, Meta(min_length=1)] | None = None   # Lark or GBNF (EBNF)
    json_object: bool | None = None


LogitBias = dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]]


class _Sampling(Struct, kw_only=True, forbid_unknown_fields=True):
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
    top_k: Annotated[int, Meta(ge=-1, le=2**31 - 1)] | None = None   # int32 on the device
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    priority: Literal["interactive", "batch"] = "interactive"
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Meta(ge=0)]] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    speculative: bool = True   # false: this request never uses the engine's speculative decoding


PromptItem = str | Annotated[int, Meta(ge=0)] | Annotated[list[Annotated[int, Meta(ge=0)]], Meta(min_length=1)]


class CompletionRequest(_Sampling, kw_only=True):
    # a string, a list of strings, a list of token ids, or a list of token-id lists
    prompt: str | Annotated[list[PromptItem], Meta(min_length=1)]
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    prompt_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None


class TextPart(Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class FunctionCall(Struct, forbid_unknown_fields=True):
    name: str
    arguments: str              # JSON text, as OpenAI sends it


class ToolCall(Struct, kw_only=True, forbid_unknown_fields=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None    # an assistant turn that called tools
    tool_call_id: str | None = None             # a tool turn: the call it answers


class FunctionDef(Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None    # a JSON schema; none: no arguments
    strict: bool | None = None


class Tool(Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Meta(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1)] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True   # the BOS the model's config asks for (prompt only, as vLLM)
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[Annotated[int, Meta(ge=0)]]


class GenerateParameters(Struct, kw_only=True, forbid_unknown_fields=True):
    """Text Generation Inference's `parameters` (the ones this engine can honour)."""

    max_new_tokens: PositiveInt | None = None
    do_sample: bool = False
    temperature: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    top_k: Annotated[int, Meta(ge=1, le=2**31 - 1)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, lt=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    stop: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(max_length=MAX_STOP)] | None = None
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool = False


class GenerateRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    """TGI's POST /generate and /generate_stream body."""

    inputs: Annotated[str, Meta(min_length=1)]
    parameters: GenerateParameters | None = None
    stream: bool = False


# --- responses -------------------------------------------------------------------------------

class GenToken(Struct):
    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(Struct):
    id: int
    text: str
    logprob: float | None       # None for the first prompt token


class GenDetails(Struct):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None = None
    tokens: list[GenToken] | None = None
    prefill: list[PrefillToken] | None = None   # decoder_input_details: the prompt's tokens and logprobs


class GenerateResponse(Struct):
    generated_text: str
    details: GenDetails | None = None


class StreamDetails(Struct):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    generated_tokens: int
    seed: int | None = None


class GenerateStreamEvent(Struct):
    """One SSE event of /generate_stream: a token; the last one also the whole text and details."""

    index: int
    token: GenToken
    generated_text: str | None = None
    details: StreamDetails | None = None


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Struct):
    prompt: str


class TokenizerInfo(Struct):
    """vLLM's /tokenizer_info (what lm-evaluation-harness's remote tokenizer reads)."""

    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int
    add_bos_token: bool
    tokenizer_class: str = "PreTrainedTokenizerFast"


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class SpeculativeUsage(Struct):
    """Extension: what speculative decoding proposed for this response and kept."""
    proposed: int
    accepted: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    speculative: SpeculativeUsage | msgspec.UnsetType = msgspec.UNSET  # only where some token was proposed


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


FinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class PromptLogprob(Struct):
    logprob: float
    rank: int | None            # 1 = most probable; None: outside the top prompt_logprobs
    decoded_token: str


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None
    # vLLM's prompt_logprobs: None for the first prompt token, then {token id: logprob} with the
    # prompt's own token and the top N
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


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
    tool_calls: list[ToolCall] | None = None


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


class FunctionDelta(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class ChatDelta(Struct, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)


class LoadLoraAdapterRequest(Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None  # (vLLM's; when given it must be the loaded adapter's id)


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


# --- OpenAPI: the published schema is msgspec's own view of these structs ------------------------
# Litestar would derive a schema from a `data: T` parameter, but it decodes bodies leniently
# ("5" becomes 5) and its derived schema differs in details from what msgspec enforces. So the
# handlers decode strictly themselves and each operation carries msgspec's JSON schema.

REF = "#/components/schemas/{name}"
ERROR_STATUSES = {"400": "Invalid request (the message names the field)", "401": "Missing or wrong API key",
                  "404": "No such model or LoRA adapter (code model_not_found)",
                  "429": "Admission queue full; see Retry-After", "500": "Internal error (no details leak)",
                  "503": "Warming up or shutting down"}


# OpenAPI 3.1: a text/event-stream `schema` describes one event.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk (the response object with deltas, or an "
                                              "ErrorResponse), or [DONE] as the last event"},
    "event": {"type": "string"}}}


@dataclass
class RawSchema(Schema):
    """A literal JSON-schema dict inside Litestar's OpenAPI objects."""

    raw: dict[str, Any] = field(default_factory=dict)

    def to_schema(self) -> dict[str, Any]:
        return self.raw


def _ref(t: type) -> dict[str, Any]:
    return {"$ref": REF.format(name=t.__name__)}


def operation(request_type: type | None, response_type: type) -> type[Operation]:
    """An Operation subclass (Litestar's `operation_class`) with msgspec-derived bodies; a
    200 with a request type may also be an SSE stream (`stream: true`)."""

    @dataclass
    class _Operation(Operation):
        def __post_init__(self) -> None:
            ok: dict[str, Any] = {"application/json": {"schema": _ref(response_type)}}
            if request_type is not None:
                ok["text/event-stream"] = {"schema": SSE_EVENT}
                self.request_body = RawSchema(raw={  # type: ignore[assignment]
                    "required": True, "content": {"application/json": {"schema": _ref(request_type)}}})
            err = {"application/json": {"schema": _ref(ErrorResponse)}}
            responses = {"200": {"description": "OK", "content": ok}}
            responses.update({k: {"description": v, "content": err} for k, v in ERROR_STATUSES.items()
                              if request_type is not None or k in ("401", "503")})
            self.responses = {k: RawSchema(raw=v) for k, v in responses.items()}  # type: ignore[misc]

    return _Operation


def openapi_components() -> dict[str, Schema]:
    """Every struct the operations reference, keyed by name, for OpenAPIConfig.components."""
    _, comps = msgspec.json.schema_components(
        [CompletionRequest, ChatCompletionRequest, CompletionResponse, ChatCompletionResponse,
         ChatCompletionChunk, ModelList, ErrorResponse, TokenizeRequest, TokenizeResponse, DetokenizeRequest,
         DetokenizeResponse, TokenizerInfo, GenerateRequest, GenerateResponse, GenerateStreamEvent], ref_template=REF)
    return {name: RawSchema(raw=body) for name, body in comps.items()}
