"""What a caller of the Prefect API may try, through the served deployments, one row each:

    python -m bench.attack_matrix [--only NAME[,NAME]]

A Prefect server (the embedded one) and a real `grpo serve` (its operator config: a run root and a
data file of its own), started and stopped here; each case submits parameters to a deployment
through the API (run_deployment, a PATCH of the deployment, job variables) and prints whether the
flow run was refused before any task ran, how long the refusal took after submission, and the
message. A case passes when it is refused naming the field and the setting that would allow it
(or, for the allowed cases, not refused by the trust policy); the script exits 1 when one is not.
tests/test_attacks.py runs the same cases against the suite's server.
"""

from __future__ import annotations

import argparse
import contextlib
import contextvars
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable

SECRET = "SECRET-PROMPT-alpha"


@dataclasses.dataclass(frozen=True)
class Place:
    """The folders of one matrix: the operator's (served) and an attacker's target outside them."""

    base: Path

    @property
    def root(self) -> Path:  # the served config's storage.root
        return self.base / "served-runs"

    @property
    def data(self) -> Path:  # the served config's data file
        return self.base / "served-data" / "train.jsonl"

    @property
    def outside(self) -> Path:  # a folder of the machine no deployment run may touch
        return self.base / "outside"

    @property
    def secret(self) -> Path:
        return self.outside / "secret.jsonl"

    @property
    def reward(self) -> Path:  # a reward file in the serving process's own rewards/ folder (allowed)
        return self.base / "rewards" / "mine.py"

    @property
    def tool(self) -> Path:  # a tool file outside every allowed folder
        return self.outside / "tool.py"

    def make(self) -> None:
        for folder in (self.root, self.data.parent, self.outside / "step-0", self.reward.parent):
            folder.mkdir(parents=True, exist_ok=True)
        self.data.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": "a"}) + "\n" for i in range(64)))
        self.secret.write_text(json.dumps({"prompt": SECRET}) + "\n")
        (self.outside / "step-0" / "keep.txt").write_text("keep me")
        self.tool.write_text(TOOL)
        (self.outside / "code").mkdir()  # a flow file a PATCHed entrypoint and path would load
        marker = str(self.base / "pwned-flow")
        (self.outside / "code" / "evil.py").write_text(
            f"from prefect import flow\n\n@flow\ndef evil(**kw):\n    open({marker!r}, 'w').close()\n"
        )
        # folders under the served root with a file that is a link out of it (issue 61 item 3)
        (self.root / "dsdir").mkdir()
        (self.root / "dsdir" / "part-1.jsonl").write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
        (self.root / "dsdir" / "part-0.jsonl").symlink_to(self.secret)
        (self.outside / "config.json").write_text(json.dumps({"model_type": "qwen3", "note": SECRET}))
        (self.root / "model").mkdir()
        (self.root / "model" / "config.json").symlink_to(self.outside / "config.json")
        self.reward.write_text(REWARD.format(score=0.0))
        self.edited_run()
        self.reward.write_text(REWARD.format(score=1.0))  # edited since that run started

    def edited_run(self) -> None:
        """The run 'edited' as a deployment run of EDITED's parameters left it after a step, before
        its reward file was edited: its config.json holds the file's old digest."""
        from flows.pipeline import _config
        from grpo_core.resolve import resolve_run
        from grpo_core.store.runs import init_run_root

        root = init_run_root(resolve_run(_config(EDITED(self)["config"])))
        root.write_metrics([{"step": 0.0, "reward": 0.0}])  # it trained: another config may not take its name


def operator_config(p: Place) -> dict[str, Any]:
    """What the operator serves (grpo serve --set ...): a tiny run on their own data file."""
    return {
        "storage": {"root": str(p.root)},
        "data": {"source": str(p.data), "eval_rows": 8},
        "rewards": [{"function": "exact_match"}],
        "train": {"num_steps": 2, "grpo": {"prompts_per_step": 4}},
        "pipeline": {"epochs": 1, "flow_retries": 0, "retry_delay_s": 0},
    }


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    deployment: str  # grpo-pipeline/pipeline or /train, grpo-readiness/readiness or /check, grpo-evaluate/evaluate
    parameters: Callable[[Place], dict[str, Any]]
    expect: str  # in the refusal's message (the field, and the setting that would allow it)
    refused: bool = True  # False: the trust policy lets it through (it may fail later, for another reason)
    job_variables: dict[str, Any] | None = None
    patch: Callable[[Place], dict[str, Any]] | None = None  # the deployment's parameters, PATCHed first
    # other fields of the deployment's record PATCHed first (pull_steps, entrypoint, path), put back
    # once the run ended (the serve reads the record when it picks the run up)
    record: Callable[[Place], dict[str, Any]] | None = None


