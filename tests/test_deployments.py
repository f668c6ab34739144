"""Deployments as a service: a real `prefect server start` on 127.0.0.1 with basic auth, `grpo
serve` serving the deployments, a run started through the API with parameters, invalid
parameters rejected before a run exists, a schedule that fires, and a failed run retried the
way the UI's Retry button does it (the same flow run scheduled again) resuming where it stopped."""

import collections
import contextlib
import json
import os
import socket
import subprocess
import threading
import time

import pytest

from flows.serve import SERVED_NAMES
from grpo_core.store.root import RunRoot
from tests.prefect_server import AUTH, BIN, _get, _stop, client_env, start_server  # noqa: F401 - for the modules below

pytestmark = pytest.mark.slow


def tiny(root, name, **pipeline) -> dict:
    """A 4-step run in one epoch; `epochs=2` where a test needs an epoch boundary. Each epoch is a
    training worker of its own (a JAX start, a restore, its programs loaded), and a second one tests
    nothing more of a run started through the API, a schedule or a work pool."""
    return {
        "run_name": name,
        "storage": {"root": str(root)},
        "data": {"eval_rows": 8, "synthetic_rows": 64},
        "train": {"num_steps": 4, "grpo": {"prompts_per_step": 4}},
        "eval": {"num_samples": 2, "batch_size": 8},
        "pipeline": {"epochs": 1, "checkpoint_every": 1, "retry_delay_s": 0, "flow_retries": 0, **pipeline},
    }


@pytest.fixture(scope="module")
def served(server, tmp_path_factory):
    """`grpo serve` with the pipeline scheduled every 30 s on a tiny config."""
    from tests.faults import HOOK

    url, home = server
    root = tmp_path_factory.mktemp("served-runs")
    flags = tmp_path_factory.mktemp("faults")
    env = {
        **client_env(home, url),
        # the "ui-retry" run's worker is killed after step 3 in both of the flow's attempts (its
        # config has 1 flow retry and no task retries): the flow run fails
        "GRPO_TEST_HOOK": HOOK,
        "GRPO_FAULT": f"step:3:{flags}/killed,step:3:{flags}/killed-again",
        "GRPO_FAULT_RUN": "/ui-retry",
    }
    sets = [f"{k}={json.dumps(v)}" for k, v in _flatten(tiny(root, "nightly")).items()]
    proc = subprocess.Popen(
        # the UI test's run writes in a temporary folder of its own: a root the operator allows
        [
            f"{BIN}/grpo",
            "serve",
            "--interval",
            "30",
            "--allow-root",
            str(tmp_path_factory.getbasetemp()),
            *sum((["--set", s] for s in sets), []),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    with served_client(url, proc) as client:
        yield client, root, flags
    _stop(proc)


@contextlib.contextmanager
def served_client(url: str, proc: subprocess.Popen):
    """A Prefect client of the server at `url`, once `grpo serve` (`proc`) has registered its
    deployments there. Its stderr (its flow runs' logs too) is read all along: a full pipe would
    block it mid-run, runs left Late."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    tail: collections.deque[str] = collections.deque(maxlen=200)
    if proc.stderr is not None:
        threading.Thread(target=tail.extend, args=(proc.stderr,), daemon=True).start()
    with temporary_settings({PREFECT_API_URL: url, PREFECT_API_AUTH_STRING: AUTH}):
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    for name in SERVED_NAMES:
                        client.read_deployment_by_name(name)
                    break
                except Exception:  # noqa: BLE001 - not registered yet
                    assert proc.poll() is None, "".join(tail)[-3000:]
                    assert time.monotonic() < deadline, "grpo serve did not register its deployments"
                    time.sleep(1)
            yield client


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("synthetic", "rename"):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _wait(client, run_id, timeout=300):
    deadline = time.monotonic() + timeout
    while True:
        run = client.read_flow_run(run_id)
        if run.state.is_final():
            return run
        assert time.monotonic() < deadline, f"flow run stuck in {run.state.name}"
        time.sleep(1)


def wait_logs(client, run_id, done, timeout=30):
    """The flow run's logs once `done(logs)` holds, or as they are after `timeout` s: a run's lines
    reach the API in batches, and the last ones can land after its final state."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout
    while True:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
        if done(logs) or time.monotonic() >= deadline:
            return logs
        time.sleep(1)


def test_server_listens_on_loopback_with_basic_auth(server):
    url, _ = server
    assert _get(f"{url}/version", None) == 401 and _get(f"{url}/version", "grpo:wrong") == 401
    assert _get(f"{url}/version", AUTH) == 200
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # this machine's outward address
        s.connect(("10.255.255.255", 1))
        outward = s.getsockname()[0]
    if not outward.startswith("127."):
        assert _get(f"http://{outward}:{port}/api/version", AUTH) == 0  # not listening there


def test_schedule_fires(served):
    # first of the served tests: until it pauses the 30-s schedule, the schedule's runs hold the
    # deployment's one concurrency slot and the other tests' runs wait behind them
    client, root, _ = served
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId

    dep = client.read_deployment_by_name("grpo-pipeline/pipeline")
    deadline = time.monotonic() + 240
    while True:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[dep.id]))
        )
        done = [r for r in runs if r.auto_scheduled and r.state.is_completed()]
        if done:
            break
        assert time.monotonic() < deadline, [(r.name, r.state.name) for r in runs]
        time.sleep(2)
    assert RunRoot(str(root / "nightly")).read_json("summary.json")["status"] == "completed"
    assert done[0].name == "nightly"  # the server's made-up name (coolname's pair of words) became the folder's
    client.pause_deployment(dep.id)  # the schedule has fired; keep the runner free for the tests after this


