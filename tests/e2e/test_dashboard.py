"""End to end in a real browser: Chromium from the OS packages, driven by Playwright,
loads the dashboard from a real server in front of a real engine, triggers the urgent
fine-tune scenario on a full cluster, and sees the preemption in all four panels
(telemetry, workload state machines, reasoning, audit); filtering by the preemptor
lights up the same story everywhere. A workload named ``<script>`` shows as text.
The screenshot is saved as a test artifact (``$MLWE_ARTIFACTS_DIR``, default
``test-artifacts/``).

Chromium must be at /usr/bin/chromium (``make setup`` installs it). Without it the
test is skipped, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from mlwe.api.auth import Role
from tests.api.conftest import Api, free_port, make_api, wait_for

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("MLWE_ARTIFACTS_DIR", "test-artifacts"))
XSS = "<script>alert('xss')</script>"


def _require_chromium() -> None:
    problem = None
    if not CHROMIUM.exists():
        problem = f"{CHROMIUM} is missing (run `make setup`, which installs Debian's chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError as exc:
            problem = f"playwright is not installed: {exc}"
    if problem:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{problem} (CI=true: the browser test must run)", pytrace=False)
        pytest.skip(problem)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Api, str]]:
    api = make_api(tmp_path, speed=10.0)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(api.svc.app, host="127.0.0.1", port=port, log_level="warning",
                                        timeout_graceful_shutdown=1))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    assert wait_for(lambda: srv.started, timeout=20)
    try:
        yield api, f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        t.join(timeout=10)
        api.svc.close()


def _fill_the_a100s(api: Api) -> list[str]:
    ids = []
    for i in range(2):
        wid = f"batch-train-{i}"
        r = api.client.post("/api/v1/workloads", headers=api.h(Role.SUBMITTER), json={
            "id": wid, "name": f"nightly batch training {i}", "kind": "training", "priority": "batch",
            "resources": {"gpu": 4, "cpu": 8, "memory": "64Gi"}, "gpu_models": ["A100-80GB"],
            "estimated_duration": "2h", "checkpoint_interval": "1m"})
        assert r.status_code == 201, r.text
        ids.append(wid)
    r = api.client.post("/api/v1/workloads", headers=api.h(Role.SUBMITTER), json={
        "id": "xss-probe", "name": XSS, "resources": {"cpu": 1}, "estimated_duration": "2h"})
    assert r.status_code == 201
    assert wait_for(lambda: all(api.engine.cp.workloads[w].state.value == "running" for w in ids), timeout=30)
    return ids


def test_dashboard_shows_a_preemption_in_all_four_panels(server: tuple[Api, str]) -> None:
    _require_chromium()
    from playwright.sync_api import expect, sync_playwright

    api, url = server
    victims = _fill_the_a100s(api)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    dialogs: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(f"{url}/#token={api.tokens[Role.OPERATOR]}")
            expect(page.locator("#who")).to_contain_text("operator", timeout=15_000)
            assert "token=" not in page.url  # the token left the address bar
            expect(page.locator("#conn")).to_have_class(re.compile("live"), timeout=15_000)
            # the cluster map shows the two batch jobs on the A100 GPUs
            expect(page.locator("#cluster-map .gpu.busy")).to_have_count(8, timeout=15_000)
            # escaping: the hostile name is text, nothing ran
            expect(page.locator("#workloads")).to_contain_text(XSS, timeout=15_000)
            assert page.evaluate("document.querySelectorAll('script').length") == 1

            page.click("#btn-urgent-fine-tune")
            expect(page.locator("#toast")).to_contain_text("urgent", timeout=15_000)
            assert wait_for(lambda: any(api.engine.cp.workloads[v].preemptions for v in victims), timeout=30)
            victim = next(v for v in victims if api.engine.cp.workloads[v].preemptions)
            urgent = api.engine.cp.workloads[victim].preempted_by
            assert urgent and urgent.startswith("urgent-ft-")

            # 1. workload state machines: the victim's transition to preempting, as it happened
            expect(page.locator(f"#wl-{victim} .chain-states")).to_contain_text("preempting", timeout=20_000)
            # 2. audit log: the scheduler's preempt decision, chained
            expect(page.locator("#audit li[data-kind=preempt]").first).to_contain_text(victim, timeout=20_000)
            expect(page.locator("#chain")).to_contain_text("chain ✓", timeout=20_000)
            # 3. reasoning: the scheduler's trace (finding, options, choice, verdict)
            trace = page.locator("#reasoning li[data-source=scheduler]").first
            expect(trace).to_contain_text(urgent, timeout=20_000)
            expect(trace).to_contain_text(victim)
            expect(trace).to_contain_text("applied by the control plane")
            # 4. telemetry: the victim's run stops for the preemption
            expect(page.locator("#telemetry-events li[data-kind=preempting]").first).to_contain_text(
                f"{victim} preempting by {urgent}", timeout=20_000)

            # the urgent job takes the freed GPUs (once the victim's checkpoint released them)
            expect(page.locator(f"#wl-{urgent} .state-badge")).to_have_text("running", timeout=30_000)
            expect(page.locator("#deadlines")).to_contain_text(urgent)

            # filtering by the preemptor lights up the same story in all four panels
            page.fill("#filter", urgent)
            for panel in ("#panel-workloads", "#panel-audit", "#panel-reasoning", "#panel-telemetry"):
                expect(page.locator(f"{panel} .match").first).to_be_visible(timeout=10_000)
            expect(page.locator(f"#wl-{victim}")).to_have_class(re.compile("match"))
            expect(page.locator("#wl-xss-probe")).not_to_have_class(re.compile("match"))
            # an operator cordons a node from the map
            page.fill("#filter", "")
            page.hover("#node-t4-0")
            page.click("#node-t4-0 button[data-action=cordon]")
            expect(page.locator("#node-t4-0 .nstatus")).to_have_text("cordoned", timeout=10_000)
            assert api.engine.cp.node_status("t4-0").value == "cordoned"
            page.fill("#filter", urgent)
            time.sleep(0.5)  # one more render for the picture
            shot = ARTIFACTS / "dashboard-preemption.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
        finally:
            browser.close()
    assert dialogs == [], dialogs  # no script ran from data
    assert errors == [], errors  # no CSP violation, no script error
