"""pytest hooks for the whole repository: a notebook cell that writes to stderr fails its test.

nbval (`--nbval-lax`) runs every notebook cell as a test but ignores stderr. A learner reads what a
cell prints, so warnings and log noise are defects: a cell may write to stderr only when it does so on
purpose and says so with the cell tag `stderr-expected`.
"""
import pytest

STDERR_TAG = "stderr-expected"


def unexpected_stderr(outputs, tags):
    """The text a cell wrote to stderr, unless its tags allow it ('' when there is none)."""
    if STDERR_TAG in tags:
        return ""
    return "".join(o.get("text", "") for o in outputs
                   if o.get("output_type") == "stream" and o.get("name") == "stderr")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    outputs = getattr(item, "test_outputs", None)           # set by nbval's cell items
    if call.when != "call" or not report.passed or outputs is None:
        return
    cell = getattr(item, "cell", None)
    tags = cell.metadata.get("tags", []) if cell is not None else []
    text = unexpected_stderr(outputs, tags)
    if text.strip():
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} wrote to stderr (silence it where it comes from, or tag the cell "
                           f"{STDERR_TAG!r} if the learner should see it):\n{text[:3000]}")