def test_run_with_parameters_and_invalid_parameters_rejected(served):
    client, root, _ = served
    from prefect.deployments import run_deployment

    typed = "lr sweep: baseline"  # a name given with the run (the UI's Run Name) is kept (issue 30, item 5)
    run = run_deployment(
        "grpo-pipeline/pipeline", parameters={"config": tiny(root, "api-run")}, flow_run_name=typed, timeout=0
    )
    run = _wait(client, run.id)
    assert run.state.is_completed(), run.state.message
    assert run.name == typed  # not renamed to the run folder's name
    summary = RunRoot(str(root / "api-run")).read_json("summary.json")
    assert summary["status"] == "completed" and summary["steps"] == 4
    with pytest.raises(Exception, match="greater than or equal to 2|num_generations"):
        run_deployment(
            "grpo-pipeline/pipeline", parameters={"config": {"train": {"grpo": {"num_generations": 1}}}}, timeout=0
        )
    dep = client.read_deployment_by_name("grpo-pipeline/pipeline")
    assert dep.enforce_parameter_schema and "RunParams" in json.dumps(dep.parameter_openapi_schema)
    for name in SERVED_NAMES:
        assert client.read_deployment_by_name(name).description  # what the UI's deployment list shows


def test_run_naming_a_library_callable_is_refused_before_anything_runs(served, tmp_path):
    """issue 28: `pty:spawn` has a reward's signature; through the API it ran `touch` on the host.
    A deployment's config may name only built-ins and what the operator allowed (grpo serve runs
    here with none): refused before any task, naming the field, and not retried."""
    client, root, _ = served
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    data = tmp_path / "touch.jsonl"
    data.write_text('{"prompt": "touch"}\n' * 64)
    marker = os.path.join(os.getcwd(), "touch")  # grpo serve's working directory: where `touch touch ...` writes
    assert not os.path.exists(marker)
    config = {**tiny(root, "spawn"), "data": {"source": str(data), "eval_rows": 8}}
    run = run_deployment(
        "grpo-pipeline/pipeline", parameters={"config": {**config, "rewards": [{"function": "pty:spawn"}]}}, timeout=0
    )
    run = _wait(client, run.id)
    assert run.state.is_failed()
    assert "rewards[0].function 'pty:spawn' may not run in a deployment run" in run.state.message
    assert "--allow-reward-module" in run.state.message
    assert not os.path.exists(marker) and not (root / "spawn").exists()
    tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    # no stage started, no worker; not even the flow run's process (grpo serve refused it), not retried
    assert tasks == [] and run.run_count == 0


