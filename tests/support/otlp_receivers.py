"""In-process OTLP trace receivers for the tracing tests: an HTTP/protobuf one (POST /v1/traces)
and a gRPC one (TraceService/Export), each decoding ``ExportTraceServiceRequest`` with
opentelemetry-proto into ``ReceivedSpan`` records; and a black hole (a port that accepts
connections and never answers) standing for a dead collector."""

from __future__ import annotations

import gzip
import socket
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import attrs
import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

SPAN_KIND_SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind


@attrs.frozen
class ReceivedSpan:
    name: str
    kind: int
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]


def _value(v: AnyValue) -> Any:
    field = v.WhichOneof("value")
    return None if field is None else getattr(v, field)


def decode(body: bytes) -> list[ReceivedSpan]:
    req = trace_service_pb2.ExportTraceServiceRequest()
    req.ParseFromString(body)
    spans = []
    for rs in req.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(
                    ReceivedSpan(
                        name=s.name,
                        kind=s.kind,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        resource=resource,
                    )
                )
    return spans


class HttpReceiver:
    """POST /v1/traces on 127.0.0.1:<port>; ``spans`` grows as exports arrive."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.paths: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.paths.append(self.path)
                receiver.spans.extend(decode(body))
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GrpcReceiver:
    """OTLP/gRPC TraceService on 127.0.0.1:<port> (plaintext)."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (the rpc's name)
                receiver.spans.extend(decode(request.SerializeToString()))
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=None)


class BlackHole:
    """A listening port whose connections are never accepted: a collector that hangs."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]

    def close(self) -> None:
        self.sock.close()
