"""What a Prefect user sees of the served deployments (issue 30): a cancelled run's log holds no
error, the run form leads with steps and epochs in both of Prefect 3.8.8's UIs (V2, the default,
and V1) while the API's spelling of them still works, and each deployment's description is on
its page. A real `prefect server start` and `grpo serve` on 127.0.0.1; headless Chromium for the
UI (skipped without Debian's chromium and chromium-driver)."""

import contextlib
import json
import re
import shutil
import subprocess
import time

import pytest

from flows.serve import SERVED_NAMES
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
def _browser(base: str, viewport: tuple[int, int] | None = None):
    """Headless Chromium, logged in to the server's UI; `viewport`: the page's size (the window's,
    less its frame), as a screen of that size shows it."""
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
        if viewport:  # the page's size set by DevTools: no window resize to wait for (a busy machine lags one)
            metrics = {"width": viewport[0], "height": viewport[1], "deviceScaleFactor": 1, "mobile": False}
            browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
            inner = browser.execute_script("return [window.innerWidth, window.innerHeight]")
            assert tuple(inner) == tuple(viewport), inner
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
        for name in SERVED_NAMES:
            dep = client.read_deployment_by_name(name)
            assert dep.description
            browser.get(f"{base}/v2/deployments/deployment/{dep.id}?tab=Description")
            WebDriverWait(browser, 60).until(lambda b: dep.description in b.find_element(By.TAG_NAME, "body").text)


# What issue 54 measured of a run form at 1440 x 900: the controls a user fills (inputs, text
# areas, selects and switches; not the buttons: each field's menu, Add item) and the page's height
# (V1 scrolls the page in a container of its own, whose height counts).
_MEASURE = """
const shown = e => e.getClientRects().length > 0 && e.getAttribute('aria-hidden') !== 'true';
const controls = [...document.querySelectorAll('input:not([type=hidden]), textarea, select, [role=switch]')];
let height = document.scrollingElement.scrollHeight;
for (const e of document.querySelectorAll('*'))
  if (/auto|scroll/.test(getComputedStyle(e).overflowY)) height = Math.max(height, e.scrollHeight);
return {controls: controls.filter(shown).length, height: height};
"""
# the field a run needs: the bottom of its control, px from the top of the page (not scrolled)
_FIRST_SCREEN = {
    "Data source": "textarea[1]",
    "Model path": "textarea[1]",
    "Rewards": "button[normalize-space(.)='Add item'][1]",
    "Steps": "input[1]",
    "Run folder (run_name)": "textarea[1]",
}


