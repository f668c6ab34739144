"""What a caller of the Prefect API may try (issue 52), through a real `grpo serve` on the suite's
real `prefect server start`: every class of dangerous value (code, program, place read or written,
address, work without bound) submitted to the pipeline and readiness deployments, the fields of
the everyday deployment's short form, the evaluate deployment's run folder, a PATCH of a
deployment's parameters, job variables that set the policy's own environment. Each is refused
before any task runs, naming the field and the setting that would allow it, and the folder
outside the operator's places is left as it was. The cases are bench.attack_matrix's."""

import pytest

import bench.attack_matrix as attacks
from bench.attack_matrix import CASES, SECRET, Place, run_cases, serve, wait_registered
from tests.prefect_server import BIN, _stop, api_client, client_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def outcomes(server, tmp_path_factory):  # noqa: F811
    url, home = server
    base = tmp_path_factory.mktemp("attacks")
    place = Place(base)
    place.make()
    attacks.REDIRECT = attacks.Redirect()
    proc = serve(client_env(home, url), place, base, BIN)
    try:
        with api_client(url) as client:
            wait_registered(client, proc)
            yield place, run_cases(client, CASES, place)
    finally:
        _stop(proc)
        attacks.REDIRECT.close()


def test_every_deployment_is_covered_by_every_class():
    """The matrix holds each class of dangerous value for the pipeline and the readiness
    deployment (code, program, place read, place written, address, work), and the evaluate
    deployment's run folder."""
    classes = ("reward", "worker_python", "data outside", "storage.root", "url", "1e")
    for deployment in ("grpo-pipeline/pipeline", "grpo-readiness/readiness"):
        names = " | ".join(c.name for c in CASES if c.deployment == deployment and c.refused)
        assert [what for what in classes if what not in names] == [], deployment
    train = " | ".join(c.name for c in CASES if c.deployment == "grpo-pipeline/train")
    assert [what for what in ("reward", "data outside", "storage.root", "1e") if what not in train] == []
    check = " | ".join(c.name for c in CASES if c.deployment == "grpo-readiness/check")
    assert [what for what in ("reward", "data outside") if what not in check] == []
    assert [c.name for c in CASES if c.deployment == "grpo-evaluate/evaluate"] == [
        "PATCH entrypoint and path",
        "evaluate outside",
        "evaluate a served run",
    ]


def test_each_attack_is_refused_before_any_task_naming_the_field(outcomes):
    place, found = outcomes
    bad = [(o.case.name, o.state, o.tasks, o.message[:300]) for o in found if not o.ok]
    assert bad == []
    for o in found:
        assert SECRET not in o.message  # the refused data file's content is not in the state message
        if o.case.refused:
            assert o.tasks == 0 and o.state == "FAILED", o.case.name
    assert (place.outside / "step-0" / "keep.txt").read_text() == "keep me"
    assert sorted(p.name for p in place.outside.iterdir()) == [
        "code",
        "config.json",
        "secret.jsonl",
        "step-0",
        "tool.py",
    ]
    # a PATCHed pull step never ran, a PATCHed entrypoint and path never loaded (nor copied) the caller's file
    assert not (place.base / "pwned-pull").exists() and not (place.base / "pwned-flow").exists()
    assert not (place.base / "evil.py").exists()
    assert attacks.REDIRECT.hits == []  # the server an allowed address redirected to never heard of the run
    assert not (place.base / "pwned").exists()  # server_command's `touch pwned` never ran
    assert not (place.base / "pwned-by-tool").exists()  # the tool outside the allowed folders never ran
    log = (place.base / "serve.log").read_text()
    # each refusal is one line in the run's log, never the traceback of Prefect re-raising its state
    policy = sum(o.case.refused and o.case.record is None for o in found)  # the record's refusals say so apart
    assert log.count("refused before any task ran: ConfigError: ") >= policy
    assert "Engine execution exited with unexpected exception" not in log
