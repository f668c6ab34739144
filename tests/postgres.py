"""A throwaway PostgreSQL cluster for tests, the database a production Prefect server runs on.

Debian's server binaries (`apt-get install postgresql`, under /usr/lib/postgresql/N/bin), a data
directory in a temporary folder, listening on 127.0.0.1 only (and a Unix socket in that folder),
password auth over TCP, one superuser and one database, `prefect`. PostgreSQL refuses to run as
root: under root the cluster runs as the `postgres` system user the package creates. `cluster()`
stops it with `pg_ctl stop -m fast` and removes its folder; the `postgres` fixture is that, for
one test module (import it into the module that uses it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import glob
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import pytest

INSTALL_HINT = "needs PostgreSQL's server binaries (apt-get install postgresql)"


@dataclasses.dataclass(frozen=True)
class Postgres:
    bindir: str
    base: str  # the temporary folder: data/, sock/, server.log
    port: int
    user: str
    password: str
    host: str = "127.0.0.1"
    database: str = "prefect"

    @property
    def url(self) -> str:
        """The SQLAlchemy URL Prefect's server takes (PREFECT_API_DATABASE_CONNECTION_URL)."""
        return f"postgresql+asyncpg://{self.user}:{self.password}@{self.host}:{self.port}/{self.database}"

    @property
    def dsn(self) -> str:
        """The libpq URL (psql, asyncpg)."""
        return f"postgresql://{self.user}:{self.password}@{self.host}:{self.port}/{self.database}"

    @property
    def datadir(self) -> str:
        return os.path.join(self.base, "data")

    def query(self, sql: str, *args: Any) -> list[tuple]:
        """Rows of one statement, over TCP with the password, as any client of the server sees them."""

        async def go():
            import asyncpg

            conn = await asyncpg.connect(self.dsn, timeout=30)
            try:
                return [tuple(r) for r in await conn.fetch(sql, *args)]
            finally:
                await conn.close()

        with ThreadPoolExecutor(1) as pool:  # a loop of its own, whatever the caller's thread runs
            return pool.submit(asyncio.run, go()).result()

    def log(self, tail: int = 3000) -> str:
        try:
            with open(os.path.join(self.base, "server.log"), errors="replace") as f:
                return f.read()[-tail:]
        except OSError:
            return ""


def find_bindir() -> str | None:
    """The newest of Debian's /usr/lib/postgresql/N/bin, else the folder of an `initdb` on PATH."""

    def version(path: str) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", path.split("/")[-3]))

    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=version)
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Runner:
    """Runs the server's programs as the cluster's owner: `postgres` under root, else ourselves."""

    def __init__(self, base: str):
        self.base = base
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": base, "LC_ALL": "C"}
        self.ids: dict[str, Any] = {}
        if os.geteuid() == 0:
            try:
                owner = pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip(f"{INSTALL_HINT}: no `postgres` user to run the server as (it refuses root)")
            self.ids = {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []}

    def own(self, path: str) -> None:
        if self.ids:
            os.chown(path, self.ids["user"], self.ids["group"])

    def __call__(self, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(
            cmd,
            cwd=self.base,
            env=self.env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,  # the postmaster pg_ctl leaves behind is out of the caller's group
            **self.ids,
        )


def start() -> Postgres:
    """initdb, start on a free 127.0.0.1 port, create the `prefect` database. Skips without the binaries."""
    bindir = find_bindir()
    if bindir is None:
        pytest.skip(INSTALL_HINT)
    base = tempfile.mkdtemp(prefix="grpo-test-pg-")
    pg = None  # set once pg_ctl has started the server
    try:
        run = _Runner(base)
        run.own(base)
        for sub in ("data", "sock"):
            os.mkdir(os.path.join(base, sub), 0o700)
            run.own(os.path.join(base, sub))
        user, password = "grpo", secrets.token_hex(16)
        pwfile = os.path.join(base, "pwfile")
        with open(os.open(pwfile, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(password + "\n")
        run.own(pwfile)
        r = run(
            f"{bindir}/initdb",
            *("-D", os.path.join(base, "data"), "-U", user, "--pwfile", pwfile),
            *("--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-locale", "--no-sync"),
        )
        os.remove(pwfile)
        assert r.returncode == 0, f"initdb failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
        for attempt in range(3):  # the port is free when chosen; another process may take it first
            # a throwaway cluster: no fsync (a crash loses nothing a test needs)
            cand = Postgres(bindir=bindir, base=base, port=_free_port(), user=user, password=password)
            options = f"-c listen_addresses=127.0.0.1 -p {cand.port} -k {base}/sock -c fsync=off"
            r = run(f"{bindir}/pg_ctl", "start", "-D", cand.datadir, "-l", f"{base}/server.log", "-w", "-o", options)
            if r.returncode == 0 or os.path.exists(os.path.join(cand.datadir, "postmaster.pid")):
                pg = cand  # started, or still starting: stopped below should it not answer
            if r.returncode == 0:
                break
            assert pg is None and attempt < 2 and "already in use" in cand.log(), (
                f"pg_ctl start failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}\n{cand.log()}"
            )
        r = subprocess.run(
            [f"{bindir}/createdb", "-h", pg.host, "-p", str(pg.port), "-U", user, pg.database],
            env={**os.environ, "PGPASSWORD": password},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, f"createdb failed:\n{r.stderr[-2000:]}"
        return pg
    except BaseException:
        if pg is not None:
            stop(pg)  # removes the folder too
        else:
            shutil.rmtree(base, ignore_errors=True)
        raise


def stop(pg: Postgres) -> None:
    """`pg_ctl stop -m fast` (clients are disconnected, the server shuts down cleanly), then the
    folder is removed. Should that fail, the postmaster recorded in postmaster.pid is killed."""
    run = _Runner(pg.base)
    try:
        r = run(f"{pg.bindir}/pg_ctl", "stop", "-D", pg.datadir, "-m", "fast", "-w", "-t", "60", timeout=90)
        failed = r.returncode != 0 and os.path.exists(os.path.join(pg.datadir, "postmaster.pid"))
    except subprocess.TimeoutExpired:
        failed = True
    if failed:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(os.path.join(pg.datadir, "postmaster.pid")) as f:
                os.kill(int(f.readline()), signal.SIGKILL)
    shutil.rmtree(pg.base, ignore_errors=True)


@contextlib.contextmanager
def cluster() -> Iterator[Postgres]:
    pg = start()
    try:
        yield pg
    finally:
        stop(pg)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    with cluster() as pg:
        yield pg