def _cfg(**sections: Any) -> Callable[[Place], dict[str, Any]]:
    """A config over the served one, each value a function of the Place (or a constant)."""

    def build(p: Place) -> dict[str, Any]:
        out = json.loads(json.dumps(operator_config(p)))
        for dotted, value in sections.items():
            node = out
            keys = dotted.split("__")
            for k in keys[:-1]:
                node = node.setdefault(k, {})
            node[keys[-1]] = value(p) if callable(value) else value
        return {"config": out}

    return build


TOOL = '''def lookup(key: str) -> str:
    """Read a key.

    Args:
        key: The key.
    """
    open("pwned-by-tool", "w").close()
    return key
'''
REWARD = "def score(prompts, completions, **kw):\n    return [{score}] * len(completions)\n"

PIPE, READY, EVAL = "grpo-pipeline/pipeline", "grpo-readiness/readiness", "grpo-evaluate/evaluate"
TRAIN = "grpo-pipeline/train"  # the everyday deployment: the short form (flows/everyday.py)
CHECK = "grpo-readiness/check"  # readiness alone, the same short form
HTTP = {"engine": "http", "url": "http://203.0.113.9:30000", "reload_route": "/r"}
OWN = {"engine": "http", "server": "sglang-jax"}  # a server the run starts itself, on 127.0.0.1
CMD = ["sh", "-c", "touch pwned; echo {model}"]
RAY = {"kind": "ray", "address": "ray://203.0.113.9:10001"}
MANY = {"kind": "multiprocess", "num_processes": 10**5}
OPEN = {"env": {"GRPO_ALLOW_ROOTS": "/"}}

