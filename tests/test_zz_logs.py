"""Runs last for each backend: the filter never panicked or trapped during the suite."""

from __future__ import annotations

from checks import PANIC


def test_no_wasm_panics_in_envoy_log(stack):
    bad = [ln for ln in stack.envoy.log_text().splitlines() if PANIC.search(ln)]
    assert not bad, "\n".join(bad[:20])
