"""Request ledgers as OpenTelemetry spans (`--otlp-traces-endpoint`, vLLM's flag name).

When a request finishes, its decision ledger (runtime/core/ledger.py) becomes one span, from
its first decision to its last, named `llm_request`, with the request's numbers as attributes
(`gen_ai.request.id`, `gen_ai.usage.prompt_tokens`, `gen_ai.usage.completion_tokens`, ... as
vLLM's request spans name them, plus `pagedjax.*`) and one span event per decision (its kind,
reason, inputs and how often it repeated). The SDK's batch processor sends them to the OTLP/HTTP
endpoint on its own thread, so the engine thread only builds the span. Needs the `otel` extra
(opentelemetry-sdk and its OTLP/HTTP exporter); without it the flag is refused in one line.
"""

from __future__ import annotations

from typing import Any

SERVICE_NAME = "pagedjax"


class LedgerExporter:
    def __init__(self, endpoint: str, service_name: str = SERVICE_NAME) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise ValueError("otlp_traces_endpoint: needs OpenTelemetry: bash scripts/setup.sh otel "
                             "(pip install 'pagedjax[otel]')") from None
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"otlp_traces_endpoint: an http(s) URL of an OTLP/HTTP collector, got {endpoint!r}")
        url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
        self.endpoint = url
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        self.tracer = self.provider.get_tracer("pagedjax.ledger")
        self.exported = 0

    def export(self, summary: dict[str, Any], ledger: Any) -> None:
        """One finished request: its summary (LLMEngine._ledger_summary) and its Ledger."""
        entries = ledger.entries
        if not entries:
            return
        ns = lambda t: int(t * 1e9)  # noqa: E731
        attrs = {"gen_ai.request.id": summary["request_id"], "gen_ai.usage.prompt_tokens": summary["prompt_tokens"],
                 "gen_ai.usage.completion_tokens": summary["output_tokens"],
                 "gen_ai.response.finish_reasons": [str(summary.get("finish_reason"))],
                 "pagedjax.priority": summary["priority"], "pagedjax.cached_tokens": summary["cached_tokens"],
                 "pagedjax.preemptions": summary["preemptions"], "pagedjax.ledger_dropped": ledger.dropped}
        span = self.tracer.start_span("llm_request", start_time=ns(entries[0].t), attributes=attrs)
        for d in entries:
            ev: dict[str, Any] = {"reason": d.reason, "count": d.count}
            for k, v in d.inputs.items():
                ev[f"input.{k}"] = v if isinstance(v, (bool, int, float, str)) else repr(v)
            span.add_event(d.kind, ev, timestamp=ns(d.t))
        span.end(end_time=ns(max(d.last_t for d in entries)))
        self.exported += 1

    def flush(self, timeout_ms: int = 5000) -> bool:
        return bool(self.provider.force_flush(timeout_ms))

    def shutdown(self) -> None:
        self.provider.shutdown()
