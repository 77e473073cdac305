"""A counting gRPC upstream and real grpcio clients for the gRPC end-to-end tests.

The service is tests/support/grpc/orders.proto (`idem.test.v1.Orders`), compiled once per
process by `protos()` with grpc_tools.protoc into a temporary directory: nothing generated is
kept in the repository, and the .proto stays the one source of truth.

`OrdersServer` runs in this process (a `grpc.server` on a free loopback port), so tests read
its counts directly: every call that reaches a handler is one *execution*, recorded with its
method name, the value of its `idempotency-key` metadata (or "") and its request bytes.

How a call answers is chosen per call by request metadata, so each test picks its own (the
gRPC analogue of tests/support/upstream.py's `x-test-*` headers):

* `x-test-delay-ms: N`: sleep N ms before answering (`stop()` cuts the sleep short).
* `x-test-grpc-status: CODE` (an int, e.g. 5) and `x-test-grpc-message: TEXT`: end the call
  with that status; still one execution.
* `x-test-first-status: CODE`: only the first execution of this method and idempotency-key
  ends with CODE (at once, without the delay); later ones behave normally: a failure that a
  retry gets past.
* `x-test-binary: 1` (CreateOrder): initial metadata `x-order-bin` (BIN_VALUE: binary, with
  0x00 and 0xff) and `x-order-id`, trailing metadata `x-trace-bin` (TRACE_BIN) and `x-trace`,
  and `grpc-status-details-bin`: an `RpcStatus` (wire-compatible with google.rpc.Status) with
  the call's final code and message, also when that code is OK. With `x-test-grpc-status` too,
  the error carries the same headers and trailers. (Not `x-test-bin`: gRPC takes every key
  ending in `-bin` as binary, and grpcio refuses a str value for one.)

Without `x-test-binary` an error is a trailers-only response (grpcio sends one HEADERS frame,
grpc-status in it, and no message), with it the error comes after headers: tests get both.

grpcio 1.85 and grpc-status-details-bin: the server may set it in the trailing metadata with
any status, OK included (`context.set_trailing_metadata`), and the client gets it back byte for
byte in `trailing_metadata()`; nothing in grpcio reads or rejects it. Like every `-bin` key it
travels base64-encoded (unpadded) in the HTTP/2 trailers, so a proxy sees base64 text.

The client helpers open a real grpcio channel per call (`open_channel(port)` when a test wants
several calls on one connection) with 8 MiB message limits, as does the server.
"""

from __future__ import annotations

import atexit
import importlib.resources
import importlib.util
import itertools
import shutil
import sys
import tempfile
import threading
import uuid
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Iterable, Sequence

import grpc

from . import harness as h

PROTO = Path(__file__).resolve().parent / "grpc" / "orders.proto"
SERVICE = "idem.test.v1.Orders"
CREATE_ORDER = f"/{SERVICE}/CreateOrder"
LIST_ORDERS = f"/{SERVICE}/ListOrders"
CHAT = f"/{SERVICE}/Chat"
UPLOAD = f"/{SERVICE}/Upload"
KEY = "idempotency-key"
MAX_MESSAGE = 8 * 1024 * 1024
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE),
                   ("grpc.max_receive_message_length", MAX_MESSAGE)]
# The x-test-binary values: every byte class a proxy could mangle (NUL, 0xff, high bits, ASCII).
BIN_VALUE = b"\x00\xff\x01\x80idem\x7f\x00"
TRACE_BIN = bytes(range(256))
STATUS_DETAILS = "grpc-status-details-bin"

Metadata = Sequence[tuple[str, "str | bytes"]]

# --------------------------------------------------------------------------------------------
# generated code
# --------------------------------------------------------------------------------------------

_PROTOS: tuple[ModuleType, ModuleType] | None = None
_PROTOS_LOCK = threading.Lock()


def protos() -> tuple[ModuleType, ModuleType]:
    """(orders_pb2, orders_pb2_grpc), compiled from orders.proto on first use.

    The generated orders_pb2_grpc does `import orders_pb2`, so orders_pb2 is registered under
    that name in sys.modules; the temporary directory is never put on sys.path."""
    global _PROTOS
    with _PROTOS_LOCK:
        if _PROTOS is None:
            from grpc_tools import protoc  # only needed here

            out = tempfile.mkdtemp(prefix="idem-grpc-protos-")
            atexit.register(shutil.rmtree, out, True)
            includes = importlib.resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
            rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO.parent}", f"-I{includes}",
                              f"--python_out={out}", f"--grpc_python_out={out}", PROTO.name])
            if rc != 0:
                raise h.HarnessError(f"grpc_tools.protoc failed ({rc}) on {PROTO}")
            _PROTOS = (_load("orders_pb2", out), _load("orders_pb2_grpc", out))
        return _PROTOS