def test_the_short_readiness_form_checks_what_the_everyday_form_runs(served):
    """grpo-readiness/check: the everyday form's fields (no `config`), the readiness checks of the
    run grpo-pipeline/train starts with them, nothing trained; a reward the operator did not allow
    refused before any task, naming the field, as on every served deployment."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    from flows.everyday import EVERYDAY

    client, root, _ = served
    dep = client.read_deployment_by_name("grpo-readiness/check")
    assert set(dep.parameter_openapi_schema["properties"]) == set(EVERYDAY), dep.parameter_openapi_schema
    params = {"data_source": "synthetic", "num_steps": 2, "run_name": "short-check", "storage_root": str(root)}
    run = _wait(client, run_deployment("grpo-readiness/check", parameters=params, timeout=0).id)
    assert run.state.is_completed(), run.state.message
    assert run.name == "readiness-short-check"
    arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    [report] = [a for a in arts if a.key == "readiness-short-check"]
    assert "storage" in report.data and "memory" in report.data.lower(), report.data
    assert not (root / "short-check" / "checkpoints").exists()  # nothing trained
    # the user's data, run_name, rewards and num_steps empty: the run folder, the rewards and the
    # number of steps the check reports are those grpo-pipeline/train would run (resolved as it is)
    from flows.everyday import everyday_config
    from grpo_core.resolve import resolve_run
    from tasks.stages import _key

    rows = root / "check-rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1=", "ground_truth": str(i + 1)}) + "\n" for i in range(12)))
    mine = {"data_source": str(rows), "storage_root": str(root), "run_name": None, "num_steps": None}
    given = {**dep.parameters, **mine}  # the served config's values are the form's defaults
    will = resolve_run(everyday_config(given))
    assert will.name != everyday_config(given).name  # the data's version is part of the run's name
    run = _wait(client, run_deployment("grpo-readiness/check", parameters=mine, timeout=0).id)
    assert run.state.is_completed() and run.name == f"readiness-{will.name}", (run.name, run.state.message)
    arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    [report] = [a for a in arts if a.key == _key(f"readiness-{will.name}")]
    assert f"train.num_steps {will.train.num_steps} x" in report.data, report.data
    refused = {**params, "run_name": "short-refused", "rewards": [{"function": "pty:spawn"}]}
    run = _wait(client, run_deployment("grpo-readiness/check", parameters=refused, timeout=0).id)
    assert run.state.is_failed() and "rewards[0].function 'pty:spawn' may not run" in run.state.message
    assert client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))) == []


def test_failed_run_retried_like_the_ui_resumes(served):
    client, root, flags = served
    from prefect.deployments import run_deployment
    from prefect.states import Scheduled

    run = run_deployment(
        "grpo-pipeline/pipeline",
        parameters={"config": tiny(root, "ui-retry", epochs=2, retries=0, flow_retries=1)},
        timeout=0,
    )
    run = _wait(client, run.id)
    assert run.state.is_failed() and os.path.exists(flags / "killed-again")
    rr = RunRoot(str(root / "ui-retry"))
    assert rr.read_json("summary.json")["status"] == "failed" and rr.is_done("stages/train-epoch-0")
    client.set_flow_run_state(run.id, Scheduled(), force=True)  # what the UI's Retry button does
    run = _wait(client, run.id)
    assert run.state.is_completed(), run.state.message
    s = rr.read_json("summary.json")
    assert s["status"] == "completed" and [m["step"] for m in rr.read_metrics()] == [0, 1, 2, 3]


def test_ui_form_starts_a_run(served, server, tmp_path):
    """Headless Chromium: log in, fill the pipeline deployment's form, submit, see the run complete."""
    import shutil

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from selenium import webdriver
    from selenium.common.exceptions import ElementClickInterceptedException
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from flows.params import RunParams
    from grpo_core.config.run import load_config

    client, served_root, _ = served
    url, _ = server
    base = url[: -len("/api")]
    root = tmp_path / "ui-runs"
    dep = client.read_deployment_by_name("grpo-pipeline/pipeline")
    # no scheduled runs beside the form's: on SQLite their writes can make the form's request fail
    # with "database is locked" (503, which the UI does not retry); production runs on PostgreSQL
    client.pause_deployment(dep.id)
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,2400"):
        opts.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver), options=opts)
    wait = WebDriverWait(browser, 60)

    def field(label: str, tag: str):
        xpath = f"//*[normalize-space(text())='{label} (Optional)']/following::{tag}[1]"
        return wait.until(ec.presence_of_element_located((By.XPATH, xpath)))

    def fill(label: str, tag: str, value) -> None:
        el = field(label, tag)
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", el)
        el.send_keys(Keys.CONTROL, "a")
        el.send_keys(Keys.DELETE)
        el.send_keys(str(value))

    try:
        browser.get(f"{base}/login")
        pw = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "input[type=password]")))
        pw.send_keys(AUTH, Keys.ENTER)
        wait.until(lambda b: "/login" not in b.current_url)
        browser.get(f"{base}/deployments/deployment/{dep.id}/run")
        steps, epochs = field("Num Steps", "input"), field("Epochs", "input")
        ys = {"Epochs": epochs.location["y"], "Num Steps": steps.location["y"]}
        end = field("Root", "textarea").location["y"]  # storage.root: the form's last section
        print(f"form: {ys} px of {end} px (storage.root)")  # what a user scrolls
        # issue 30, item 3: epochs and steps lead (epochs was at 75 %), no null/object choice
        assert ys["Epochs"] < 0.3 * end and ys["Num Steps"] < 0.5 * end, (end, ys)
        # the only null choices left are the three-way switches (true, false, empty: the recipe's)
        schema = RunParams.model_json_schema()
        three_way = [
            name
            for d in schema["$defs"].values()
            for name, p in d["properties"].items()
            if {k.get("type") for k in p.get("anyOf", ())} == {"boolean", "null"}
        ]
        assert browser.find_element(By.TAG_NAME, "body").text.count('Property is type "None"') == len(three_way)
        run_name = wait.until(
            ec.presence_of_element_located((By.XPATH, "//*[normalize-space(text())='Run Name']/following::input[1]"))
        )
        run_name.send_keys(Keys.CONTROL, "a")
        run_name.send_keys(Keys.DELETE)
        run_name.send_keys("ui: first try")  # issue 30, item 5: kept, not replaced by the folder's name
        fill("Root", "textarea", root)
        fill("Num Steps", "input", 2)
        fill("Epochs", "input", 1)
        fill("Synthetic Rows", "input", 64)
        fill("Eval Rows", "input", 8)
        browser.save_screenshot(str(tmp_path / "ui-form.png"))

        def submit():
            button = browser.find_element(By.XPATH, "//button[normalize-space(.)='Submit']")
            browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", button)
            try:
                button.click()
            except ElementClickInterceptedException:
                # after a refused first submit the UI's error toast can cover the button, where a
                # user would close the toast first: the button's own click, as theirs then
                browser.execute_script("arguments[0].click()", button)

        submit()
        run_id = _run_created_with_root(client, dep.id, str(root), browser, tmp_path, submit)
        browser.get(f"{base}/runs/flow-run/{run_id}")
        run = _wait(client, run_id)
        assert run.state.is_completed(), run.state.message
        assert run.parameters["config"]["storage"]["root"] == str(root) and run.name == "ui: first try"
        browser.refresh()
        WebDriverWait(browser, 120).until(lambda b: "Completed" in b.find_element(By.TAG_NAME, "body").text)
        browser.save_screenshot(str(tmp_path / "ui-run-completed.png"))
        # the fields left as the form showed them mean the defaults of this config, as on the CLI
        # (the deployment's own parameters, grpo serve's --set, are part of this config)
        sets = [f"{k}={json.dumps(v)}" for k, v in _flatten(tiny(served_root, "nightly")).items()]
        sets += [f"storage.root={root}", "train.num_steps=2", "pipeline.epochs=1"]
        sets += ["data.synthetic_rows=64", "data.eval_rows=8"]
        resolved = RunParams.model_validate(run.parameters["config"]).to_config()
        want = load_config(None, sets)
        assert resolved.to_dict() == want.to_dict(), _differences(resolved.to_dict(), want.to_dict())
        # the curve is visible where a Prefect user looks: the run's summary artifact
        [name] = os.listdir(root)
        [art] = client.read_artifacts(  # this flow run's (a scheduled run of the same name has its own)
            artifact_filter=ArtifactFilter(
                key=ArtifactFilterKey(any_=[f"summary-{name}"]), flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])
            )
        )
        browser.get(f"{base}/artifacts/artifact/{art.id}")
        curve = "//img[starts-with(@alt, 'training reward')]"
        img = wait.until(ec.presence_of_element_located((By.XPATH, curve)))
        wait.until(lambda b: b.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img))
        assert img.size["width"] > 300 and img.size["height"] > 200
        browser.save_screenshot(str(tmp_path / "ui-curve.png"))
    finally:
        browser.quit()
    s = RunRoot(str(root / name)).read_json("summary.json")
    assert s["status"] == "completed" and s["steps"] == 2
    assert (tmp_path / "ui-run-completed.png").stat().st_size > 10_000


