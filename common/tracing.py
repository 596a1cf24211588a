"""Opt-in OpenTelemetry traces: one trace per handoff, across the job, lockd and the node agent.

Off unless ``TIMESLICE_TRACING`` is set; then the ``trace`` extra (opentelemetry-api,
-sdk, the OTLP exporter) must be installed. While off, nothing here imports
opentelemetry and every helper is a constant-time no-op, so the lean client pays
nothing. Values of ``TIMESLICE_TRACING``:

* ``otlp`` (or ``1``/``true``/``on``): spans go to an OTLP collector, configured by the
  standard variables (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``..._TRACES_ENDPOINT``,
  ``OTEL_EXPORTER_OTLP_PROTOCOL`` grpc|http/protobuf, headers, ``OTEL_SERVICE_NAME``,
  ``OTEL_RESOURCE_ATTRIBUTES``), batched, flushed at exit;
* ``console``: spans printed to stderr (one JSON object each);
* ``file:<path>``: one JSON line per finished span appended to ``<path>`` (tests, a
  quick look without a collector); ``<path>`` may contain ``{pid}``.

The context crosses processes as a W3C ``traceparent``: in gRPC metadata from the
client to lockd, and in the queue entry (``records.QueueValue.trace``) from the
replica that serves the Acquire to the leader and the node agents. The leader
creates its intent spans with ids derived from the trace and the intent's key and
revision (``intent_span_id``), so an agent that sees the intent makes its spans that
span's children without any id travelling through etcd.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any, cast

ENV = "TIMESLICE_TRACING"
TRACEPARENT = "traceparent"
_OFF = ("", "0", "false", "no", "off", "none")

_lock = threading.Lock()
_state: dict[str, Any] = {"ready": False, "on": False, "provider": None, "ids": None}


def enabled() -> bool:
    """True if traces are on (set up on first use, from ``TIMESLICE_TRACING``)."""
    if not _state["ready"]:
        setup()
    return bool(_state["on"])


def setup(service: str | None = None, attributes: Mapping[str, str] | None = None) -> bool:
    """Configure this process's tracer provider once (idempotent); returns whether traces are on."""
    with _lock:
        if _state["ready"]:
            return bool(_state["on"])
        mode = os.environ.get(ENV, "").strip()
        _state["ready"] = True
        if mode.lower() in _OFF:
            return False
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        ids = _make_ids()
        name = os.environ.get("OTEL_SERVICE_NAME") or service or "timeslice-job"
        resource = Resource.create({"service.name": name, **dict(attributes or {})})
        provider = TracerProvider(resource=resource, id_generator=ids)
        if mode.startswith("file:"):
            provider.add_span_processor(SimpleSpanProcessor(cast(Any, _FileExporter(mode[len("file:"):]))))
        elif mode == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
        else:
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
        trace.set_tracer_provider(provider)
        _state.update(on=True, provider=provider, ids=ids)
        return True


def shutdown() -> None:
    """Flush and stop (servers call it on the way out; the SDK also does it at exit)."""
    provider = _state.get("provider")
    if provider is not None:
        provider.shutdown()


def _otlp_exporter():
    proto = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
             or "grpc")
    if proto.startswith("http"):      # needs opentelemetry-exporter-otlp-proto-http, not in the extra
        return importlib.import_module("opentelemetry.exporter.otlp.proto.http.trace_exporter").OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def tracer(name: str = "timeslice"):
    from opentelemetry import trace
    return trace.get_tracer(name)


# -- spans -----------------------------------------------------------------------------------

@contextlib.contextmanager
def span(name: str, *, kind: str = "internal", parent: str = "", attributes: Mapping[str, Any] | None = None,
         start_ns: int | None = None) -> Iterator[Any]:
    """A span made current for the block (None when traces are off). ``parent``: a traceparent
    to continue (else the current span, else a new trace)."""
    if not enabled():
        yield None
        return
    ctx = context_of(parent) if parent else None
    with tracer().start_as_current_span(name, context=ctx, kind=_kind(kind), attributes=_attrs(attributes),
                                        start_time=start_ns, record_exception=True,
                                        set_status_on_exception=True) as s:
        yield s


def record(name: str, *, start_ns: int, end_ns: int, parent: str = "", kind: str = "internal",
           attributes: Mapping[str, Any] | None = None, span_id: int = 0, error: str = "") -> str:
    """A span that already happened (explicit times); ``span_id``: the id it must have
    (``intent_span_id``). Returns its traceparent ("" when off)."""
    if not enabled():
        return ""
    from opentelemetry.trace import Status, StatusCode
    ctx = context_of(parent) if parent else None
    ids = _state["ids"]
    with ids.next_span_id(span_id):
        s = tracer().start_span(name, context=ctx, kind=_kind(kind), attributes=_attrs(attributes),
                                start_time=start_ns)
    if error:
        s.set_status(Status(StatusCode.ERROR, error[:500]))
    s.end(end_time=max(end_ns, start_ns))
    return _traceparent_of(s.get_span_context())


