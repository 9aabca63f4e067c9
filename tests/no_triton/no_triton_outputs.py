"""A pytest plugin for tests/test_without_triton.py: appends what each nbval cell printed to a JSON-lines file.

Loaded with `-p no_triton_outputs` (this folder is on PYTHONPATH); the file is $LABKIT_CELL_OUTPUTS.
"""
import json
import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    outputs = getattr(item, "test_outputs", None)           # set by nbval's cell items once they ran
    if call.when != "call" or outputs is None:
        return
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    with open(os.environ["LABKIT_CELL_OUTPUTS"], "a") as f:
        f.write(json.dumps({"cell": item.name, "passed": report.passed, "text": text}) + "\n")
