"""The dashboard's stories in a real browser (issue 16): each scenario button, pressed on a
cluster that did not prepare for it, makes its story happen and shows it (the story's
workload in view, its panels agreeing); the filter brings a match into view and lives in
the URL; a lost node is not drawn as a failure; the plots over time come from stored
samples and survive a reload; the header does not clip on a phone. Each saves a
screenshot in ``$MLWE_ARTIFACTS_DIR`` (default ``test-artifacts/``)."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from mlwe.api.auth import Role
from mlwe.api.context import ApiSettings
from tests.api.conftest import Api, free_port, make_api, wait_for
from tests.e2e.test_dashboard import ARTIFACTS, CHROMIUM, _require_chromium


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[Api, str]]:
    api = make_api(tmp_path, settings=ApiSettings(history_every_s=0.25), speed=10.0)
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


@pytest.fixture
def browser() -> Iterator[Any]:
    _require_chromium()
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


def _open(browser: Any, url: str, token: str, width: int = 1600, height: int = 1000, query: str = "") -> Any:
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": width, "height": height})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.errors = errors
    page.goto(f"{url}/{query}#token={token}")
    expect(page.locator("#conn")).to_have_class(re.compile("live"), timeout=15_000)
    return page


def _in_view(page: Any, selector: str, box: str) -> bool:
    """The element is inside its scroll box's visible part (not just in the DOM)."""
    return bool(page.evaluate(
        """([s, b]) => { const e = document.querySelector(s), c = document.querySelector(b);
            if (!e || !c) return false;
            const r = e.getBoundingClientRect(), q = c.getBoundingClientRect();
            return r.top >= q.top - 1 && r.bottom <= q.bottom + 1 && r.height > 0; }""",
        [selector, box]))


def _submit(api: Api, spec: dict[str, Any]) -> None:
    r = api.client.post("/api/v1/workloads", headers=api.h(Role.SUBMITTER), json=spec)
    assert r.status_code == 201, r.text


def _run_on_a100s(api: Api) -> list[str]:
    ids = [f"batch-train-{i}" for i in range(2)]
    for wid in ids:
        _submit(api, {"id": wid, "name": wid, "kind": "training", "priority": "batch",
                      "resources": {"gpu": 4, "cpu": 8, "memory": "64Gi"}, "gpu_models": ["A100-80GB"],
                      "estimated_duration": "2h", "checkpoint_interval": "1m"})
    assert wait_for(lambda: all(api.engine.cp.workloads[w].state.value == "running" for w in ids), timeout=30)
    return ids


def _press(page: Any, scenario: str) -> str:
    """Press a scenario button; the story's first workload (the filter is set to it)."""
    from playwright.sync_api import expect

    page.click(f"#btn-{scenario}")
    expect(page.locator("body")).to_have_attribute("data-scenario", scenario, timeout=20_000)
    story = page.input_value("#filter")
    assert story and f"filter={story}" in page.url
    return story


def _shot(page: Any, name: str) -> Path:
    page.wait_for_timeout(400)  # one more render
    path = ARTIFACTS / f"dashboard-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    return path


def test_urgent_fine_tune_preempts_even_on_an_idle_cluster(server: tuple[Api, str], browser: Any) -> None:
    from playwright.sync_api import expect

    api, url = server
    assert not any(w.placement for w in api.engine.cp.workloads.values())  # nothing runs yet
    page = _open(browser, url, api.tokens[Role.OPERATOR])
    urgent = _press(page, "urgent-fine-tune")
    assert urgent.startswith("urgent-ft-")
    cp = api.engine.cp
    assert wait_for(lambda: any(w.preempted_by == urgent for w in cp.workloads.values()), timeout=30)
    victim = next(w.id for w in cp.workloads.values() if w.preempted_by == urgent)
    assert victim.startswith("background-")  # the work the scenario put there first
    # the story is in view and the panels agree: workloads, reasoning, audit, deadlines
    expect(page.locator(f"#wl-{urgent}")).to_have_class(re.compile("match"), timeout=20_000)
    assert wait_for(lambda: _in_view(page, f"#wl-{urgent}", "#workloads"), timeout=10)
    expect(page.locator(f"#wl-{victim} .chain-states")).to_contain_text("preempting", timeout=20_000)
    expect(page.locator(f"#wl-{victim}")).to_have_class(re.compile("match"))
    trace = page.locator("#reasoning li[data-source=scheduler]").first
    expect(trace).to_contain_text(urgent, timeout=20_000)
    expect(trace).to_contain_text(victim)
    expect(page.locator("#audit li[data-kind=preempt]").first).to_contain_text(victim, timeout=20_000)
    expect(page.locator("#deadlines")).to_contain_text(urgent)
    expect(page.locator(f"#wl-{urgent} .state-badge")).to_have_text("running", timeout=30_000)
    _shot(page, "scenario-urgent-fine-tune")
    assert page.errors == []