def set_attributes(s: Any, attributes: Mapping[str, Any]) -> None:
    if s is not None:
        s.set_attributes(_attrs(attributes))


# -- context across processes ---------------------------------------------------------------

def traceparent() -> str:
    """The current span's W3C traceparent ("" when off or outside a span)."""
    if not enabled():
        return ""
    from opentelemetry import trace
    return _traceparent_of(trace.get_current_span().get_span_context())


def metadata() -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying the current span (None when there is none)."""
    tp = traceparent()
    return ((TRACEPARENT, tp),) if tp else None


def from_metadata(md: Any) -> str:
    """The traceparent in a call's invocation metadata ("" if none or malformed)."""
    for key, value in md or ():
        if key == TRACEPARENT and isinstance(value, str) and _parse(value):
            return value
    return ""


def context_of(tp: str):
    """An OpenTelemetry context whose parent is ``tp`` (None if ``tp`` does not parse)."""
    parsed = _parse(tp)
    if parsed is None:
        return None
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
    trace_id, span_id, flags = parsed
    sc = SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags))
    return trace.set_span_in_context(NonRecordingSpan(sc))


def child_of(tp: str, span_id: int) -> str:
    """The traceparent of span ``span_id`` in ``tp``'s trace (a parent known only by its id)."""
    parsed = _parse(tp)
    return f"00-{parsed[0]:032x}-{span_id:016x}-{parsed[2]:02x}" if parsed and span_id else ""


def intent_span_id(tp: str, intent_key: bytes, revision: int) -> int:
    """The id of the leader's span for the intent at (``intent_key``, ``revision``) in ``tp``'s trace:
    the leader and the agent both derive it, so nothing but the intent has to be seen by both."""
    parsed = _parse(tp)
    if parsed is None:
        return 0
    h = hashlib.sha256(f"{parsed[0]:032x}".encode() + b"|" + intent_key + b"|" + str(revision).encode()).digest()
    return int.from_bytes(h[:8], "big") or 1


def _parse(tp: str) -> tuple[int, int, int] | None:
    parts = (tp or "").strip().split("-")
    if len(parts) != 4 or parts[0] != "00" or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return None
    return (trace_id, span_id, flags) if trace_id and span_id else None


def _traceparent_of(sc) -> str:
    if not sc.is_valid:
        return ""
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def _kind(kind: str):
    from opentelemetry.trace import SpanKind
    return {"client": SpanKind.CLIENT, "server": SpanKind.SERVER, "producer": SpanKind.PRODUCER,
            "consumer": SpanKind.CONSUMER}.get(kind, SpanKind.INTERNAL)


def _attrs(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in (attributes or {}).items():
        if v is None:
            continue
        out[k] = v if isinstance(v, (bool, int, float, str)) else str(v)
    return out


def _make_ids() -> Any:
    """The SDK's random ids, except for a span whose id is given (``record(span_id=...)``)."""
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class Ids(RandomIdGenerator):
        def __init__(self) -> None:
            self._fixed = threading.local()

        @contextlib.contextmanager
        def next_span_id(self, span_id: int) -> Iterator[None]:
            self._fixed.value = span_id or 0
            try:
                yield
            finally:
                self._fixed.value = 0

        def generate_span_id(self) -> int:
            fixed = getattr(self._fixed, "value", 0)
            if fixed:
                self._fixed.value = 0
                return fixed
            return super().generate_span_id()

    return Ids()


class _FileExporter:
    """Finished spans as JSON lines (name, ids, parent, kind, times, attributes, status, service)."""

    def __init__(self, path: str):
        self.path = path.replace("{pid}", str(os.getpid()))
        self._lock = threading.Lock()

    def export(self, spans) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult
        lines = []
        for s in spans:
            ctx, parent = s.get_span_context(), s.parent
            lines.append(json.dumps({
                "name": s.name, "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
                "parent_id": f"{parent.span_id:016x}" if parent else "", "kind": s.kind.name,
                "start_ns": s.start_time, "end_ns": s.end_time, "attributes": dict(s.attributes or {}),
                "status": s.status.status_code.name, "service": s.resource.attributes.get("service.name", ""),
                "pid": os.getpid()}, sort_keys=True))
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
