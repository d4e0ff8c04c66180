"""Property-based API fuzzing: schemathesis against the live server's /schema/openapi.json.

Schema-valid (positive) and schema-violating (negative) bodies for every API operation;
the server must never answer 5xx, every answer must match the published schema (status
code, content type, body), schema-violating input must be refused with 4xx, and the API
key must really be enforced. Generation is clamped to a few tokens so fuzzing stays fast.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tests.console.server_util import ServerHandle, start_server

MAX_EXAMPLES = 30  # per operation and mode
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection, ignored_auth]
OPERATIONS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET"),
              ("/tokenize", "POST"), ("/detokenize", "POST"), ("/tokenizer_info", "GET"), ("/generate", "POST"),
              ("/generate_stream", "POST")]


@pytest.fixture(scope="module")
def server(tiny_ckpt) -> ServerHandle:
    with start_server(tiny_ckpt) as srv:
        yield srv


def _clamp(body: object) -> None:
    """Keep accepted requests cheap without making a schema-violating body valid: only
    values that already satisfy the schema are lowered (and a chat default capped)."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 1 <= v < 2**63:
            body[key] = min(v, 4)
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 4
    params = body.get("parameters")
    if isinstance(params, dict):
        v = params.get("max_new_tokens")
        if isinstance(v, int) and not isinstance(v, bool) and 1 <= v < 2**63:
            params["max_new_tokens"] = min(v, 4)
        elif "max_new_tokens" not in params:
            params["max_new_tokens"] = 4
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 16:
        body["n"] = min(n, 2)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize("path,method", OPERATIONS, ids=[p for p, _ in OPERATIONS])
def test_fuzz_operation(server, path, method, mode):
    schema = schemathesis.openapi.from_url(server.url + "/schema/openapi.json")
    operation = schema[path][method]
    model = server.model

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        if isinstance(case.body, dict) and mode is GenerationMode.POSITIVE and "model" in case.body:
            # a served model id: otherwise nearly every schema-valid body is a 400 "unknown model"
            case.body["model"] = model
        _clamp(case.body)
        case.call_and_validate(base_url=server.url, headers=server.headers, checks=CHECKS, timeout=60)

    run()
    assert server.proc.poll() is None  # still serving
    assert server.wait_metric("pagedjax:kv_blocks", 0, state="used") == 0