def test_node_fails_draws_the_lost_work_as_lost_not_failed(server: tuple[Api, str], browser: Any) -> None:
    from playwright.sync_api import expect

    api, url = server
    victims = _run_on_a100s(api)
    page = _open(browser, url, api.tokens[Role.OPERATOR])
    first = _press(page, "node-fails")
    assert first in victims
    m = re.search(r"node (\S+) lost", page.inner_text("#toast"))
    assert m, page.inner_text("#toast")
    down = m.group(1)
    expect(page.locator(f"#node-{down} .nstatus")).to_have_text("down", timeout=20_000)
    chain = page.locator(f"#wl-{first} .chain-states")
    expect(chain).to_contain_text("lost", timeout=20_000)
    expect(chain).not_to_contain_text("failed")
    expect(page.locator(f"#wl-{first}")).to_have_class(re.compile("match"))
    expect(page.locator("#telemetry-events")).to_contain_text(f"{first} lost (requeued)")
    assert wait_for(lambda: _in_view(page, f"#wl-{first}", "#workloads"), timeout=10)
    _shot(page, "scenario-node-fails")
    assert page.errors == []


def test_loss_diverges_shows_the_diverging_curve_in_view(server: tuple[Api, str], browser: Any) -> None:
    from playwright.sync_api import expect

    api, url = server
    page = _open(browser, url, api.tokens[Role.OPERATOR])
    run = _press(page, "loss-diverges")
    chart = page.locator("#loss-charts .chart.diverging.match").first
    expect(chart).to_be_visible(timeout=40_000)
    expect(chart).to_contain_text(run)
    # the story's chart comes first in its box, whatever else trains
    assert page.evaluate("document.querySelector('#loss-charts .chart').textContent").startswith(run)
    expect(page.locator(f"#wl-{run}")).to_have_class(re.compile("match"))
    _shot(page, "scenario-loss-diverges")
    assert page.errors == []


def test_oom_loop_shows_real_failures_and_retries(server: tuple[Api, str], browser: Any) -> None:
    from playwright.sync_api import expect

    api, url = server
    page = _open(browser, url, api.tokens[Role.OPERATOR])
    job = _press(page, "oom-loop")
    assert wait_for(lambda: api.engine.cp.workloads[job].failures >= 2, timeout=40)
    chain = page.locator(f"#wl-{job} .chain-states")
    expect(chain).to_contain_text("failed", timeout=20_000)  # an OOM is the workload's failure
    expect(chain).not_to_contain_text("lost")
    expect(page.locator("#audit")).to_contain_text("oom-loop")
    expect(page.locator(f"#wl-{job}")).to_have_class(re.compile("match"))
    _shot(page, "scenario-oom-loop")
    assert page.errors == []


def test_the_filter_brings_a_match_into_view_and_stays_in_the_url(server: tuple[Api, str], browser: Any) -> None:
    from playwright.sync_api import expect

    api, url = server
    for i in range(80):
        _submit(api, {"id": f"job-{i:02d}", "name": f"job {i}", "resources": {"cpu": 0.1},
                      "estimated_duration": "2h"})
    page = _open(browser, url, api.tokens[Role.VIEWER], query="?filter=job-03")
    row = "#wl-job-03"
    expect(page.locator(row)).to_have_class(re.compile("match"), timeout=20_000)
    assert page.input_value("#filter") == "job-03"
    assert wait_for(lambda: _in_view(page, row, "#workloads"), timeout=10)
    page.fill("#filter", "job-71")
    expect(page.locator("#wl-job-71")).to_have_class(re.compile("match"))
    assert "filter=job-71" in page.url
    assert wait_for(lambda: _in_view(page, "#wl-job-71", "#workloads"), timeout=10)
    page.reload()
    expect(page.locator("#wl-job-71")).to_have_class(re.compile("match"), timeout=20_000)
    assert page.input_value("#filter") == "job-71"
    _shot(page, "filter")
    assert page.errors == []


