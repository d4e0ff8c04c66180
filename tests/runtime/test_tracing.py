"""Request ledgers as OpenTelemetry spans (runtime/core/tracing.py): a real OTLP/HTTP receiver
(an HTTP server on a free port decoding the protobuf the exporter posts) gets one span per
finished request, with its numbers and one event per decision of its ledger."""

from __future__ import annotations

import threading
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the otel extra (bash scripts/setup.sh otel)")

from runtime.model.sampling import SamplingParams  # noqa: E402
from tests.engine_util import make_engine  # noqa: E402


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces (protobuf), spans kept in order."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

        spans, got = [], threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 -- http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                req = trace_service_pb2.ExportTraceServiceRequest()
                req.ParseFromString(body)
                for rs in req.resource_spans:
                    service = next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name")
                    for ss in rs.scope_spans:
                        spans.extend((service, s, self.path) for s in ss.spans)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                got.set()

            def log_message(self, *args):
                pass

        self.spans, self.got = spans, got
        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def attrs(kvs) -> dict:
    out = {}
    for a in kvs:
        v = a.value
        out[a.key] = (v.string_value if v.HasField("string_value") else v.int_value if v.HasField("int_value")
                      else v.double_value if v.HasField("double_value") else v.bool_value if v.HasField("bool_value")
                      else [x.string_value for x in v.array_value.values])
    return out


def test_finished_requests_arrive_as_spans_with_their_decisions(tiny_ckpt):
    from runtime.core.engine import LLMEngine

    rx = Receiver()
    try:
        base = make_engine(tiny_ckpt, num_blocks=64)
        cfg = replace(base.config, otlp_traces_endpoint=rx.url)
        eng = LLMEngine.from_checkpoint(tiny_ckpt, lambda m: replace(cfg, model=m), warmup=False, progress=False)
        prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 260, size=30)] for i in range(2)]
        reqs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5))
        assert eng.tracing.flush() and rx.got.wait(10)
        assert len(rx.spans) == 2 and {p for _, _, p in rx.spans} == {"/v1/traces"}
        by_id = {attrs(s.attributes)["gen_ai.request.id"]: (svc, s) for svc, s, _ in rx.spans}
        for r in reqs:
            svc, span = by_id[r.request_id]
            a = attrs(span.attributes)
            assert svc == "pagedjax" and span.name == "llm_request"
            assert a["gen_ai.usage.prompt_tokens"] == 30 and a["gen_ai.usage.completion_tokens"] == 5
            assert a["gen_ai.response.finish_reasons"] == ["length"] and a["pagedjax.priority"] == "interactive"
            led = eng.ledger(r.request_id)
            assert [e.name for e in span.events] == [e["kind"] for e in led["entries"]]
            first = attrs(span.events[0].attributes)
            assert first["reason"] == "in the interactive queue" and first["input.position"] >= 1
            assert span.end_time_unix_nano >= span.start_time_unix_nano > 0
        assert eng.tracing.exported == 2
        eng.tracing.shutdown()
    finally:
        rx.close()


def test_the_flag_is_checked(tiny_ckpt):
    from runtime.core.engine import LLMEngine

    base = make_engine(tiny_ckpt, num_blocks=64)
    for bad, msg in (("localhost:4318", "an http\\(s\\) URL"),):
        cfg = replace(base.config, otlp_traces_endpoint=bad)
        with pytest.raises(ValueError, match=f"otlp_traces_endpoint: {msg}"):
            LLMEngine.from_checkpoint(tiny_ckpt, lambda m: replace(cfg, model=m), warmup=False, progress=False)
    cfg = replace(base.config, otlp_traces_endpoint="http://127.0.0.1:9", request_ledger=False)
    with pytest.raises(ValueError, match="otlp_traces_endpoint: the spans are the request ledgers"):
        LLMEngine.from_checkpoint(tiny_ckpt, lambda m: replace(cfg, model=m), warmup=False, progress=False)
