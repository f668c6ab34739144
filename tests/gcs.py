"""A real GCS-protocol server for the tests: gcp-storage-emulator on 127.0.0.1, one per session.

    def test_x(gcs_emulator):
        url = gcs_emulator.url_for("runs")   # gs://grpo-test/runs-1a2b3c4d, fresh per call

What reaches it, and how (the variables live in os.environ, so worker processes the tests start
inherit them; `gcs_emulator.env` has the same dict for a child given an explicit environment):

- gcsfs (RunRoot, and Orbax's directory operations through etils.epath, which without tensorflow
  calls `fsspec.filesystem("gcs")`): STORAGE_EMULATOR_HOST is its endpoint, and
  FSSPEC_GCS_TOKEN=anon makes it anonymous. Without that gcsfs tries Application Default
  Credentials first, so on a machine that has them it refreshes a token at oauth2.googleapis.com
  on every new filesystem (minutes of retries offline). fsspec reads FSSPEC_* variables only
  when it is imported, which Prefect has already done by now, so this process also gets the
  token through fsspec's in-memory config.
- TensorStore (Orbax's array writer): TENSORSTORE_GCS_HTTP_URL is its endpoint and
  GOOGLE_AUTH_TOKEN_FOR_TESTING a fixed bearer token, so it never looks for credentials either.
- GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false, set when this module is imported (tests/conftest.py
  names it as a plugin): gcsfs reads it at import, and with it on every new filesystem spends
  60 s on a gRPC bucket-type probe the emulator cannot answer.

Three emulator gaps are closed here. Its multipart-upload parser (Python's email package) dropped a
trailing b"\r" from an object's bytes: gcsfs ends the part with "\n--boundary", and the parser took
"\r\n" as the line break before it, so about one small binary upload in 256 (an exported
safetensors file, say) came back a byte short; real GCS keeps every byte. And: an object read ignored
ifGenerationMatch/ifGenerationNotMatch and carried no x-goog-generation header. TensorStore's OCDBT (Orbax's
default format) sometimes revalidates its cached manifest with ifGenerationNotMatch=<the generation it just
wrote>; real GCS answers 304, the emulator answered 200 with no generation, and the next
manifest write failed with "Malformed StorageGeneration" (a few percent of saves). And: uploads and deletes
ignored ifGenerationMatch/ifGenerationNotMatch and wrote anyway; real GCS answers 412, which is what lets
grpo_core.store.lease create a run root's lease only where there is none (ifGenerationMatch=0) and renew,
take over or delete it only at the generation it read.
"""

import json
import logging
import os
import sys
import uuid
from http import HTTPStatus

import pytest

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
if "gcsfs" in sys.modules and sys.modules["gcsfs"].GCSFileSystem.__name__ == "ExtendedGcsFileSystem":
    raise RuntimeError(
        "gcsfs was imported with GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT on, before tests.gcs: every "
        "call to the emulator would wait 60 s. Import tests.gcs first (tests/conftest.py)."
    )

BUCKET = "grpo-test"


class GcsEmulator:
    def __init__(self, endpoint: str, env: dict[str, str]):
        self.bucket = BUCKET
        self.endpoint = endpoint  # http://127.0.0.1:PORT
        self.env = dict(env)  # the variables set for the session, for a child with its own env

    def url_for(self, prefix: str) -> str:
        """A fresh gs:// folder in the test bucket: gs://grpo-test/{prefix}-{8 hex}."""
        return f"gs://{self.bucket}/{prefix.strip('/')}-{uuid.uuid4().hex[:8]}"


def _with_generation(download):
    """The emulator's object download, plus what real GCS does: ifGenerationNotMatch equal to the
    object's generation -> 304, ifGenerationMatch different -> 412, x-goog-generation on a read."""
    from gcp_storage_emulator.exceptions import NotFound

    def handler(request, response, storage, *args, **kwargs):
        try:
            obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
        except NotFound:
            return download(request, response, storage, *args, **kwargs)  # its 404
        gen = str(obj["generation"])
        if gen in request.query.get("ifGenerationNotMatch", []):
            response.status = HTTPStatus.NOT_MODIFIED
            return
        if request.query.get("ifGenerationMatch", [gen])[0] != gen:
            response.status = HTTPStatus.PRECONDITION_FAILED
            return
        download(request, response, storage, *args, **kwargs)
        response["x-goog-generation"] = gen
        response["x-goog-metageneration"] = str(obj.get("metageneration", "1"))

    return handler