CASES = [
    # code: a library callable with a reward's signature
    Case("reward pty:spawn", PIPE, _cfg(rewards=[{"function": "pty:spawn"}]), "--allow-reward-module"),
    Case("reward os:system (readiness)", READY, _cfg(rewards=[{"function": "os:system"}]), "rewards[0].function"),
    # programs
    Case("worker_python (readiness)", READY, _cfg(pipeline__worker_python="/bin/sh"), "--allow-field"),
    Case("worker_python", PIPE, _cfg(pipeline__worker_python="/bin/sh"), "pipeline.worker_python"),
    Case(
        "server_command",
        PIPE,
        _cfg(train__rollout={"engine": "http", "server_command": CMD}),
        "names a program",
    ),
    # places read and written
    Case("data outside (readiness)", READY, _cfg(data__source=lambda p: str(p.secret)), "data.source"),
    Case("data outside", PIPE, _cfg(data__source=lambda p: str(p.secret)), "--allow-root"),
    Case("storage.root outside", PIPE, _cfg(storage__root=lambda p: str(p.outside)), "storage.root"),
    Case("storage.root outside (readiness)", READY, _cfg(storage__root=lambda p: str(p.outside)), "storage.root"),
    Case(
        "export_dir outside", PIPE, _cfg(train__rollout=lambda p: {**OWN, "export_dir": str(p.outside)}), "export_dir"
    ),
    # addresses
    Case("rollout url", PIPE, _cfg(train__rollout=HTTP), "--allow-host"),
    Case("rollout url (readiness)", READY, _cfg(train__rollout=HTTP), "train.rollout.url"),
    Case(
        "ray address", PIPE, _cfg(pipeline__launcher={"kind": "ray", "address": "ray://203.0.113.9:10001"}), "address"
    ),
    # work without bound
    Case("synthetic_rows 1e9", PIPE, _cfg(data={"synthetic_rows": 10**9}), "--raise-limit data.synthetic_rows"),
    Case("num_steps 1e12 (readiness)", READY, _cfg(train__num_steps=10**12), "train.num_steps"),
    Case("eval batch 1e6", PIPE, _cfg(eval={"batch_size": 10**6, "num_samples": 10**6}), "eval."),
    Case(
        "processes 1e5",
        PIPE,
        _cfg(pipeline__launcher={"kind": "multiprocess", "num_processes": 10**5}),
        "num_processes",
    ),
    # the anchor: what the API can edit does not widen it
    Case(
        "PATCH storage.root, data",
        PIPE,
        lambda p: {},
        "may not be set in a deployment run",
        patch=_cfg(storage__root=lambda p: str(p.outside), data__source=lambda p: str(p.secret)),
    ),
    Case(
        "job variables env", PIPE, lambda p: {}, "job_variables.env", job_variables={"env": {"GRPO_ALLOW_ROOTS": "/"}}
    ),
    Case("reserved run_name", PIPE, _cfg(run_name="_flow-runs"), "run_name"),
    # the everyday deployment (its short form's fields)
    Case("data outside (train)", TRAIN, lambda p: {"data_source": str(p.secret)}, "data.source"),
    Case("storage.root outside (train)", TRAIN, lambda p: {"storage_root": str(p.outside)}, "storage.root"),
    Case("reward os:system (train)", TRAIN, lambda p: {"rewards": [{"function": "os:system"}]}, "rewards[0]"),
    Case("num_steps 1e12 (train)", TRAIN, lambda p: {"num_steps": 10**12}, "train.num_steps"),
    Case("data outside (check)", CHECK, lambda p: {"data_source": str(p.secret)}, "data.source"),
    Case("reward os:system (check)", CHECK, lambda p: {"rewards": [{"function": "os:system"}]}, "rewards[0]"),
    # format strings are data: refused when the config is read, before anything is formatted
    Case("template format spec", PIPE, _cfg(data__template="{prompt:>1500000000}"), "data.template"),
    Case("template nested spec", READY, _cfg(data__template="{prompt:{prompt.__class__.__mro__}}"), "format spec"),
    Case("run_name format spec", PIPE, _cfg(run_name="{date:>1000000000}"), "run_name"),
    # work as a whole: each factor within its limit, the product over the total
    Case(
        "work total 3.4e10 tokens",
        PIPE,
        _cfg(
            train__grpo={"prompts_per_step": 4096, "num_generations": 256},
            train__sampling={"max_new_tokens": 32768},
        ),
        "--raise-limit train.tokens_per_step",
    ),
    # trackers: one that sends the run's metrics (with the operator's key) is an address
    Case("tracker wandb", PIPE, _cfg(pipeline__report_to=["wandb"]), "pipeline.report_to"),
    Case(
        "job variables tracker",
        PIPE,
        lambda p: {},
        "MLFLOW_TRACKING_URI",
        job_variables={"env": {"MLFLOW_TRACKING_URI": "http://203.0.113.9:5000"}},
    ),
    # a run is what its files say: the reward file was edited since run 'edited' started
    Case("edited reward file", PIPE, lambda p: EDITED(p), "edited code: "),
    # reads stay inside: a file of a folder under an allowed root that links out of it
    Case("data folder link out", PIPE, _cfg(data__source=lambda p: str(p.root / "dsdir")), "is a link to"),
    Case("data folder link out (readiness)", READY, _cfg(data__source=lambda p: str(p.root / "dsdir")), "data.source"),
    Case("model folder link out", PIPE, _cfg(model__path=lambda p: str(p.root / "model")), "model.path"),
    # addresses stay allowed: an allowed host that redirects elsewhere is not followed (the stage fails
    # naming it, after the tasks before readiness ran: refused=False), and the target never hears of it
    Case(
        "rollout url redirects (readiness)",
        READY,
        _cfg(train__rollout=lambda p: {"engine": "http", "url": REDIRECT.url, "reload_route": "/reload"}),
        "not followed",
        refused=False,
    ),
    # a reward model's folder is a place read (issue 64), its batches work within limits
    Case("reward model outside", PIPE, _cfg(rewards=lambda p: [{"model": str(p.outside)}]), "rewards[0].model"),
    Case(
        "reward model batch 1e5 (readiness)",
        READY,
        _cfg(rewards=lambda p: [{"model": str(p.root / "model"), "batch_size": 100_000}]),
        "--raise-limit rewards[].batch_size",
    ),
    # asynchrony is bounded work too (issue 63)
    Case("max_staleness 9", PIPE, _cfg(train__max_staleness=9), "--raise-limit train.max_staleness"),
    # tools are code, as rewards are (issue 62)
    Case("tool outside", PIPE, _cfg(train__agent=lambda p: {"tools": [f"{p.tool}:lookup"]}), "train.agent.tools[0]"),
    Case(
        "tool pickled (readiness)",
        READY,
        _cfg(train__agent=lambda p: {"tools": [f"{p.root}/_inputs/rewards/x/lookup.pkl:lookup"]}),
        "pickled",
    ),
    Case("environment module", PIPE, _cfg(train__agent={"environment": "subprocess:Popen"}), "--allow-reward-module"),
    # the deployment's record is the serving process's: a PATCH of what Prefect acts on runs nothing
    Case(
        "PATCH pull_steps (readiness)",
        READY,
        lambda p: {},
        "registered it: pull_steps",
        record=lambda p: {
            "pull_steps": [{"prefect.deployments.steps.run_shell_script": {"script": f"touch {p.base / 'pwned-pull'}"}}]
        },
    ),
    Case(
        "PATCH entrypoint and path",
        EVAL,
        lambda p: {"run_url": str(p.root / "r")},
        "registered it: entrypoint, path",
        record=lambda p: {"entrypoint": "evil.py:evil", "path": str(p.outside / "code")},
    ),
    # the evaluate deployment
    Case("evaluate outside", EVAL, lambda p: {"run_url": str(p.outside)}, "run_url"),
    # the served pipeline's own runs may be evaluated (not a trust refusal: there is no run yet)
    Case("evaluate a served run", EVAL, lambda p: {"run_url": str(p.root / "r")}, "config.json", refused=False),
]


