"""A pytest plugin for runs a time limit may cut (benchmarks/gpu_session.sh): each failure's reason is printed when
the test fails, not in pytest's summary at the end. Use: `pytest -p tests.report_early`."""

from __future__ import annotations

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        print(f"\n--- {report.nodeid} failed in {report.when}:\n{report.longreprtext[-4000:]}", flush=True)