def _patch_downloads():
    """Install _with_generation wherever the emulator routes object downloads; returns the undo."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    original = objects.download
    patched = _with_generation(original)
    routes = [methods for _, methods in server.HANDLERS if original in methods.values()]
    objects.download = patched  # objects.get (GET ...?alt=media) calls it by this name
    for methods in routes:
        for verb, fn in methods.items():
            if fn is original:
                methods[verb] = patched

    def undo():
        objects.download = original
        for methods in routes:
            for verb, fn in methods.items():
                if fn is patched:
                    methods[verb] = original

    return undo


def _live_generation(storage, bucket: str, name: str) -> str:
    """The generation of the live object, "0" for none (as ifGenerationMatch=0 means)."""
    from gcp_storage_emulator.exceptions import NotFound

    try:
        return str(storage.get_file_obj(bucket, name)["generation"])
    except NotFound:
        return "0"


def _with_preconditions(handler, upload: bool):
    """An object write (a single-request upload, a delete) that honours ifGenerationMatch and
    ifGenerationNotMatch as real GCS does: 412 unless the live object's generation (0: none) matches;
    a delete of a missing object stays a 404. The emulator ignored them and wrote anyway. It serves
    one request at a time, so the check and the write are one step, as on GCS."""

    def patched(request, response, storage, *args, **kwargs):
        match, not_match = request.query.get("ifGenerationMatch"), request.query.get("ifGenerationNotMatch")
        kind = request.query.get("uploadType", [""])[0]
        if not (match or not_match) or (upload and kind not in ("media", "multipart")):  # resumable: not here
            return handler(request, response, storage, *args, **kwargs)
        bucket = request.params["bucket_name"]
        name = (request.query.get("name") or [None])[0] if upload else request.params["object_id"]
        if upload and name is None:  # multipart: the name may be in the metadata part only
            name = request.data["meta"].get("name")
        gen = _live_generation(storage, bucket, name)
        if (match and match[0] != gen) or (not_match and not_match[0] == gen):
            if not upload and gen == "0":
                return handler(request, response, storage, *args, **kwargs)  # its 404
            response.status = HTTPStatus.PRECONDITION_FAILED
            response.json({"error": {"code": 412, "message": "At least one of the pre-conditions did not hold."}})
            return
        return handler(request, response, storage, *args, **kwargs)

    return patched


def _patch_preconditions():
    """Install _with_preconditions on the emulator's object insert and delete; returns the undo."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    originals = {objects.insert: _with_preconditions(objects.insert, True)}
    originals[objects.delete] = _with_preconditions(objects.delete, False)
    swapped = []
    for _, methods in server.HANDLERS:
        for verb, fn in methods.items():
            if fn in originals:
                methods[verb] = originals[fn]
                swapped.append((methods, verb, fn))

    def undo():
        for methods, verb, fn in swapped:
            methods[verb] = fn

    return undo


def _exact_multipart(read_data):
    """The emulator's request-body reader, with multipart/related uploads split on the boundary
    exactly: the part's bytes end where the line break before the next delimiter starts, and
    that line break is the one the part's headers use ("\n" for gcsfs, "\r\n" for others)."""
    from email.message import Message

    from gcp_storage_emulator import server

    def handler(request_handler, query):
        ctype = request_handler.headers.get("Content-Type") or ""
        if not ctype.startswith("multipart/related"):
            return read_data(request_handler, query)
        raw = server._decode_raw_data(server._read_raw_data(request_handler), request_handler)
        header = Message()
        header["Content-Type"] = ctype
        parts = []
        for part in raw.split(b"--" + header.get_param("boundary").encode())[1:-1]:
            crlf = part.startswith(b"\r\n")
            head, _, body = part.partition(b"\r\n\r\n" if crlf else b"\n\n")
            types = [
                line.split(b":", 1)[1].strip().decode()
                for line in head.splitlines()
                if line.lower().startswith(b"content-type:")
            ]
            parts.append(
                (types[0].split(";")[0].strip().lower() if types else "text/plain", body[: -2 if crlf else -1])
            )
        (_, meta), (content_type, content) = parts
        return {"meta": json.loads(meta), "content": content, "content-type": content_type}

    return handler


def _patch_uploads():
    from gcp_storage_emulator import server

    original = server._read_data
    server._read_data = _exact_multipart(original)

    def undo():
        server._read_data = original

    return undo


def _forget_gcs_clients():
    """Drop cached gcsfs instances (they keep the credentials they were made with), including the
    one etils.epath caches for Orbax."""
    if "gcsfs" in sys.modules:
        sys.modules["gcsfs"].GCSFileSystem.clear_instance_cache()
    if "etils.epath.backend" in sys.modules:
        sys.modules["etils.epath.backend"]._FileSystemSpecBackend._get_filesystem.cache_clear()


@pytest.fixture(scope="session")
def gcs_emulator():
    import fsspec.config
    from gcp_storage_emulator.server import create_server

    # Port 0: the OS picks a free port at bind time, so no other process can take it in between
    # (the emulator binds in its thread, and start() would wait forever on a failed bind).
    server = create_server("127.0.0.1", 0, in_memory=True, default_bucket=BUCKET)
    undo_patch, undo_uploads, undo_preconditions = _patch_downloads(), _patch_uploads(), _patch_preconditions()
    server.start()
    httpd = server._api._httpd  # the pinned emulator has no public accessor for the bound port
    endpoint = f"http://127.0.0.1:{httpd.server_address[1]}"

    # gcsfs's info() races an object GET against a one-item listing and drops the loser, so the
    # emulator often writes to a closed socket; don't print a traceback for that.
    default_handle_error = httpd.handle_error

    def handle_error(request, client_address):
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            default_handle_error(request, client_address)

    httpd.handle_error = handle_error
    emulator_log = logging.getLogger("gcp_storage_emulator")  # logs every 404 at ERROR
    log_level = emulator_log.level
    emulator_log.setLevel(logging.CRITICAL)

    env = {
        "STORAGE_EMULATOR_HOST": endpoint,
        "FSSPEC_GCS_TOKEN": "anon",
        "TENSORSTORE_GCS_HTTP_URL": endpoint,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",
    }
    saved_env = {k: os.environ.get(k) for k in env}
    gcs_conf = fsspec.config.conf.setdefault("gcs", {})
    saved_token = gcs_conf.get("token", None), "token" in gcs_conf
    os.environ.update(env)
    gcs_conf["token"] = "anon"
    _forget_gcs_clients()
    try:
        yield GcsEmulator(endpoint, env)
    finally:
        server.stop()
        undo_patch()
        undo_uploads()
        undo_preconditions()
        emulator_log.setLevel(log_level)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if saved_token[1]:
            gcs_conf["token"] = saved_token[0]
        else:
            gcs_conf.pop("token", None)
        _forget_gcs_clients()