def test_the_everyday_form_is_short_and_its_run_is_the_clis(serving, tmp_path):
    """issue 54: grpo-pipeline/pipeline's form was ~166 controls over ~20,650 px (V1 at 1440 x 900),
    the model path at 14 %, the rewards at 22 %, the run folder at 98 %. grpo-pipeline/train, the
    everyday form: <= 25 controls and <= 3,000 px, data, model, rewards, steps and run folder in the
    first 900 px, in both UIs. Filled from the top and submitted (V2), its run is the run of the
    same keys on the command line; the flow run's Artifacts tab (V1) shows the summary and the
    progress as the flow run's own (it said "Flow run: None"), and the summary its curve."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from flows.everyday import everyday_config
    from grpo_core.config.run import load_config

    client, _, base = serving
    dep = client.read_deployment_by_name("grpo-pipeline/train")
    root = str(tmp_path / "everyday-runs")
    with _browser(base, viewport=(1440, 900)) as browser:
        wait = WebDriverWait(browser, 60)
        for ui in ("", "/v2"):  # V1, then V2 (the default), where the form is filled
            browser.get(f"{base}{ui}/deployments/deployment/{dep.id}/run")
            _field(browser, "Storage root", "textarea")  # the form's last field: the form is there
            form = browser.execute_script(_MEASURE)
            controls = {
                label: browser.find_element(
                    By.XPATH, f"//*[normalize-space(text())='{label} (Optional)']/following::{el}"
                )
                for label, el in _FIRST_SCREEN.items()
            }
            bottoms = {label: el.rect["y"] + el.rect["height"] for label, el in controls.items()}
            print(f"everyday form {ui or '/v1'}: {form['controls']} controls, {form['height']} px; {bottoms}")
            browser.save_screenshot(str(tmp_path / f"everyday-form{ui.replace('/', '-') or '-v1'}.png"))
            assert form["controls"] <= 25 and form["height"] <= 3000, (ui, form)
            assert max(bottoms.values()) <= 900, (ui, bottoms)

        def fill(label: str, tag: str, value) -> None:
            el = _field(browser, label, tag)
            browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", el)
            el.send_keys(Keys.CONTROL, "a")
            el.send_keys(Keys.DELETE)
            el.send_keys(str(value))

        fill("Data source", "textarea", "synthetic")
        add = browser.find_element(
            By.XPATH,
            "//*[normalize-space(text())='Rewards (Optional)']/following::button[normalize-space(.)='Add item']",
        )
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", add)
        add.click()
        # a reward is a function or a model: both optional in the form
        xpath = "//*[normalize-space(text())='Function (Optional)']/following::textarea[1]"
        wait.until(ec.presence_of_element_located((By.XPATH, xpath))).send_keys("char_match")
        fill("Steps", "input", 2)
        fill("Run folder (run_name)", "textarea", "everyday")
        fill("Learning rate", "input", "0.0005")
        fill("Epochs", "input", 1)
        fill("Storage root", "textarea", root)
        browser.save_screenshot(str(tmp_path / "everyday-form-filled.png"))
        submit = browser.find_element(By.XPATH, "//button[normalize-space(.)='Submit']")
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", submit)
        submit.click()
        deadline, again = time.monotonic() + 120, time.monotonic() + 30
        while not (runs := [r for r in client.read_flow_runs() if r.parameters.get("storage_root") == root]):
            assert time.monotonic() < deadline, "no flow run from the everyday form"
            if time.monotonic() > again and browser.current_url.endswith("/run"):  # SQLite's 503: Submit again
                browser.find_element(By.XPATH, "//button[normalize-space(.)='Submit']").click()
                again = deadline
            time.sleep(1)
        run = _wait(client, runs[0].id)
        assert run.state.is_completed(), run.state.message
        # the fields left as the form showed them are the defaults of this config, as on the CLI
        sets = ["data.source=synthetic", 'rewards=[{"function": "char_match"}]', "train.num_steps=2"]
        sets += [
            "run_name=everyday",
            "train.optimizer.learning_rate=0.0005",
            "pipeline.epochs=1",
            f"storage.root={root}",
        ]
        assert everyday_config(run.parameters).to_dict() == load_config(None, sets).to_dict(), run.parameters
        assert RunRoot(f"{root}/everyday").read_json("summary.json")["steps"] == 2
        # the summary and the progress are the flow run's own, not a task run's
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
        own = {a.key for a in arts if a.task_run_id is None}
        assert {"summary-everyday", "train-everyday"} <= own, [(a.key, a.task_run_id) for a in arts]
        browser.get(f"{base}/runs/flow-run/{run.id}")  # V1: its Artifacts tab has a "Flow run" section
        tab = "//*[(@role='tab' or contains(@class, 'p-tab')) and normalize-space(.)='Artifacts']"
        wait.until(ec.element_to_be_clickable((By.XPATH, tab))).click()
        card = wait.until(ec.element_to_be_clickable((By.XPATH, "//*[normalize-space(text())='summary-everyday']")))
        # the tab's sections: "Flow run" (it said "None"), then "Task runs" (readiness, evaluation)
        sections = wait.until(
            lambda b: re.search(r"\nFlow run\n(.*?)\nTask runs\b", b.find_element(By.TAG_NAME, "body").text, re.S)
        )
        own = sections.group(1)
        assert "summary-everyday" in own and "train-everyday" in own and "100%" in own, own
        browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", card)
        browser.save_screenshot(str(tmp_path / "everyday-artifacts.png"))
        card.click()
        img = wait.until(ec.presence_of_element_located((By.XPATH, "//img[starts-with(@alt, 'training reward')]")))
        wait.until(lambda b: b.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img))
        assert img.size["width"] > 300 and img.size["height"] > 200
        browser.save_screenshot(str(tmp_path / "everyday-summary.png"))


def test_the_everyday_deployment_refuses_what_the_operator_did_not_allow(serving, tmp_path):
    """grpo-pipeline/train goes through the trust policy as grpo-pipeline/pipeline does (issue 28):
    a reward naming a library callable is refused before any task, naming the field, not retried."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.deployments import run_deployment

    client, _, _ = serving
    root = tmp_path / "refused"
    params = {"rewards": [{"function": "pty:spawn"}], "storage_root": str(root), "num_steps": 2}
    run = _wait(client, run_deployment("grpo-pipeline/train", parameters=params, timeout=0).id)
    assert run.state.is_failed() and "rewards[0].function 'pty:spawn' may not run" in run.state.message
    assert client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))) == []
    assert run.run_count == 0 and not root.exists()  # grpo serve refused it before the flow run's process
