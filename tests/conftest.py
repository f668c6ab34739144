import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

pytest_plugins = ["tests.prefect_server", "tests.gcs"]