class Redirect:
    """An allowed address (127.0.0.1:port, given to grpo serve's --allow-host) that answers every
    request with a redirect to another server on 127.0.0.1, which counts what reaches it."""

    def __init__(self) -> None:
        import http.server

        hits = self.hits = []

        class Target(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the standard library's name
                hits.append(self.path)
                self.send_response(200)
                self.end_headers()

            do_POST = do_GET  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.target = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Target)
        to = f"http://127.0.0.1:{self.target.server_address[1]}"

        class Redirector(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.send_response(302)
                self.send_header("Location", f"{to}{self.path}")
                self.end_headers()

            do_POST = do_GET  # noqa: N815

            def log_message(self, *args: Any) -> None:
                pass

        self.redirector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirector)
        self.host = f"127.0.0.1:{self.redirector.server_address[1]}"
        self.url = f"http://{self.host}"
        for srv in (self.target, self.redirector):
            threading.Thread(target=srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        for srv in (self.target, self.redirector):
            srv.shutdown()
            srv.server_close()


REDIRECT: Any = None  # the matrix's Redirect, started before the cases are built into parameters


def EDITED(p: Place) -> dict[str, Any]:  # noqa: N802 - a case's parameters, as the other lambdas
    """Run 'edited' with the serving process's own reward file."""
    return _cfg(run_name="edited", rewards=lambda p: [{"function": f"{p.reward}:score"}])(p)


def serve(env: dict[str, str], p: Place, cwd: Path, bin_dir: str) -> subprocess.Popen:
    """`grpo serve` with the operator's config, 4 flow runs at a time, output to cwd/serve.log."""
    sets: list[str] = []

    def flat(d: dict, prefix: str = "") -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                flat(v, f"{prefix}{k}.")
            else:
                sets.extend(["--set", f"{prefix}{k}={json.dumps(v)}"])

    flat(operator_config(p))
    log = open(cwd / "serve.log", "w")  # noqa: SIM115 - the process writes it until stopped
    allow = ["--allow-host", REDIRECT.host] if REDIRECT is not None else []
    return subprocess.Popen(
        [f"{bin_dir}/grpo", "serve", "--limit", "4", *allow, *sets],
        env=env,
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def wait_registered(client, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    """Until every deployment carries this serve's mark (its pid in the version): a server that
    kept an earlier serve's deployments (a Prefect home reused) has them before this one registers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            versions = [client.read_deployment_by_name(d).version or "" for d in (PIPE, READY, EVAL, TRAIN, CHECK)]
            if all(f" pid {proc.pid} " in v for v in versions):
                return
        except Exception:  # noqa: BLE001 - not registered yet
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("grpo serve did not register its deployments")
        time.sleep(0.5)


@dataclasses.dataclass
class Outcome:
    case: Case
    state: str
    seconds: float
    message: str
    tasks: int

    @property
    def ok(self) -> bool:
        said = (
            "ConfigError: " in self.message
            or "was changed on the server since grpo serve registered it" in self.message
        )
        refused = self.state == "FAILED" and self.tasks == 0 and said
        if not self.case.refused:  # let through by the policy: whatever fails next is not a refusal of it
            return "deployment run" not in self.message and self.case.expect in self.message
        return refused and self.case.expect in self.message and SECRET not in self.message


# The cases' own writes (a PATCH, the flow run's creation), one at a time: the embedded server's
# SQLite answers two writes that meet with 503, which Prefect's client retries after 2, 4, 8, 16
# and 32 s, so a case could wait a minute for a collision with another stream's submission, not for
# its refusal. The refusals (grpo serve's and the flows') still run beside each other.
_WRITES = threading.Lock()


def submit(client, case: Case, p: Place, timeout_s: float = 300) -> Outcome:
    """Submit one case and wait for its flow run to end."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    with _WRITES:  # one writer at a time (see _WRITES)
        dep = client.read_deployment_by_name(case.deployment)
        before = dep.parameters
        record = case.record(p) if case.record else {}
        kept = {k: getattr(dep, k) for k in record}
        if case.patch:  # what an unauthenticated PATCH /api/deployments/{id} did (HTTP 204)
            client.update_deployment(dep.id, _deployment_update(parameters=case.patch(p)))
        if record:
            client.update_deployment(dep.id, _deployment_update(**record))
        try:
            t = time.monotonic()
            run = run_deployment(
                case.deployment, parameters=case.parameters(p), job_variables=case.job_variables, timeout=0
            )
        finally:
            if case.patch:
                client.update_deployment(dep.id, _deployment_update(parameters=before))
    try:
        deadline = time.monotonic() + timeout_s
        while not (run := client.read_flow_run(run.id)).state.is_final():
            if time.monotonic() > deadline:
                return Outcome(case, run.state.type.value, time.monotonic() - t, "did not end", -1)
            time.sleep(0.25)
        seconds = time.monotonic() - t  # from submission to the final state, as the caller sees it
    finally:
        if record:  # the later cases' runs of this deployment find it as the serve registered it
            with _WRITES:
                client.update_deployment(dep.id, _deployment_update(**kept))
    tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    return Outcome(case, run.state.type.value, seconds, run.state.message or "", len(tasks))


def _deployment_update(**fields: Any):
    from prefect.client.schemas.actions import DeploymentUpdate

    return DeploymentUpdate(**fields)


def run_cases(client, cases: list[Case], p: Place) -> list[Outcome]:
    """Each deployment's cases in turn (a deployment runs one flow run at a time), the deployments
    beside each other: a case's seconds are from its submission to its refusal, nothing queued
    before it."""
    out: dict[int, Outcome] = {}

    def stream(indices: list[int]) -> None:
        for i in indices:
            try:
                out[i] = submit(client, cases[i], p)
            except Exception as exc:  # noqa: BLE001 - a case that breaks is a failed row
                out[i] = Outcome(cases[i], "ERROR", 0.0, f"{type(exc).__name__}: {exc}", -1)

    streams: dict[str, list[int]] = {}
    for i, c in enumerate(cases):
        streams.setdefault(c.deployment, []).append(i)
    # each in a copy of this thread's context: the Prefect settings (API URL, auth) set here
    beside = [threading.Thread(target=contextvars.copy_context().run, args=(stream, s)) for s in streams.values()]
    for t in beside:
        t.start()
    for t in beside:
        t.join()
    return [out[i] for i in range(len(cases))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.attack_matrix")
    ap.add_argument("--only", default="", help="comma-separated case names")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if not args.only or c.name in args.only.split(",")]
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.local_server import embedded_server

    base = Path(tempfile.mkdtemp(prefix="grpo-attacks-"))
    p = Place(base)
    p.make()
    global REDIRECT
    REDIRECT = Redirect()
    with contextlib.ExitStack() as stack:
        stack.callback(REDIRECT.close)
        url = stack.enter_context(embedded_server())
        env = {**os.environ, "PREFECT_API_URL": url or "", "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
        proc = serve(env, p, base, str(Path(sys.executable).parent))
        try:
            with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
                wait_registered(client, proc)
                outcomes = run_cases(client, cases, p)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(f"{'case':34} {'deployment':26} {'ok':3} {'state':9} {'s':>5} message (s: submission to refusal)")
    for o in outcomes:
        line = f"{o.case.name:34} {o.case.deployment:26} {'yes' if o.ok else 'NO':3} {o.state:9} {o.seconds:5.1f} "
        print(line + textwrap.shorten(o.message.replace("Flow run encountered an exception: ", ""), 140), flush=True)
    kept = (
        (p.outside / "step-0" / "keep.txt").exists()
        and not any(p.outside.glob("*/config.json"))
        and not (base / "pwned-by-tool").exists()
        and not (base / "pwned-pull").exists()
        and not (base / "pwned-flow").exists()
        and not (base / "evil.py").exists()
        and not REDIRECT.hits
    )
    failed = sum(not o.ok for o in outcomes) + (not kept)
    print(
        f"{len(outcomes) - sum(not o.ok for o in outcomes)}/{len(outcomes)} as expected; outside folder untouched: "
        f"{'yes' if kept else 'NO'}; serve's log in {base}/serve.log"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
