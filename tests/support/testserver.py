"""What the test servers (the counting upstream, the store double) share: a keep-alive HTTP/1.1
handler with TCP_NODELAY that can be told to keep quiet, a threaded server, and the loop that
serves until interrupted. Stdlib only; the demo app keeps its own copy to stay self-contained."""

from __future__ import annotations

import socket
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: Envoy reuses upstream connections
    quiet = False

    def setup(self):
        super().setup()
        # Headers and body leave in separate writes: without TCP_NODELAY, Nagle's algorithm
        # holds the body until the peer's delayed ACK (about 40 ms) on every response.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, fmt: str, *args) -> None:  # noqa: D401 - stdlib signature
        if not self.quiet:
            sys.stdout.write("%s %s\n" % (self.log_date_time_string(), fmt % args))
            sys.stdout.flush()


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128


def serve(server: ThreadingHTTPServer, what: str) -> int:
    """Announces the bound address (tests read the log) and serves until interrupted."""
    host, port = server.server_address[:2]
    print(f"{what} listening on {host}:{port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
