"""`overbrainer serve`, as a user meets it: the real server in its own process, driven over
HTTP and by Debian's headless Chromium (selenium and chromium-driver). The run page's
screenshot is saved in ``test-output/serve-run-page.png`` for people to look at."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from helpers import REPO, cli, make_project, trainers_of

from overbrainer import journal
from overbrainer.folder import RunFolder
from overbrainer.runtime.run import Run

OUTPUT = REPO / "test-output"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "overbrainer", "serve", "--runs", str(tmp_path / "runs"),
                             "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            page = urllib.request.urlopen(url + "/", timeout=5).read().decode()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "no server"
            time.sleep(0.2)
    token = json.loads(re.search(r'data-config="([^"]*)"', page).group(1).replace("&quot;", '"'))["token"]
    yield url, token, port
    proc.terminate()
    proc.wait(30)


def request(url: str, method: str = "GET", headers: dict | None = None, body: dict | None = None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    try:
        return urllib.request.urlopen(urllib.request.Request(url, data, method=method, headers=headers or {}),
                                      timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code


def test_paths_stay_in_the_runs_folder_and_actions_need_the_token(server, baked_copy, tmp_path):
    baked_copy()
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "run.json").write_text("{}")  # a run-looking folder beside the runs folder
    url, token, port = server
    assert request(f"{url}/api/runs/tiny") == 200
    for bad in ("..%2Fsecret", "%2e%2e%2fsecret", "..", "%2e%2e", "..%5Csecret", "tiny%2F..%2F..%2Fsecret",
                "%252e%252e%252fsecret", "..%2F..%2F..%2Fetc%2Fpasswd"):
        assert request(f"{url}/api/runs/{bad}") == 404, bad
        assert request(f"{url}/run/{bad}") == 404, bad
        assert request(f"{url}/api/runs/{bad}/events") == 404, bad
        assert request(f"{url}/api/runs/{bad}/chat", "POST", {"X-Overbrainer-Token": token}, {}) == 404, bad
    chat = f"{url}/api/runs/tiny/chat"
    hello = {"messages": [{"role": "user", "content": "Hello"}], "checkpoint": None}
    assert request(chat, "POST", {}, hello) == 403
    assert request(chat, "POST", {"X-Overbrainer-Token": token, "Origin": "http://evil.example"}, hello) == 403
    assert request(chat, "POST", {"X-Overbrainer-Token": token}, {"messages": "Hello"}) == 400
    assert request(chat, "POST", {"X-Overbrainer-Token": token}, {**hello, "checkpoint": 5}) == 409  # none at 5
    stop = f"{url}/api/runs/tiny/stop"
    assert request(stop, "POST") == 403
    assert request(stop, "POST", {"X-Overbrainer-Token": "guess"}) == 403
    assert request(stop, "POST", {"X-Overbrainer-Token": token, "Origin": "http://evil.example"}) == 403
    assert request(stop, "POST", {"X-Overbrainer-Token": token, "Sec-Fetch-Site": "cross-site"}) == 403
    assert request(stop, "POST", {"X-Overbrainer-Token": token, "Origin": f"http://127.0.0.1:{port}"}) == 200
    # the graph as the folder records it: a bake that failed at its last step
    folder = RunFolder(tmp_path / "runs" / "tiny")
    folder.stamp("bake").unlink()
    journal.update(folder, state="failed", task="bake")
    graph = json.loads(urllib.request.urlopen(f"{url}/api/runs/tiny", timeout=10).read())["graph"]
    assert "class resolve,base,split,config,train,merge done" in graph and "class bake failed" in graph, graph
    taken = cli("serve", "--runs", str(tmp_path / "runs"), "--port", str(port), check=2)
    assert taken.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use); pick another with --port"]


def chromium(tmp_path):
    """Debian's headless Chromium under selenium, or a skip that says why it cannot start."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        pytest.skip(f"selenium is not installed ({e}); pip install -e '.[dev]'")
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not binary or not driver:
        pytest.skip("Chromium cannot start: chromium or chromedriver is not installed (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1200,1700",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    try:
        return webdriver.Chrome(options=options, service=Service(driver))
    except Exception as e:  # noqa: BLE001 - whatever stops it starting is the reason to say
        pytest.skip(f"Chromium cannot start: {str(e).strip().splitlines()[0]}")


def until(what: str, check, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return got


def test_the_page_in_a_real_browser(server, baked_copy, tmp_path, tiny_model):
    # the browser first: where it cannot start, the test is skipped before a 20,000-step
    # run is started that nothing would stop
    browser = chromium(tmp_path)
    running = Run(tmp_path / "runs" / "long")
    url, _, _ = server

    def graph() -> dict:
        """Each step's node in the page's Mermaid drawing, and its state (a class of the node)."""
        nodes = browser.execute_script("return [...document.querySelectorAll('#graph g.node')]"
                                       ".map(g => [g.id, g.getAttribute('class')])")
        return {re.search(r"flowchart-(\w+)-\d+$", i).group(1): c.split()[-1] for i, c in nodes if "plan" not in i}

    try:
        baked_copy()  # "tiny": a finished run
        long = make_project(tmp_path / "long-project", tiny_model)
        long.plan["name"] = "long"
        long.write(steps=20000, save_every=5000, eval_every=10, samples={"every": 1000, "max_new_tokens": 4})
        cli("bake", str(long.plan_path), "--detach", "--runs", str(tmp_path / "runs"))
        until("the long run training", lambda: running.progress()["step"] >= 2, timeout=300)
        browser.get(url + "/")
        rows = until("both runs listed", lambda: {
            r.get_attribute("data-run"): r.find_element("css selector", ".state").text
            for r in browser.find_elements("css selector", "#runs tr[data-run]")} or None)
        assert rows == {"tiny": "done", "long": "running"}, rows

        # the finished run: every step done in its graph, and a chat with its baked model
        browser.get(f"{url}/run/tiny")
        assert until("the graph drawn", graph) == dict.fromkeys(
            ["resolve", "base", "split", "config", "train", "merge", "bake"], "done")
        until("the models to chat with", lambda: browser.find_elements("css selector", "#chat-model option"))
        browser.find_element("id", "chat-text").send_keys("Hello")
        browser.find_element("id", "chat-send").click()
        said = until("the answer", lambda: browser.find_elements("css selector", "#chat-log .answer"), timeout=180)
        from overbrainer.chat import Model

        expected = Model.baked(tmp_path / "runs" / "tiny").chat("Hello", max_new_tokens=64)
        assert said[0].text == (expected or "(an empty answer)")

        browser.get(f"{url}/run/long")
        until("the train step running in the graph", lambda: graph().get("train") == "running")
        assert graph()["split"] == "done" and graph()["merge"] == "missing"
        until("step 0's samples", lambda: "step 0" in browser.find_element("id", "samples").text)
        first = until("points on the curve", lambda: browser.execute_script("return window.points"))
        until("the curve gaining points without a reload",
              lambda: browser.execute_script("return window.points") > first, timeout=60)
        OUTPUT.mkdir(exist_ok=True)
        browser.save_screenshot(str(OUTPUT / "serve-run-page.png"))

        browser.find_element("id", "stop").click()
        until("the run stopped", lambda: running.state == "stopped", timeout=300)
        assert not trainers_of(running.folder.root)
        until("the page showing it stopped", lambda: browser.find_element("id", "state").text == "stopped", timeout=30)
    finally:
        browser.quit()
        if running.folder.root.exists() and running.state in ("starting", "running", "stopping"):
            running.stop(wait=True, timeout=120)
    assert os.path.getsize(OUTPUT / "serve-run-page.png") > 10_000
