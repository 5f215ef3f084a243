"""`gcshadow web` in a real headless Chromium: what a person sees.

A real gcshadow, real gcwrap jobs and a real `gcshadow web` on loopback (and
on a veth address of a test namespace for the login), driven by selenium
through the operating system's chromium and chromium-driver packages. Every
wait is bounded (WebDriverWait). Skipped, with the reason, where the browser
or selenium is missing.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import ShadowProc, Wrapper, wait_until
from test_web import WebProc, job_state, run_job, step_job

pytestmark = pytest.mark.timeout(180)

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
DRIVER = shutil.which("chromedriver")
WAIT = 30  # seconds any one thing may take to show in the browser


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed: pip install -e '.[test]'")
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("needs the chromium and chromium-driver packages (apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chromium-profile'}",
                "--window-size=1400,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    driver.set_page_load_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver: Any, cond: Callable[[Any], Any], what: str, timeout: float = WAIT) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException, WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    def settled(d: Any) -> Any:
        # The page re-renders while we look: an element found a moment ago may
        # have left the document. That is "not yet", never a failure.
        try:
            return cond(d)
        except WebDriverException as e:
            if isinstance(e, StaleElementReferenceException) or "does not belong to the document" in str(e):
                return False
            raise

    try:
        return WebDriverWait(driver, timeout).until(settled)
    except TimeoutException:
        raise AssertionError(f"the browser did not show {what} within {timeout} s; page text:\n"
                             + driver.find_element("tag name", "body").text[:3000]) from None


def text_of(driver: Any, css: str) -> str:
    # Read in one script run: the page re-renders while we look, and an element
    # found by one WebDriver call can be gone from the document by the next.
    text = driver.execute_script(
        "const e = document.querySelector(arguments[0]);"
        " return e && e.getClientRects().length ? e.innerText : '';", css)  # shown text only, as a user sees it
    return (text or "").strip()


def attr_of(driver: Any, css: str, name: str) -> str | None:
    value = driver.execute_script(
        "const e = document.querySelector(arguments[0]); return e ? e.getAttribute(arguments[1]) : null;",
        css, name)
    return None if value is None else str(value)


@pytest.fixture
def web(home: Path, shadow: ShadowProc, tmp_path: Path) -> Iterator[WebProc]:
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    w = WebProc(home, logs)
    try:
        yield w
    finally:
        w.stop()


def test_a_running_job_shows_its_new_lines_live_and_then_its_exit(browser: Any, web: WebProc, shadow: ShadowProc,
                                                                 tmp_path: Path, spool_dir: Path) -> None:
    steps = tmp_path / "steps"
    job = step_job(shadow, steps, "browser-1", spool_dir)
    wait_until(lambda: (job_state(web, "browser-1") or {}).get("bytes", 0) > 0, 30, "the job's first bytes at home")
    browser.get(web.base + "/")
    row = 'tr[data-job="browser-1"]'
    wait_for(browser, lambda d: d.find_elements("css selector", row + '[data-state="streaming"]'),
             "the running job in the jobs list")
    assert "out/step.txt" in text_of(browser, row) and "streaming" in text_of(browser, row)
    browser.find_element("css selector", row + " a").click()
    wait_for(browser, lambda d: "first line, before any page" in text_of(d, 'pre[data-stream="stdout"]'),
             "the job's first line on its page")
    assert browser.current_url == web.base + "/jobs/browser-1"
    browser.execute_script("window.noReload = 'the same page'")
    for n in (1, 2):
        (steps / f"go-{n}").touch()  # the job writes this line only now, after the page opened
        wait_for(browser, lambda d, n=n: f"line {n}, written when the test said go" in text_of(
            d, 'pre[data-stream="stdout"]'), f"line {n}, written after the page opened")
    assert "a line on stderr" in text_of(browser, 'pre[data-stream="stderr"]')
    assert text_of(browser, "#ended") == ""  # still running: no exit status yet
    (steps / "exit").write_text("7")
    wait_for(browser, lambda d: "Ended with status 7" in text_of(d, "#exit"), "the exit status")
    assert job.wait(30) == 7
    assert attr_of(browser, "#pill .pill", "data-state") == "failed"
    wait_for(browser, lambda d: text_of(d, "#live") == "complete", "the stream marked complete")
    summary = text_of(browser, "#summary")
    assert "wall time" in summary and "stdout bytes" in summary
    assert browser.execute_script("return window.noReload") == "the same page", "the page was reloaded"
    stdout = text_of(browser, 'pre[data-stream="stdout"]')
    assert stdout.count("line 1, written") == 1 and stdout.count("line 2, written") == 1  # never a line twice
    href = browser.execute_script(
        "return document.querySelector(arguments[0]).href;", 'section[data-stream="stdout"] a.download')
    assert href == web.base + "/api/jobs/browser-1/files/stdout"
    browser.get(web.base + "/")
    wait_for(browser, lambda d: d.find_elements("css selector", row + '[data-state="failed"]'), "the failed state")
    assert text_of(browser, row + " td.exit") == "7"


def test_the_list_filters_and_sorts(browser: Any, web: WebProc, shadow: ShadowProc, spool_dir: Path) -> None:
    run_job(shadow, spool_dir, "alpha-ok", out=3000)
    run_job(shadow, spool_dir, "beta-bad", out=1000, status=2)
    run_job(shadow, spool_dir, "gamma-ok", out=2000)
    wait_until(lambda: all((job_state(web, j) or {}).get("state") == "finished"
                           for j in ("alpha-ok", "beta-bad", "gamma-ok")), 20, "the three jobs' ends")
    browser.get(web.base + "/")

    def shown(d: Any) -> list[str]:
        return list(d.execute_script(
            "return Array.from(document.querySelectorAll('#jobs tbody tr'), r => r.dataset.job);"))

    wait_for(browser, lambda d: len(shown(d)) == 3, "three jobs")
    browser.find_element("id", "filter").send_keys("bad")
    wait_for(browser, lambda d: shown(d) == ["beta-bad"], "only the job matching 'bad'")
    browser.find_element("id", "filter").clear()
    browser.find_element("css selector", '#counts button[data-state="done"]').click()
    wait_for(browser, lambda d: sorted(shown(d)) == ["alpha-ok", "gamma-ok"], "only the jobs that succeeded")
    browser.find_element("css selector", '#counts button[data-state=""]').click()
    browser.find_element("css selector", '#jobs th[data-key="bytes"]').click()
    wait_for(browser, lambda d: shown(d) == ["alpha-ok", "gamma-ok", "beta-bad"], "the largest job first")
    browser.find_element("css selector", '#jobs th[data-key="bytes"]').click()
    wait_for(browser, lambda d: shown(d) == ["beta-bad", "gamma-ok", "alpha-ok"], "the smallest job first")


def test_what_agents_send_is_shown_as_text_never_run(browser: Any, web: WebProc, shadow: ShadowProc,
                                                      spool_dir: Path) -> None:
    hostile = '<img src=x onerror="window.pwned=1">'
    job = Wrapper(["--shadow", shadow.address, "--stdout", "out/hostile.txt", "--job-id", hostile,
                   "--spool", str(spool_dir), "--", sys.executable, "-c",
                   "print('<script>window.pwned=2</script><b>bold?</b>')"])
    assert job.wait(60) == 0, job.err
    wait_until(lambda: (job_state(web, hostile) or {}).get("state") == "finished", 20, "the job's end")
    browser.get(web.base + "/")
    wait_for(browser, lambda d: hostile in text_of(d, "#jobs tbody"), "the job id as text")
    assert not browser.find_elements("css selector", "#jobs img")
    browser.find_element("css selector", "#jobs tbody a").click()
    wait_for(browser, lambda d: "<script>window.pwned=2</script>" in text_of(d, 'pre[data-stream="stdout"]'),
             "the output as text")
    assert text_of(browser, "#jobid") == hostile
    assert not browser.find_elements("css selector", "main img, main b, main script")
    assert browser.execute_script("return window.pwned === undefined")


def test_refused_files_and_unknown_jobs_say_why(browser: Any, web: WebProc, shadow: ShadowProc, home: Path,
                                               tmp_path: Path, spool_dir: Path) -> None:
    run_job(shadow, spool_dir, "linked", out=1000, err=100)
    wait_until(lambda: (job_state(web, "linked") or {}).get("state") == "finished", 20, "the job's end")
    secret = tmp_path / "secret.txt"
    secret.write_text("a secret outside the root\n")
    (home / "out/linked.txt").unlink()
    (home / "out/linked.txt").symlink_to(secret)
    browser.get(web.base + "/jobs/linked")
    wait_for(browser, lambda d: "symlink" in text_of(d, 'section[data-stream="stdout"] .note'),
             "why stdout is refused")
    assert "a secret" not in text_of(browser, "body")
    wait_for(browser, lambda d: text_of(d, 'pre[data-stream="stderr"]') != "", "stderr, which is fine")
    browser.get(web.base + "/jobs/no-such-job")
    assert "no job 'no-such-job' at this shadow" in text_of(browser, "#error")


@pytest.mark.root
def test_a_non_loopback_view_asks_for_the_token_first(browser: Any, home: Path, shadow: ShadowProc, tmp_path: Path,
                                                     spool_dir: Path) -> None:
    from faults import HOST_IP, NetNS, need_netns

    need_netns()
    run_job(shadow, spool_dir, "private-job", out=500)
    token = tmp_path / "web-token"
    token.write_text("the-web-token-0123456789abcdef\n")
    token.chmod(0o600)
    with NetNS():
        web = WebProc(home, tmp_path, ["--token-file", str(token)], host=HOST_IP)
        try:
            browser.get(web.base + "/jobs/private-job")
            wait_for(browser, lambda d: d.find_elements("id", "token"), "the login form")
            assert "private-job" not in text_of(browser, "body")
            browser.find_element("id", "token").send_keys("not-the-token")
            browser.find_element("css selector", "form.login button").click()
            wait_for(browser, lambda d: "not the token" in text_of(d, ".error"), "the refusal")
            browser.find_element("id", "token").send_keys("the-web-token-0123456789abcdef")
            browser.find_element("css selector", "form.login button").click()
            wait_for(browser, lambda d: "Ended with status 0" in text_of(d, "#exit"), "the job's page after login")
            assert browser.current_url == web.base + "/jobs/private-job"
            assert browser.execute_script("return document.cookie") == ""  # HttpOnly: scripts cannot read it
        finally:
            web.stop()
