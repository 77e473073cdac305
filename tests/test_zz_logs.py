"""Runs last for each backend: the filter never panicked or trapped during the suite."""

from __future__ import annotations

import re

PANIC = re.compile(r"panicked at|Uncaught RuntimeError|wasm trap|Function: proxy_on_\w+ failed|VM is in a failed state",
                   re.IGNORECASE)


def test_no_wasm_panics_in_envoy_log(stack):
    bad = [ln for ln in stack.envoy.log_text().splitlines() if PANIC.search(ln)]
    assert not bad, "\n".join(bad[:20])
