"""Helpers of the end-to-end suite: a package, not tests (pytest collects only tests/test_*.py).

Test files import them as `from support import harness as h`, `from support.checks import ...`
(tests/pytest.ini puts tests/ on `sys.path`). The helper servers here are also started as
processes by path (`harness.SUPPORT / "upstream.py"`, ...), so they import their one sibling,
`testserver`, either way.
"""