def _differences(got, want, path: str = "") -> list[str]:
    if isinstance(got, dict) and isinstance(want, dict):
        return [d for k in sorted(set(got) | set(want)) for d in _differences(got.get(k), want.get(k), f"{path}.{k}")]
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]


def _run_created_with_root(client, deployment_id, root: str, browser, tmp_path, submit, timeout: float = 180) -> str:
    """The flow run the form created: found through the API by its parameters (the UI's own
    confirmation is a toast that can come and go between two polls on a busy machine). When the
    server answered the form's create_flow_run with a 5xx (Prefect's SQLite server on a loaded
    machine: "database is locked" after its own retries), the UI says so and the form is still
    filled: it is submitted again once, as a user would."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId

    deadline, seen, resubmitted = time.monotonic() + timeout, [], False
    while True:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[deployment_id]))
        )
        mine = [r for r in runs if r.parameters.get("config", {}).get("storage", {}).get("root") == root]
        if mine:
            return str(mine[0].id)
        seen.extend(browser.get_log("browser"))  # each call returns the entries since the last
        refused = [e for e in seen if "create_flow_run" in e["message"] and "status of 5" in e["message"]]
        if refused and not resubmitted:
            resubmitted = True
            deadline = time.monotonic() + timeout
            submit()
        if time.monotonic() > deadline:
            browser.save_screenshot(str(tmp_path / "ui-after-submit.png"))
            browser_log = "\n".join(str(e) for e in seen)[-3000:]
            raise AssertionError(
                f"no flow run with storage.root={root} after submitting the form "
                f"{'twice' if resubmitted else 'once'} (screenshot: {tmp_path / 'ui-after-submit.png'}); "
                f"browser console:\n{browser_log}"
            )
        time.sleep(1)


def test_a_typed_run_name_is_told_from_a_made_up_one():
    """issue 30, item 5: the names Prefect makes up (the server's coolname pair, the UI's Run Name
    suggestions) give way to the run folder's name; a name a user typed is kept."""
    from prefect.utilities.names import generate_slug

    from flows.pipeline import typed_name

    made_up = [generate_slug(2) for _ in range(200)] + ["Rustic-Koala", "Sleek-Bat", "alpha3-andromedae-warp", None, ""]
    assert [n for n in made_up if typed_name(n)] == []
    typed = ["lr sweep: baseline", "baseline-run", "qwen-gsm8k", "nightly", "tiny-ecc6c5c9"]
    assert [n for n in typed if not typed_name(n)] == []
