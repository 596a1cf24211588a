"""gRPC server metrics for lockd and the node agent, under the names Prometheus users know.

    grpc_server_started_total{grpc_service, grpc_method, grpc_type}
    grpc_server_handled_total{grpc_service, grpc_method, grpc_type, grpc_code}
    grpc_server_handling_seconds{grpc_service, grpc_method, grpc_type}   (histogram)

(the names and labels of the go-grpc-prometheus convention, so existing
dashboards and alerts apply). One asyncio server interceptor, added where each
server is built; streams are timed until they end.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from timeslice.common.server.metrics_common import LATENCY_BUCKETS


class GrpcServerMetrics(grpc.aio.ServerInterceptor):
    def __init__(self, registry: CollectorRegistry):
        labels = ["grpc_service", "grpc_method", "grpc_type"]
        self.started = Counter("grpc_server_started_total", "RPCs started on the server", labels, registry=registry)
        self.handled = Counter("grpc_server_handled_total", "RPCs completed on the server, by status code",
                               [*labels, "grpc_code"], registry=registry)
        self.seconds = Histogram("grpc_server_handling_seconds", "Time from an RPC's start to its end",
                                 labels, buckets=LATENCY_BUCKETS, registry=registry)

    @staticmethod
    def _code(context, exc: BaseException | None) -> str:
        if isinstance(exc, asyncio.CancelledError):
            return "CANCELLED"
        code = context.code() if hasattr(context, "code") else None
        if code is not None:
            return code.name
        return "UNKNOWN" if exc is not None and not isinstance(exc, grpc.aio.AbortError) else "OK"

    @contextlib.contextmanager
    def _timed(self, labels: tuple[str, str, str], context) -> Iterator[None]:
        """Count the RPC started, then handled (with its code) and its time, however it ends."""
        t0, exc = time.monotonic(), None
        self.started.labels(*labels).inc()
        try:
            yield
        except BaseException as e:
            exc = e
            raise
        finally:
            self.handled.labels(*labels, self._code(context, exc)).inc()
            self.seconds.labels(*labels).observe(time.monotonic() - t0)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        service, _, method = details.method.lstrip("/").rpartition("/")
        if handler.unary_unary is not None:
            inner, kind = handler.unary_unary, "unary"

            async def unary_unary(request, context):
                with self._timed((service, method, kind), context):
                    return await inner(request, context)
            return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream is not None:
            inner_s, kind = handler.unary_stream, "server_stream"

            async def unary_stream(request, context):
                with self._timed((service, method, kind), context):
                    result = inner_s(request, context)
                    if hasattr(result, "__aiter__"):
                        async for item in result:
                            yield item
                    else:                                  # a coroutine that writes with context.write
                        await result
            return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler          # client/bidi streams: none in our APIs; passed through untimed
