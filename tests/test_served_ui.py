"""What a Prefect user sees of the served deployments (issue 30): a cancelled run's log holds no
error, the run form leads with steps and epochs in both of Prefect 3.8.8's UIs (V2, the default,
and V1) while the API's spelling of them still works, and each deployment's description is on
its page. A real `prefect server start` and `grpo serve` on 127.0.0.1; headless Chromium for the
UI (skipped without Debian's chromium and chromium-driver)."""

import contextlib
import json
import shutil
import subprocess
import time

import pytest

from grpo_core.store.root import RunRoot
from tests.test_deployments import (
    AUTH,
    BIN,
    _flatten,
    _stop,
    _wait,
    client_env,
    served_client,
    tiny,
    wait_logs,
)
from tests.test_serve_stop import long_run, wait_training

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def serving(server, tmp_path_factory):
    """`grpo serve` with no schedule, its pipeline's parameters a tiny config."""
    url, home = server
    root = tmp_path_factory.mktemp("served-ui-runs")
    sets = [f"{k}={json.dumps(v)}" for k, v in _flatten(tiny(root, "ui")).items()]
    proc = subprocess.Popen(
        [f"{BIN}/grpo", "serve", "--allow-root", str(tmp_path_factory.getbasetemp())]
        + sum((["--set", s] for s in sets), []),
        env=client_env(home, url),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    with served_client(url, proc) as client:
        yield client, root, url[: -len("/api")]
    _stop(proc)


def test_a_cancelled_run_logs_nothing_at_error(serving):
    """issue 30, item 6: after the UI's Cancel the running task logged Prefect's "Crash
    detected! Execution was aborted by a termination signal." and "Finished in state
    Crashed(...)" at ERROR, and the flow "run interrupted: prefect.exceptions.TerminationSignal"."""
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    client, root, _ = serving
    run = run_deployment("grpo-pipeline/pipeline", parameters={"config": long_run(root, "cancel-me")}, timeout=0)
    wait_training(client, run.id, root / "cancel-me")
    client.set_flow_run_state(run.id, Cancelling(), force=True)  # the UI's Cancel
    assert _wait(client, run.id, timeout=120).state.is_cancelled()
    logs = wait_logs(client, run.id, lambda logs: any(log.message.startswith("Finished: cancelled") for log in logs))
    lines = [(log.level, log.message) for log in logs]
    assert not [line for line in lines if line[0] >= 40], lines  # nothing at ERROR or above
    cancelled = "the flow run was cancelled (the UI's Cancel or the API)"
    assert (20, f"Stopped: {cancelled}") in lines, lines[-12:]  # the task's line, at INFO
    assert (20, "Finished: interrupted (Prefect marks the task run Crashed)") in lines, lines[-12:]
    assert (20, f"run interrupted: stopped by SIGTERM: {cancelled}") in lines, lines[-12:]
    assert (20, "Finished: cancelled (the runner sets the flow run Cancelled)") in lines, lines[-12:]


@contextlib.contextmanager
def _browser(base: str):
    """Headless Chromium, logged in to the server's UI."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,2400"):
        opts.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver), options=opts)
    try:
        browser.get(f"{base}/login")
        wait = WebDriverWait(browser, 60)
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "input[type=password]"))).send_keys(
            AUTH, Keys.ENTER
        )
        wait.until(lambda b: "/login" not in b.current_url)
        yield browser
    finally:
        browser.quit()


def _field(browser, label: str, tag: str):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    xpath = f"//*[normalize-space(text())='{label} (Optional)']/following::{tag}[1]"
    return WebDriverWait(browser, 60).until(ec.presence_of_element_located((By.XPATH, xpath)))


def test_the_form_leads_with_steps_and_epochs_and_keeps_the_api_spelling(serving, tmp_path):
    """issue 30, item 3: Epochs and Num Steps sat at 22 % and 43 % of the form (V2; V1 alike) as
    the first fields of their sections. Now they are the form's first two fields, while a
    deployment whose parameters spell config.train.num_steps (a prefect.yaml, the API) keeps its
    value: the form does not show it, submits it, and the run takes it (3 steps, not the 4 the
    served config has)."""
    from prefect.client.schemas.actions import DeploymentUpdate
    from selenium.webdriver.common.by import By

    from flows.params import RunParams

    client, _, base = serving
    dep = client.read_deployment_by_name("grpo-pipeline/pipeline")
    root = str(tmp_path / "form-runs")
    old_spelling = tiny(root, "form", epochs=1)  # train: {num_steps: 4, ...}, pipeline: {epochs: 1, ...}
    old_spelling["train"]["num_steps"] = 3
    client.update_deployment(dep.id, DeploymentUpdate(parameters={"config": old_spelling}))
    with _browser(base) as browser:
        for ui in ("/v2", ""):  # V2, the default UI, then V1
            browser.get(f"{base}{ui}/deployments/deployment/{dep.id}/run")
            ys = {label: _field(browser, label, "input").location["y"] for label in ("Num Steps", "Epochs")}
            end = _field(browser, "Root", "textarea").location["y"]  # storage.root: the form's last section
            print(f"form {ui or '/v1'}: {ys} px of {end} px (storage.root)")
            assert ys["Num Steps"] < ys["Epochs"] < 0.05 * end, (ui, end, ys)
            assert _field(browser, "Num Steps", "input").get_attribute("value") == ""  # the API's 3: not shown
        # submitted untouched (V1, the page open), the API's spelling reaches the run
        submit = browser.find_element(By.XPATH, "//button[normalize-space(.)='Submit']")
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", submit)
        submit.click()
        deadline, again = time.monotonic() + 120, time.monotonic() + 30
        while not (runs := [r for r in client.read_flow_runs() if _root(r) == root]):
            assert time.monotonic() < deadline, "no flow run from the form"
            if time.monotonic() > again and browser.current_url.endswith("/run"):
                # still on the form: SQLite answered the form's write 503 "database is locked"
                # (Prefect's clients retry that, its UI does not), so Submit again, as a user would
                browser.find_element(By.XPATH, "//button[normalize-space(.)='Submit']").click()
                again = deadline
            time.sleep(1)
    cfg = RunParams.model_validate(runs[0].parameters["config"]).to_config()
    assert (cfg.train.num_steps, cfg.pipeline.epochs) == (3, 1), runs[0].parameters
    assert _wait(client, runs[0].id).state.is_completed()
    assert RunRoot(f"{root}/form").read_json("summary.json")["steps"] == 3


def _root(run) -> str | None:
    return run.parameters.get("config", {}).get("storage", {}).get("root")


def test_each_deployment_shows_its_description(serving):
    """issue 30, item 5: descriptions were checked through the API only. Prefect 3.8.8's
    deployment lists (V2 and V1) have no description column (name, flow, status, activity, tags,
    schedules); the deployment's own page shows it (V2: its Description tab)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    client, _, base = serving
    with _browser(base) as browser:
        browser.get(f"{base}/v2/deployments")
        WebDriverWait(browser, 60).until(lambda b: "readiness" in b.find_element(By.TAG_NAME, "body").text)
        for name in ("grpo-pipeline/pipeline", "grpo-evaluate/evaluate", "grpo-readiness/readiness"):
            dep = client.read_deployment_by_name(name)
            assert dep.description
            browser.get(f"{base}/v2/deployments/deployment/{dep.id}?tab=Description")
            WebDriverWait(browser, 60).until(lambda b: dep.description in b.find_element(By.TAG_NAME, "body").text)
