"""The client side of the store double (`store_double.py`, an idemstore that misbehaves on
purpose): `StoreDouble` starts it as its own process and drives it (`mode`, `reset`, `stats`),
and `http1_cluster` is the Envoy store cluster to reach it (the double speaks HTTP/1.1 only).
Used by the fault drills (test_drills.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import harness as h

JSON = ("content-type", "application/json")


class StoreDouble:
    """Client of store_double.py running as its own process."""

    def __init__(self, run_dir: Path, name: str = "store-double", target: int | None = None):
        self.port = h.free_port()
        argv = [sys.executable, str(h.SUPPORT / "store_double.py"), "--port", str(self.port), "--quiet"]
        if target is not None:
            argv += ["--target", str(target)]
        self.proc = h.start(name, argv, run_dir)
        h.await_ready(self.proc, lambda: h.http_get_status(self.port, "/__health")[0] == 200,
                      f"{name} /__health")

    def _post(self, path: str, doc: dict | None = None) -> dict:
        r = h.request(self.port, "POST", path, json.dumps(doc or {}), [JSON], timeout=5)
        assert r.status == 200, r
        return r.json()

    def mode(self, **doc) -> dict:
        return self._post("/__mode", doc)

    def reset(self) -> None:
        self._post("/__reset")

    def stats(self) -> dict:
        status, body = h.http_get_status(self.port, "/__stats", timeout=5)
        assert status == 200
        return json.loads(body)

    def stop(self) -> None:
        self.proc.stop()


def http1_cluster(name: str, port: int) -> dict:
    """A store cluster over HTTP/1.1 (the double does not speak h2c), as shipped otherwise."""
    c = h.store_cluster(port, name=name)
    del c["typed_extension_protocol_options"]
    return c
