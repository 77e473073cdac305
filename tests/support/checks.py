"""Shared assertions for the end-to-end suite."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from .harness import ROOT, Envoy, Response, http_get_status, native

REPLAY = "x-idempotent-replay"

# A problem's `instance`: `urn:uuid:` and a version-4 UUID the filter makes per occurrence
# (src/request/problem/instance.rs), never anything the client sent.
INSTANCE = re.compile(r"^urn:uuid:[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
# The same, inside a log line or a gRPC message.
INSTANCE_IN_TEXT = re.compile(r"urn:uuid:[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")
PROBLEMS_DOC = ROOT / "docs" / "configuration.md"


@functools.cache
def documented_problems() -> dict[str, tuple[int | None, bool]]:
    """`code` -> (HTTP status, `retryable`), read from the table of docs/configuration.md's
    `## Problems` section (rows `| `code` | 422 (or ...) | `false` | ... |`; the status `None`
    for a code only gRPC calls get, `- (gRPC only)`): what clients are told, so that a problem
    saying otherwise fails the test that got it."""
    text = PROBLEMS_DOC.read_text()
    start = text.index("\n## Problems\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end != -1 else len(text)]
    rows = re.findall(r"^\| `([a-z-]+)` \| (\d{3}|-)(?: [^|]*)? \| `(true|false)` \|", section, re.MULTILINE)
    table = {code: (None if status == "-" else int(status), value == "true") for code, status, value in rows}
    assert len(table) == len(rows) and len(table) >= 10, f"{PROBLEMS_DOC}: the Problems table reads as {rows}"
    return table


def documented(code: str) -> tuple[int | None, bool]:
    """The documented (status, retryable) of `code`; a code missing from the table fails."""
    table = documented_problems()
    assert code in table, f"problem code {code!r} is not in the table of {PROBLEMS_DOC} (## Problems): {sorted(table)}"
    return table[code]


def retryable_of(code: str) -> bool:
    return documented(code)[1]


# A wasm panic or trap in an Envoy log line, or a panic the native host caught (its panic hook
# logs `panic: panicked at ...`, then its hook guard `a panic in <hook> was caught; the stream
# goes on unguarded`: src/host/native/module.rs `guard`).
PANIC = re.compile(r"panicked at|Uncaught RuntimeError|wasm trap|Function: proxy_on_\w+ failed|VM is in a failed state"
                   r"|a panic in \w+ was caught", re.IGNORECASE)


def vm_failure_stats(envoy: Envoy, pattern: str = r"^wasm\.") -> dict[str, int]:
    """The counters that move when the wasm filter's VM fails (a trap reloads it under
    FAIL_RELOAD, or is refused within the reload backoff) and the number of V8 VMs ever created
    (a reload creates one), among the /stats matching `pattern`. The native host has no VM to
    fail or reload: a panic in one of its hooks is caught and logged (`PANIC`), anything worse
    is Envoy's crash; so there it checks that Envoy is still running and its admin says LIVE,
    and returns {} (the callers compare before and after, and check the log for `PANIC`)."""
    if native():
        assert envoy.proc.alive(), envoy.proc.describe(60)
        assert http_get_status(envoy.admin_port, "/ready", timeout=5)[1].strip() == b"LIVE", envoy.proc.describe(60)
        return {}
    stats = envoy.stats(pattern)
    assert "wasm.idempotency.vm_reload" in stats and "wasm.envoy.wasm.runtime.v8.created" in stats, stats
    return stats


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
    and the stable `code` member (a non-empty string; equal to `code` when given), `instance`
    (a `urn:uuid:` of this occurrence) and `retryable` (the documented value for the code)."""
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
    assert isinstance(doc.get("instance"), str) and INSTANCE.match(doc["instance"]), ("instance", resp)
    assert doc.get("retryable") is retryable_of(doc["code"]), ("retryable", resp)
    assert resp.header(REPLAY) is None, resp
    if raw_key:
        raw = raw_key if isinstance(raw_key, bytes) else raw_key.encode()
        assert raw not in resp.body, f"problem body echoes the raw key: {resp}"
    return doc


def assert_grpc_problem(details: str | None, code: str) -> str:
    """A gRPC refusal's message (`grpc-message`, as the client decodes it: percent-decoded):
    `<code>: <detail> (instance urn:uuid:...)`, the code given and the detail non-empty.
    Returns the instance."""
    assert details, f"no grpc-message: {details!r}"
    prefix = f"{code}: "
    assert details.startswith(prefix), (code, details)
    m = re.fullmatch(r"(.+) \(instance (" + INSTANCE_IN_TEXT.pattern + r")\)", details[len(prefix):], re.DOTALL)
    assert m and m.group(1).strip(), f"no ` (instance urn:uuid:...)` after the detail: {details!r}"
    retryable_of(code)  # a code the documentation lists
    return m.group(2)


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
