"""Helpers of the end-to-end suite: a package, not tests (pytest collects only
the test_*.py files of the group folders beside it, tests/contract/ and the others).

Test files import them as `from support import harness as h`, `from support.checks import ...`
(tests/pytest.ini puts tests/ on `sys.path`). The helper servers here are also started as
processes by path (`harness.SUPPORT / "upstream.py"`, ...), so they import their one sibling,
`testserver`, either way.
"""
