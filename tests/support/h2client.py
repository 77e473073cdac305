"""A small HTTP/2 cleartext client (prior knowledge) on the `h2` package, for tests that need
per-stream control: several requests on one connection, a stream reset (RST_STREAM) while
the others go on. Every wait is bounded by a deadline.

    with H2Client(port) as c:
        sid = c.send("POST", "/orders", [("idempotency-key", "k-1")], b"{}")
        resp = c.response(sid, timeout=1.0)      # None if the stream has no complete answer yet
        if resp is None:
            c.reset(sid)                         # RST_STREAM(CANCEL)
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions

from .harness import LOOPBACK, Response


class H2Error(RuntimeError):
    pass


@dataclass
class _Stream:
    headers: list[tuple[str, str]] = field(default_factory=list)
    data: bytearray = field(default_factory=bytearray)
    ended: bool = False
    reset_code: int | None = None
    started: float = 0.0


class H2Client:
    def __init__(self, port: int, host: str = LOOPBACK, authority: str | None = None,
                 connect_timeout: float = 2.0):
        self.authority = authority or f"{host}:{port}"
        self.sock = socket.create_connection((host, port), timeout=connect_timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.streams: dict[int, _Stream] = {}
        self.terminated: h2.events.ConnectionTerminated | None = None
        self.closed = False
        self._flush()

    # --- plumbing -----------------------------------------------------------------------

    def _flush(self) -> None:
        out = self.conn.data_to_send()
        if out:
            self.sock.sendall(out)

    def _pump(self, deadline: float) -> bool:
        """Read and handle what arrives before `deadline`; False once nothing more can."""
        if self.closed:
            return False
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self.sock.settimeout(remaining)
        try:
            data = self.sock.recv(65536)
        except (TimeoutError, socket.timeout):
            return False
        if not data:
            self.closed = True
            return False
        for ev in self.conn.receive_data(data):
            self._handle(ev)
        self._flush()
        return True

    def _handle(self, ev) -> None:
        sid = getattr(ev, "stream_id", None)
        st = self.streams.get(sid) if sid is not None else None
        if isinstance(ev, h2.events.ResponseReceived) and st is not None:
            st.headers = [(k, v) for k, v in ev.headers]
        elif isinstance(ev, h2.events.DataReceived):
            if st is not None:
                st.data += ev.data
            # Give the flow-control window back, for this stream and the connection.
            self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
        elif isinstance(ev, h2.events.StreamEnded) and st is not None:
            st.ended = True
        elif isinstance(ev, h2.events.StreamReset) and st is not None:
            st.reset_code = int(ev.error_code)
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self.terminated = ev

    # --- API ----------------------------------------------------------------------------

    def send(self, method: str, path: str, headers: list[tuple[str, str]] | None = None,
             body: bytes = b"", trailers: list[tuple[str, str]] | None = None,
             content_length: bool = True) -> int:
        """Send one request (headers, the body, then `trailers` if any, END_STREAM on the last);
        returns the stream id. `content_length=False` leaves the header out."""
        sid = self.conn.get_next_available_stream_id()
        hdrs = [(":method", method), (":scheme", "http"), (":authority", self.authority), (":path", path)]
        hdrs += [(k.lower(), v) for k, v in (headers or [])]
        if body and content_length and not any(k.lower() == "content-length" for k, _ in headers or []):
            hdrs.append(("content-length", str(len(body))))
        self.streams[sid] = _Stream(started=time.monotonic())
        self.conn.send_headers(sid, hdrs, end_stream=not body and not trailers)
        if body:
            # Bodies in these tests fit the initial windows (64 KiB).
            self.conn.send_data(sid, body, end_stream=not trailers)
        if trailers:
            self.conn.send_headers(sid, [(k.lower(), v) for k, v in trailers], end_stream=True)
        self._flush()
        return sid

    def start(self, method: str, path: str, headers: list[tuple[str, str]] | None = None) -> int:
        """Open a request and leave its body to `write`; returns the stream id."""
        sid = self.conn.get_next_available_stream_id()
        hdrs = [(":method", method), (":scheme", "http"), (":authority", self.authority), (":path", path)]
        hdrs += [(k.lower(), v) for k, v in (headers or [])]
        self.streams[sid] = _Stream(started=time.monotonic())
        self.conn.send_headers(sid, hdrs, end_stream=False)
        self._flush()
        return sid

    def write(self, sid: int, data: bytes) -> int:
        """Send as much of `data` (never ending the stream) as the flow-control windows and the
        frame size allow; returns how many bytes went, or -1 once the stream is closed."""
        st = self.streams[sid]
        if st.ended or st.reset_code is not None:
            return -1
        n = min(len(data), self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size)
        if n <= 0:
            return 0
        try:
            self.conn.send_data(sid, data[:n], end_stream=False)
        except h2.exceptions.StreamClosedError:
            return -1
        self._flush()
        return n

    def wait(self, timeout: float) -> None:
        """Read what arrives (answers, window updates) for up to `timeout` seconds."""
        self._pump(time.monotonic() + timeout)

    def response(self, sid: int, timeout: float) -> Response | None:
        """The stream's complete response, or None if it has none within `timeout` seconds.
        A stream reset by the server or a closed connection raises H2Error."""
        st = self.streams[sid]
        deadline = time.monotonic() + timeout
        while not st.ended:
            if st.reset_code is not None:
                raise H2Error(f"stream {sid} reset by the server (error code {st.reset_code})")
            if self.closed or self.terminated is not None:
                raise H2Error(f"connection closed before stream {sid} completed ({self.terminated})")
            if not self._pump(deadline) and time.monotonic() >= deadline:
                return None
        status = 0
        headers = []
        for k, v in st.headers:
            if k == ":status":
                status = int(v)
            else:
                headers.append((k, v))
        return Response(status, headers, bytes(st.data), time.monotonic() - st.started)

    def reset(self, sid: int, code: h2.errors.ErrorCodes = h2.errors.ErrorCodes.CANCEL) -> None:
        """RST_STREAM on one stream; the connection stays open."""
        self.conn.reset_stream(sid, error_code=code)
        self._flush()

    def ping(self, timeout: float = 2.0) -> bool:
        """A PING round trip: the connection is alive and the server reads it."""
        payload = b"idemping"
        self.conn.ping(payload)
        self._flush()
        deadline = time.monotonic() + timeout
        acked = False

        orig = self._handle

        def handle(ev):
            nonlocal acked
            if isinstance(ev, h2.events.PingAckReceived) and ev.ping_data == payload:
                acked = True
            orig(ev)

        self._handle = handle
        try:
            while not acked and self._pump(deadline):
                pass
        finally:
            self._handle = orig
        return acked

    def close(self) -> None:
        if not self.closed:
            try:
                self.conn.close_connection()
                self._flush()
            except Exception:  # noqa: BLE001 - best effort
                pass
            self.closed = True
        self.sock.close()

    def __enter__(self) -> "H2Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
