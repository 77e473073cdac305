"""Shared assertions for the end-to-end suite."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .harness import Response

REPLAY = "x-idempotent-replay"

# A wasm panic or trap in an Envoy log line.
PANIC = re.compile(r"panicked at|Uncaught RuntimeError|wasm trap|Function: proxy_on_\w+ failed|VM is in a failed state",
                   re.IGNORECASE)


def panic_lines(text: str) -> list[str]:
    """The lines of a log that show a wasm panic or trap (`PANIC`)."""
    return [ln for ln in text.splitlines() if PANIC.search(ln)]


def log_panics(paths: list[Path]) -> list[str]:
    """`<log>:<line number>: <line>` for every panic or trap line in the given log files (a file
    that cannot be read is reported as such, so a check never passes for want of reading)."""
    bad = []
    for path in paths:
        try:
            text = Path(path).read_text("utf-8", "replace")
        except OSError as e:
            bad.append(f"{path}: cannot read the log: {e}")
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if PANIC.search(line):
                bad.append(f"{path}:{n}: {line}")
    return bad


def assert_problem(resp: Response, status: int, raw_key: str | bytes | None = None,
                   code: str | None = None) -> dict:
    """An RFC 9457 problem produced by the filter: status, content type, type/title/status/detail
    and the stable `code` member (a non-empty string; equal to `code` when given)."""
    assert resp.status == status, resp
    ctype = resp.header("content-type") or ""
    assert ctype.split(";")[0].strip().lower() == "application/problem+json", resp
    doc = json.loads(resp.body)
    assert isinstance(doc, dict), resp
    for field in ("type", "title", "detail", "code"):
        assert isinstance(doc.get(field), str) and doc[field], (field, resp)
    if code is not None:
        assert doc["code"] == code, (code, resp)
    assert doc.get("status") == status, resp
    assert resp.header(REPLAY) is None, resp
    if raw_key:
        raw = raw_key if isinstance(raw_key, bytes) else raw_key.encode()
        assert raw not in resp.body, f"problem body echoes the raw key: {resp}"
    return doc


def assert_executed(resp: Response, status: int = 201) -> dict | None:
    """A response that came from the upstream (not a replay)."""
    assert resp.status == status, resp
    assert resp.header(REPLAY) is None, resp
    assert resp.header("x-upstream-id"), resp
    if resp.body and (resp.header("content-type") or "").startswith("application/json"):
        return json.loads(resp.body)
    return None


def assert_replay_of(replay: Response, original: Response, kept=("content-type", "location")) -> None:
    """`replay` is the filter's replay of `original`: same status, body bytes, kept headers."""
    assert replay.status == original.status, (replay, original)
    assert replay.body == original.body, (replay, original)
    assert replay.header(REPLAY) == "true", replay
    for name in kept:
        assert replay.header(name) == original.header(name), (name, replay, original)
    # Headers outside the allow-list are not part of the record.
    assert replay.header("x-upstream-id") is None, replay


def body_json(resp: Response) -> dict:
    return json.loads(resp.body)
