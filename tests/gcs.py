"""A real GCS-protocol server for the tests: gcp-storage-emulator on 127.0.0.1, one per session.

gcsfs reaches it through STORAGE_EMULATOR_HOST (anonymous access), TensorStore (Orbax's array
writer) through TENSORSTORE_GCS_HTTP_URL and a fixed test token. The variables are in
os.environ, so worker processes the tests start inherit them. GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT
must be off before gcsfs is imported, or each call waits 60 s on a probe the emulator ignores.
"""

import os
import socket
import uuid

import pytest

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

BUCKET = "grpo-test"


class Emulator:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint

    def url_for(self, prefix: str) -> str:
        return f"gs://{BUCKET}/{prefix}-{uuid.uuid4().hex[:8]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def gcs_emulator():
    from gcp_storage_emulator.server import create_server

    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {"STORAGE_EMULATOR_HOST": endpoint, "TENSORSTORE_GCS_HTTP_URL": endpoint,
           "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token", "GOOGLE_CLOUD_PROJECT": "test"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    import gcsfs

    gcsfs.GCSFileSystem.clear_instance_cache()
    try:
        yield Emulator(endpoint)
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        gcsfs.GCSFileSystem.clear_instance_cache()