def _load(name: str, directory: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, Path(directory) / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def decode_order(data: bytes):
    """An Order message from its serialized bytes."""
    return protos()[0].Order.FromString(data)


def blob(n: int) -> bytes:
    """The Order.blob of reply_bytes=n: the bytes 0..255 repeated to exactly n bytes."""
    return (TRACE_BIN * (n // 256 + 1))[:n]


def status_code(value: int | str) -> grpc.StatusCode:
    """grpc.StatusCode of a numeric code (5 -> NOT_FOUND)."""
    n = int(value)
    for code in grpc.StatusCode:
        if code.value[0] == n:
            return code
    raise ValueError(f"no gRPC status code {value!r}")


# --------------------------------------------------------------------------------------------
# server
# --------------------------------------------------------------------------------------------

@dataclass
class _Call:
    method: str
    key: str
    request: bytearray = field(default_factory=bytearray)


class OrdersServer:
    """idem.test.v1.Orders in this process, counting every execution (thread-safe).

    64 worker threads, so 20+ concurrent calls (e.g. a burst of retries held by
    x-test-delay-ms) all run at once rather than queueing in the server."""

    def __init__(self, workers: int = 64):
        self.workers = workers
        self.port = 0
        self._server: grpc.Server | None = None
        self._lock = threading.Lock()
        self._calls: list[_Call] = []
        self._failed_first: set[tuple[str, str]] = set()
        # Order.execution: never reset, so an answer replayed from before a reset() stays told apart.
        self._executions = itertools.count(1)
        self._stopping = threading.Event()

    def start(self) -> "OrdersServer":
        pb2, _ = protos()
        self._stopping.clear()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.workers,
                                                        thread_name_prefix="orders"),
                             options=CHANNEL_OPTIONS)
        ser = lambda m: m.SerializeToString()  # noqa: E731
        # Requests are taken as raw bytes (no deserializer): calls() keeps them exactly as sent.
        handlers = {
            "CreateOrder": grpc.unary_unary_rpc_method_handler(self._create_order, response_serializer=ser),
            "ListOrders": grpc.unary_stream_rpc_method_handler(self._list_orders, response_serializer=ser),
            "Chat": grpc.stream_stream_rpc_method_handler(self._chat, response_serializer=ser),
            "Upload": grpc.stream_unary_rpc_method_handler(self._upload, response_serializer=ser),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.port = h.free_port()
        if server.add_insecure_port(f"{h.LOOPBACK}:{self.port}") != self.port:
            raise h.HarnessError(f"OrdersServer: could not bind {h.LOOPBACK}:{self.port}")
        server.start()
        self._server = server
        return self

    def stop(self, grace: float = 0.5) -> None:
        """Stops serving; sleeping handlers wake up at once (the calls in flight get their
        answers or CANCELLED within `grace`)."""
        self._stopping.set()
        if self._server is not None:
            self._server.stop(grace).wait(grace + 5)
            self._server = None

    def __enter__(self) -> "OrdersServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- what tests read ----

    def executions(self, method: str | None = None, key: str | None = None) -> int:
        """How many calls reached a handler, optionally only of `method` ("CreateOrder") and
        with idempotency-key `key` ("" for calls without one)."""
        with self._lock:
            return sum(1 for c in self._calls
                       if (method is None or c.method == method) and (key is None or c.key == key))

    def calls(self) -> list[tuple[str, str, bytes]]:
        """(method, key, request bytes) of every execution, in order. For a streaming request
        the bytes are its messages concatenated (as far as they were read)."""
        with self._lock:
            return [(c.method, c.key, bytes(c.request)) for c in self._calls]

    def reset(self) -> None:
        """Forgets the executions and the x-test-first-status keys (Order.execution goes on)."""
        with self._lock:
            self._calls.clear()
            self._failed_first.clear()

    # ---- handlers ----

    def _begin(self, method: str, context, request: bytes = b"") -> tuple[_Call, int, dict]:
        """Counts the execution, then applies x-test-first-status, x-test-delay-ms and
        x-test-grpc-status (this one unless `x-test-binary` wants to send metadata first).
        Returns the record, its execution number and the request metadata (first values)."""
        meta: dict[str, str | bytes] = {}
        for m in context.invocation_metadata():
            meta.setdefault(m.key, m.value)
        key = meta.get(KEY, "")
        call = _Call(method, key, bytearray(request))
        with self._lock:
            self._calls.append(call)
            execution = next(self._executions)
            first = "x-test-first-status" in meta and (method, key) not in self._failed_first
            if first:
                self._failed_first.add((method, key))
        if first:
            context.abort(status_code(meta["x-test-first-status"]), "first execution fails")
        delay = int(meta.get("x-test-delay-ms", 0))
        if delay > 0:
            self._stopping.wait(delay / 1000)
        if "x-test-grpc-status" in meta and meta.get("x-test-binary") != "1":
            self._abort(context, meta)
        return call, execution, meta

    @staticmethod
    def _abort(context, meta: dict) -> None:
        context.abort(status_code(meta["x-test-grpc-status"]), meta.get("x-test-grpc-message", ""))

    def _order(self, pb2, request, execution: int):
        return pb2.Order(id=str(uuid.uuid4()), item=request.item, quantity=request.quantity,
                         execution=execution, blob=blob(request.reply_bytes))

    def _create_order(self, raw: bytes, context):
        pb2, _ = protos()
        _, execution, meta = self._begin("CreateOrder", context, raw)
        if meta.get("x-test-binary") == "1":
            failing = "x-test-grpc-status" in meta
            code = status_code(meta["x-test-grpc-status"]) if failing else grpc.StatusCode.OK
            message = meta.get("x-test-grpc-message", "") if failing else "ok"
            details = pb2.RpcStatus(code=code.value[0], message=message)
            details.details.add().Pack(pb2.ChatMessage(text="detail \x00 \u00e9"))
            context.send_initial_metadata([("x-order-bin", BIN_VALUE), ("x-order-id", f"order-{execution}")])
            # grpcio takes grpc-status-details-bin here with any status, OK included (see the
            # module docstring); abort() keeps the trailing metadata set before it.
            context.set_trailing_metadata([("x-trace-bin", TRACE_BIN), ("x-trace", f"trace-{execution}"),
                                           (STATUS_DETAILS, details.SerializeToString())])
            if failing:
                self._abort(context, meta)
        return self._order(pb2, pb2.CreateOrderRequest.FromString(raw), execution)

    def _list_orders(self, raw: bytes, context):
        pb2, _ = protos()
        _, execution, _ = self._begin("ListOrders", context, raw)
        request = pb2.ListOrdersRequest.FromString(raw)
        for i in range(request.count):
            yield pb2.Order(id=str(uuid.uuid4()), item=f"item-{i}", quantity=i, execution=execution)

    def _chat(self, requests, context):
        pb2, _ = protos()
        call, _, _ = self._begin("Chat", context)
        for raw in requests:
            with self._lock:
                call.request += raw
            yield pb2.ChatMessage(text=pb2.ChatMessage.FromString(raw).text)

    def _upload(self, requests, context):
        pb2, _ = protos()
        call, execution, _ = self._begin("Upload", context)
        items, quantity = [], 0
        for raw in requests:
            with self._lock:
                call.request += raw
            request = pb2.CreateOrderRequest.FromString(raw)
            items.append(request.item)
            quantity += request.quantity
        return pb2.Order(id=str(uuid.uuid4()), item=",".join(items), quantity=quantity, execution=execution)


# --------------------------------------------------------------------------------------------
# clients
# --------------------------------------------------------------------------------------------

@dataclass
class GrpcResult:
    """One unary call as the client saw it: the status, the response message's exact bytes
    (None on an error) and both metadata lists, in order (`-bin` values as bytes)."""
    code: grpc.StatusCode
    details: str | None
    message: bytes | None
    initial: list[tuple[str, str | bytes]]
    trailing: list[tuple[str, str | bytes]]

    def initial_value(self, key: str) -> str | bytes | None:
        return next((v for k, v in self.initial if k == key), None)

    def trailing_value(self, key: str) -> str | bytes | None:
        return next((v for k, v in self.trailing if k == key), None)

    def order(self):
        """The response decoded as an Order."""
        assert self.message is not None, f"no response message: {self.code} {self.details!r}"
        return decode_order(self.message)


def open_channel(port: int) -> grpc.Channel:
    """A plaintext channel to 127.0.0.1:port with 8 MiB message limits (close it when done)."""
    return grpc.insecure_channel(f"{h.LOOPBACK}:{port}", options=CHANNEL_OPTIONS)


def _pairs(metadata) -> list[tuple[str, str | bytes]]:
    return [(m[0], m[1]) for m in (metadata or ())]


def _with_key(metadata: Metadata, key: str | None) -> list[tuple[str, str | bytes]]:
    return ([(KEY, key)] if key is not None else []) + list(metadata)


def raw_unary(port: int, method_path: str, request_bytes: bytes, metadata: Metadata = (),
              timeout: float = 10.0, channel: grpc.Channel | None = None) -> GrpcResult:
    """One unary call of `method_path` with `request_bytes` as the message, no (de)serializers:
    the message sent and the one returned are exact bytes. Errors are results, not exceptions."""
    ch = channel or open_channel(port)
    try:
        method = ch.unary_unary(method_path, request_serializer=None, response_deserializer=None)
        try:
            response, call = method.with_call(request_bytes, metadata=list(metadata), timeout=timeout)
        except grpc.RpcError as e:
            return GrpcResult(e.code(), e.details() or None, None,
                              _pairs(e.initial_metadata()), _pairs(e.trailing_metadata()))
        return GrpcResult(call.code(), call.details() or None, response,
                          _pairs(call.initial_metadata()), _pairs(call.trailing_metadata()))
    finally:
        if channel is None:
            ch.close()


def create_order(port: int, key: str | None = None, item: str = "book", quantity: int = 1,
                 reply_bytes: int = 0, metadata: Metadata = (), timeout: float = 10.0,
                 channel: grpc.Channel | None = None) -> GrpcResult:
    """CreateOrder with `key` as idempotency-key metadata (none when None)."""
    pb2, _ = protos()
    request = pb2.CreateOrderRequest(item=item, quantity=quantity, reply_bytes=reply_bytes)
    return raw_unary(port, CREATE_ORDER, request.SerializeToString(), _with_key(metadata, key),
                     timeout, channel)


def _streaming(port: int, make_call, channel: grpc.Channel | None):
    """Runs make_call(channel) -> list of replies; (StatusCode, replies), errors included."""
    ch = channel or open_channel(port)
    try:
        try:
            return grpc.StatusCode.OK, make_call(ch)
        except grpc.RpcError as e:
            return e.code(), []
    finally:
        if channel is None:
            ch.close()


def list_orders(port: int, count: int, key: str | None = None, metadata: Metadata = (),
                timeout: float = 10.0, channel: grpc.Channel | None = None):
    """ListOrders (server streaming): (StatusCode, list of Order)."""
    pb2, _ = protos()
    request = pb2.ListOrdersRequest(count=count)

    def run(ch):
        method = ch.unary_stream(LIST_ORDERS, request_serializer=pb2.ListOrdersRequest.SerializeToString,
                                 response_deserializer=pb2.Order.FromString)
        return list(method(request, metadata=_with_key(metadata, key), timeout=timeout))
    return _streaming(port, run, channel)


def chat(port: int, texts: Iterable[str], key: str | None = None, metadata: Metadata = (),
         timeout: float = 10.0, channel: grpc.Channel | None = None):
    """Chat (bidirectional streaming): (StatusCode, list of the echoed texts)."""
    pb2, _ = protos()

    def run(ch):
        method = ch.stream_stream(CHAT, request_serializer=pb2.ChatMessage.SerializeToString,
                                  response_deserializer=pb2.ChatMessage.FromString)
        messages = (pb2.ChatMessage(text=t) for t in texts)
        return [m.text for m in method(messages, metadata=_with_key(metadata, key), timeout=timeout)]
    return _streaming(port, run, channel)


def upload(port: int, requests: Iterable, key: str | None = None, metadata: Metadata = (),
           timeout: float = 10.0, channel: grpc.Channel | None = None):
    """Upload (client streaming) of CreateOrderRequests (messages, or dicts of their fields):
    (StatusCode, the Order or None). The Order's item is the items joined by commas, its
    quantity their sum."""
    pb2, _ = protos()
    messages = [r if isinstance(r, pb2.CreateOrderRequest) else pb2.CreateOrderRequest(**r)
                for r in requests]

    def run(ch):
        method = ch.stream_unary(UPLOAD, request_serializer=pb2.CreateOrderRequest.SerializeToString,
                                 response_deserializer=pb2.Order.FromString)
        return method(iter(messages), metadata=_with_key(metadata, key), timeout=timeout)
    code, order = _streaming(port, run, channel)
    return code, (order if code == grpc.StatusCode.OK else None)
