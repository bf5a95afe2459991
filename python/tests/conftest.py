"""Under CI=true nothing may be skipped: every skip in these tests stands for a missing
dependency (``pytest.importorskip``, a ``pytest.skip`` or ``skipif`` on a package that is not
installed), which CI installs, so there a skipped test or test module fails instead, with the
reason it would have skipped for. Outside CI the skips stay skips."""

from __future__ import annotations

import os

import pytest

CI = os.environ.get("CI") == "true"


def _fail_the_skip(rep) -> None:
    if CI and rep.skipped and not hasattr(rep, "wasxfail"):
        why = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        rep.outcome = "failed"
        rep.longrepr = f"CI=true: nothing may be skipped, but this was: {why}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_the_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_the_skip(outcome.get_result())
