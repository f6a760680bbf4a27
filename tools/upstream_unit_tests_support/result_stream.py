"""pytest plugin the runner loads in both runs: each test's outcome, one JSON line as it ends.

pytest writes its junit XML only when the session ends, so a session killed at its deadline
(a test that hangs in a collective, at world size 8) would lose every result it had. This
plugin appends a line per test phase to the file named by ``$UPSTREAM_TEST_RESULT_STREAM``
(a line when a test starts, one per phase that reports) from which the runner rebuilds the
finished tests' results and names the test that was running when the session was killed.
"""

import json
import os


def _write(record: dict) -> None:
    path = os.environ.get("UPSTREAM_TEST_RESULT_STREAM")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _write({"nodeid": nodeid, "event": "start"})


def pytest_runtest_logreport(report):
    message = ""
    if report.failed or report.skipped:
        crash = getattr(report.longrepr, "reprcrash", None)
        if crash is not None:
            message = crash.message
        elif isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
            message = str(report.longrepr[2])  # a skip: (file, line, reason)
        else:
            message = str(report.longrepr or "")
    _write({"nodeid": report.nodeid, "event": report.when, "outcome": report.outcome,
            "message": message.strip().splitlines()[0] if message.strip() else ""})