def test_plots_over_time_come_from_stored_samples_and_survive_a_reload(
    server: tuple[Api, str], browser: Any
) -> None:
    api, url = server
    _run_on_a100s(api)
    assert wait_for(lambda: len(api.client.get("/api/v1/history", headers=api.h(Role.VIEWER)).json()["items"]) >= 4,
                    timeout=30)
    page = _open(browser, url, api.tokens[Role.VIEWER])
    points = lambda: int(page.get_attribute("#plot-util", "data-points") or 0)  # noqa: E731
    assert wait_for(lambda: points() >= 4, timeout=20)
    assert re.search(r"allocated \d+%", page.inner_text("#plot-util .legend"))
    assert "default" in page.inner_text("#plot-queue .legend")
    page.reload()
    assert wait_for(lambda: points() >= 4, timeout=20)  # straight from the store, not rebuilt live
    _shot(page, "history")


def test_the_header_does_not_clip_on_a_phone(server: tuple[Api, str], browser: Any) -> None:
    api, url = server
    page = _open(browser, url, api.tokens[Role.VIEWER], width=390, height=844)
    page.wait_for_selector("#kpis .kpi")
    clipped = page.evaluate(
        """() => [...document.querySelectorAll('#kpis .kpi, #filter, #conn')]
             .filter((e) => { const r = e.getBoundingClientRect(); return r.right > innerWidth + 1 || r.left < -1; })
             .map((e) => e.textContent || e.id)""")
    assert clipped == []
    assert page.evaluate("document.documentElement.scrollWidth") <= 391
    _shot(page, "narrow-390")


def test_a_snapshot_older_than_the_stream_does_not_rewind_a_lifecycle(
    server: tuple[Api, str], browser: Any
) -> None:
    """The page refreshes its snapshot every 2 s; on a busy machine one can be answered
    after newer state events arrived. Its lifecycle must not replace theirs (it would
    drop the states seen since, e.g. a victim's 'preempting'). Here every snapshot is
    made stale on purpose: the workload's lifecycle cut to its first state and its
    transition count to 1."""
    import json

    from playwright.sync_api import expect

    api, url = server
    page = _open(browser, url, api.tokens[Role.OPERATOR])

    served: list[int] = []

    def stale(route: Any) -> None:
        resp = route.fetch()
        body = resp.json()
        served.append(len(body.get("workloads", [])))
        for w in body.get("workloads", []):
            if w.get("id") == "stale-check":
                w["lifecycle"], w["lifecycle_causes"], w["transitions"] = ["pending"], [None], 1
                w["state"] = "pending"
        route.fulfill(response=resp, body=json.dumps(body))

    page.route(re.compile(r".*/api/v1/cluster(\?.*)?$"), stale)
    _submit(api, {"id": "stale-check", "name": "stale-check", "resources": {"cpu": 0.1},
                  "estimated_duration": "2h"})
    assert wait_for(lambda: api.engine.cp.workloads["stale-check"].state.value == "running",
                    timeout=30)
    chain = page.locator("#wl-stale-check .chain-states")
    expect(chain).to_contain_text("running", timeout=20_000)
    # a few stale snapshot refreshes (every 2 s) come in; then a new state event draws
    # the row again: the chain goes on from what the stream said
    for _ in range(120):  # route handlers run while Playwright waits (a condition, not a sleep)
        if len(served) >= 3:
            break
        page.wait_for_timeout(250)
    assert len(served) >= 3, served
    r = api.client.post("/api/v1/workloads/stale-check/cancel", headers=api.h(Role.SUBMITTER))
    assert r.status_code < 300, r.text
    expect(chain).to_contain_text("cancelled", timeout=20_000)
    expect(chain).to_have_text(re.compile(r"pending.*admitted.*starting.*running.*cancelled"))
    assert max(served) >= 1, served  # the stale snapshots did hold the workload
    assert page.errors == []
