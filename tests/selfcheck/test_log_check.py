"""The run-wide panic check (support/log_check.py) checked on its own, without Envoy: the lines
it flags, how it names them, and that a pytest run which started an "Envoy" (a stand-in script
at ENVOY_BIN) logging a panic fails with those lines, while a clean one passes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from support import harness as h
from support.checks import log_panics, panic_lines

# The forms a wasm panic or trap, or a native host's caught panic, takes in Envoy's log (one line
# each, as Envoy 1.40 writes them).
PANICS = {
    "rust_panic": "[2026-12-03 10:00:00.000][17][critical][wasm] [source/extensions/common/wasm/context.cc:1199]"
                  " wasm log idempotency idempotency: panicked at src/machine.rs:120:9: boom",
    "proxy_on_failed": "[2026-12-03 10:00:00.000][17][error][wasm] [source/extensions/common/wasm/wasm_vm.cc:38]"
                       " Function: proxy_on_request_headers failed: Uncaught RuntimeError: unreachable",
    "runtime_error": "[2026-12-03 10:00:00.000][17][error][wasm] Uncaught RuntimeError: memory access out of bounds",
    "wasm_trap": "[2026-12-03 10:00:00.000][17][error][wasm] wasm trap: integer divide by zero",
    "failed_state": "[2026-12-03 10:00:00.000][17][warning][wasm] VM is in a failed state",
    # The native host's: its panic hook's line, then its hook guard's (src/host/native/module.rs).
    "native_panic": "[2026-12-03 10:00:00.000][17][error][dynamic_modules] [:] idempotency: panic: panicked at"
                    " src/request/mod.rs:120:9: boom",
    "native_caught": "[2026-12-03 10:00:00.000][17][error][dynamic_modules] [:] idempotency: a panic in"
                     " request_headers was caught; the stream goes on unguarded",
}

# Lines of a healthy run that look close (a "panic threshold", a refused configuration).
CLEAN = [
    "$ envoy -c /tmp/envoy.yaml --base-id 1000",
    "[2026-12-03 10:00:00.000][17][info][main] [source/server/server.cc:1059] starting main dispatch loop",
    "[2026-12-03 10:00:00.000][17][info][upstream] cluster idemstore healthy_panic_threshold 0",
    "[2026-12-03 10:00:00.000][17][info][wasm] wasm log idempotency idempotency: refused: unknown key `retention`",
    "[2026-12-03 10:00:00.000][17][warning][main] there is no configured limit to the number of connections",
]


@pytest.mark.parametrize("line", PANICS.values(), ids=PANICS.keys())
def test_panic_lines_finds_each_form(line):
    text = "\n".join(CLEAN[:2] + [line] + CLEAN[2:])
    assert panic_lines(text) == [line]


def test_clean_log_has_no_panic_lines():
    assert panic_lines("\n".join(CLEAN)) == []


def test_log_panics_names_file_and_line(tmp_path):
    clean = tmp_path / "envoy.log"
    clean.write_text("\n".join(CLEAN) + "\n")
    bad = tmp_path / "envoy-2.log"
    bad.write_text("\n".join(CLEAN[:2] + [PANICS["rust_panic"], PANICS["wasm_trap"]]) + "\n")
    missing = tmp_path / "envoy-3.log"
    got = log_panics([clean, bad, missing])
    assert got[:2] == [f"{bad}:3: {PANICS['rust_panic']}", f"{bad}:4: {PANICS['wasm_trap']}"]
    assert len(got) == 3 and got[2].startswith(f"{missing}: cannot read the log"), got


# --------------------------------------------------------------------------------------------
# a whole pytest run (in a subprocess: the check reads every Envoy log its process started)
# --------------------------------------------------------------------------------------------

INNER = '''
import os

from support import harness as h


def test_starts_an_envoy(tmp_path, monkeypatch):
    monkeypatch.setenv("ENVOY_BIN", os.environ["FAKE_ENVOY"])
    proc = h.launch_envoy_file(tmp_path, "envoy", tmp_path / "envoy.yaml")
    assert proc.popen.wait(10) == 0
'''

FAILING_THEN_MORE = '''

def test_fails():
    assert False, "an ordinary failure"


def test_not_run_after_x():
    pass
'''


def fake_envoy(tmp_path: Path, lines: list[str]) -> Path:
    """A stand-in for the Envoy binary that writes `lines` to its log and exits."""
    path = tmp_path / "bin" / "envoy"
    path.parent.mkdir()
    path.write_text("#!/bin/sh\n" + "".join(f"printf '%s\\n' '{ln}'\n" for ln in lines))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def run_inner(pytester, monkeypatch, tmp_path, lines, source=INNER, *args):
    monkeypatch.setenv("FAKE_ENVOY", str(fake_envoy(tmp_path, lines)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(h.TESTS), os.environ.get("PYTHONPATH")])))
    pytester.makepyfile(test_inner=source)
    return pytester.runpytest_subprocess("-p", "support.log_check", "-p", "no:cacheprovider", *args)


def test_run_fails_naming_the_panic_lines(pytester, monkeypatch, tmp_path):
    result = run_inner(pytester, monkeypatch, tmp_path, CLEAN[1:3] + [PANICS["proxy_on_failed"]])
    result.assert_outcomes(passed=1, errors=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_starts_an_envoy*",
        "wasm panic or trap in the Envoy logs of this run (1 line(s)):",
    ])
    assert f"/envoy.log:4: {PANICS['proxy_on_failed']}\n" in result.stdout.str()


def test_run_passes_with_clean_envoy_logs(pytester, monkeypatch, tmp_path):
    result = run_inner(pytester, monkeypatch, tmp_path, CLEAN[1:])
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK


def test_run_cut_short_by_x_still_fails_on_the_panic(pytester, monkeypatch, tmp_path):
    """-x stops the run at the first failure: the check still runs, at that test's teardown."""
    result = run_inner(pytester, monkeypatch, tmp_path, [PANICS["rust_panic"]], INNER + FAILING_THEN_MORE, "-x")
    result.assert_outcomes(passed=1, failed=1, errors=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_fails*"])
    assert f"/envoy.log:2: {PANICS['rust_panic']}\n" in result.stdout.str()
