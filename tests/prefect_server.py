"""One real Prefect API server for the whole test session (it takes 10-35 s to start here).

Prefect reads its settings at import, so the environment is set when this plugin is imported
(tests/conftest.py names it): a throwaway PREFECT_HOME, no telemetry, a generous start-up
timeout. The server runs in a subprocess on 127.0.0.1 with a temporary SQLite database and is
stopped by its own handle when the session ends.
"""

import atexit
import os
import shutil
import tempfile

import pytest

_home = tempfile.mkdtemp(prefix="grpo-test-prefect-")
atexit.register(shutil.rmtree, _home, True)
os.environ.setdefault("PREFECT_HOME", _home)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

# Load Prefect fully now, before any test runs: its first real use configures logging with
# dictConfig, which closes every existing handler, pytest's capture streams included.
import prefect.main  # noqa: E402,F401


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield
