"""`gcshadow web` in a real headless Chromium: what a person sees.

A real gcshadow, real gcwrap jobs and a real `gcshadow web` on loopback (and
on a veth address of a test namespace for the login), driven by selenium
through the operating system's chromium and chromium-driver packages. Every
wait is bounded (WebDriverWait). Skipped, with the reason, where the browser
or selenium is missing.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import ShadowProc, Wrapper, wait_until
from test_web import (
    REFUSALS,
    InProcessWeb,
    WebClient,
    WebProc,
    _timeline,
    job_state,
    line_job,
    record_timeline,
    run_job,
    step_job,
)

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
    assert shown(browser) == ["gamma-ok", "beta-bad", "alpha-ok"]  # the newest first
    assert text_of(browser, 'tr[data-job="alpha-ok"] td.duration').endswith(" s")
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


# -- a log viewer: line numbers, links to lines, search --------------------------------------


def test_a_job_page_numbers_its_lines_links_to_one_and_finds_text(browser: Any, web: WebProc, shadow: ShadowProc,
                                                                  spool_dir: Path) -> None:
    line_job(shadow, spool_dir, "lines-2", 20_000)  # 260 kB: the page shows the last 64 KiB
    wait_until(lambda: (job_state(web, "lines-2") or {}).get("state") == "finished", 30, "the job's end")
    browser.get(web.base + "/jobs/lines-2")
    wait_for(browser, lambda d: text_of(d, "#live") == "complete", "the whole tail")
    first, last = browser.execute_script(
        "const l = document.querySelectorAll('pre[data-stream=stdout] .line');"
        " return [l[0].id + ' ' + l[0].textContent, l[l.length - 1].id + ' ' + l[l.length - 1].textContent];")
    n = int(first.split()[0][1:])
    assert 20_000 - 64 * 1024 // 13 - 1 <= n < 20_000 and first == f"L{n} line {n:07d}\n"  # numbered as in the file
    assert last == "L20000 line 0020000\n"
    assert "line 0020000" in text_of(browser, 'pre[data-stream="stdout"]')
    assert "L20000" not in text_of(browser, 'pre[data-stream="stdout"]')  # numbers are not part of the text
    # A link to a line the tail does not hold: the page opens there, that line marked and in view.
    browser.get(web.base + "/jobs/lines-2#L120")
    wait_for(browser, lambda d: d.find_elements("css selector", "#L120.target"), "line 120, marked")
    assert text_of(browser, "#L120") == "line 0000120"
    assert browser.execute_script(
        "const l = document.getElementById('L120').getBoundingClientRect();"
        " const p = document.querySelector('pre[data-stream=stdout]').getBoundingClientRect();"
        " return l.top >= p.top && l.bottom <= p.bottom && l.top >= 0 && l.bottom <= innerHeight;")
    assert not browser.find_element("id", "follow").is_selected()
    # Its number is a link to it.
    href = browser.execute_script("return document.querySelector('#L121 a.ln').href")
    assert href == web.base + "/jobs/lines-2#L121"
    browser.execute_script("document.querySelector('#L125 a.ln').click()")
    wait_for(browser, lambda d: d.find_elements("css selector", "#L125.target"), "line 125 marked after its click")
    assert browser.current_url.endswith("#L125") and not browser.find_elements("css selector", "#L120.target")
    # Find: every matching line, Enter for the next, and only those lines if asked.
    wait_for(browser, lambda d: d.find_elements("css selector", "#L20000"), "the tail after the linked lines")
    find = browser.find_element("id", "find")
    find.send_keys("line 001999")  # lines 19990-19999 only
    wait_for(browser, lambda d: text_of(d, "#found") == "10 lines", "ten matching lines")
    find.send_keys("\n")
    wait_for(browser, lambda d: text_of(d, "#found") == "1 of 10 lines", "the first match")
    assert browser.execute_script("return document.querySelector('.line.current').id") == "L19990"
    find.send_keys("\n")
    wait_for(browser, lambda d: browser.execute_script(
        "return (document.querySelector('.line.current') || {}).id") == "L19991", "the next match")
    browser.find_element("id", "only").click()
    visible = browser.execute_script(
        "return Array.from(document.querySelectorAll('pre[data-stream=stdout] .line'))"
        ".filter(l => l.getClientRects().length).map(l => l.id);")
    assert visible == [f"L{k}" for k in range(19990, 20000)]
    find.clear()
    find.send_keys("no such text")
    wait_for(browser, lambda d: text_of(d, "#found") == "no match", "no match")


# -- the timeline, the "why" and the refused connections -----------------------------------------


def test_the_timeline_why_and_refusals_are_shown(browser: Any, home: Path, shadow: ShadowProc, spool_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    run_job(shadow, spool_dir, "timed-2", out=2000)
    t0 = time.time() - 600
    record_timeline(monkeypatch, {"timed-2": _timeline(t0)},
                    {"timed-2": "disconnected since 14:02:03 (connection reset)"}, REFUSALS)
    web = InProcessWeb(home)
    try:
        wait_until(lambda: (job_state(web, "timed-2") or {}).get("why"), 20, "the why")
        browser.get(web.base + "/")
        row = 'tr[data-job="timed-2"]'
        wait_for(browser, lambda d: "disconnected since 14:02:03" in text_of(d, row + " .why-line"),
                 "the why in the list")
        wait_for(browser, lambda d: text_of(d, "#refusals-count") == "(2)", "two refused connections")
        refused = text_of(browser, "#refusals")
        assert "wrong-token-job" in refused and "AUTH_FAILED" in refused
        assert "authentication failed: wrong token" in refused
        assert "cn=alice" in refused and "10.9.8.6:5001" in refused
        assert "2 refused connections" in text_of(browser, "#counts")
        browser.get(web.base + "/jobs/timed-2")
        wait_for(browser, lambda d: text_of(d, "#why") == "disconnected since 14:02:03 (connection reset)", "the why")
        summary = text_of(browser, "#timeline summary")
        assert "3 events" in summary and "connection lost" in summary
        browser.find_element("css selector", "#timeline summary").click()
        kinds = browser.execute_script(
            "return Array.from(document.querySelectorAll('#events li'), e => e.dataset.kind)")
        assert kinds == ["session_opened", "stalled", "connection_lost"]  # oldest first
        lost = text_of(browser, '#events li[data-kind="connection_lost"]')
        assert "connection reset" in lost and "agent" in lost and "home:50000" in lost
        assert time.strftime("%H:%M:%S", time.localtime(t0 + 9)) in lost
        assert time.strftime("%H:%M:%S", time.localtime(t0 + 6)) in lost  # worked_at: a time
    finally:
        web.stop()


# -- narrow windows ------------------------------------------------------------------------------

WIDTHS = (320, 360, 1280)  # the narrowest phone in use, a phone, a desktop


def _shot(driver: Any, path: Path, part: int = 1500) -> None:
    """The whole page, beyond the window's height too (Chromium's DevTools protocol): in parts
    of `part` px (NAME-2.png, ...) when it is taller, to be looked at."""
    import base64

    width, height = driver.execute_script(
        "const d = document.documentElement; return [Math.max(d.scrollWidth, innerWidth), d.scrollHeight];")
    for k, top in enumerate(range(0, height, part)):
        png = driver.execute_cdp_cmd("Page.captureScreenshot", {
            "format": "png", "captureBeyondViewport": True,
            "clip": {"x": 0, "y": top, "width": width, "height": min(part, height - top), "scale": 1}})
        name = path if k == 0 else path.with_name(f"{path.stem}-{k + 1}{path.suffix}")
        name.write_bytes(base64.b64decode(png["data"]))


def _fits(driver: Any) -> tuple[int, int]:
    wide, view = driver.execute_script(
        "return [document.documentElement.scrollWidth, document.documentElement.clientWidth];")
    return int(wide), int(view)


LONG_ID = "slurm-98765432.batch-array-task-0042-of-a-long-sweep"


@pytest.fixture
def sweep(home: Path, shadow: ShadowProc, spool_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[WebClient]:
    """A web view of two finished jobs, one with a long id, long file names, long lines, a timeline and a "why";
    and two refused connections."""
    job = Wrapper(["--shadow", shadow.address, "--stdout", "results/a-long-directory-of-the-sweep/task-0042.log",
                   "--stderr", "results/a-long-directory-of-the-sweep/task-0042.err", "--job-id", LONG_ID,
                   "--spool", str(spool_dir), "--", sys.executable, "-c",
                   ("import sys\nfor i in range(300): print(f'step {i:5d}  loss 0.{i:04d}  ' + 'x' * 150)\n"
                    "print('Traceback: a very long line ' + 'y' * 400, file=sys.stderr)\nsys.exit(3)")])
    assert job.wait(60) == 3, job.err
    run_job(shadow, spool_dir, "small-1", out=100)
    record_timeline(monkeypatch, {LONG_ID: _timeline(time.time() - 300)}, {LONG_ID: "finished with status 3"},
                    REFUSALS)
    web = InProcessWeb(home)
    try:
        wait_until(lambda: (job_state(web, LONG_ID) or {}).get("state") == "finished", 20, "the job at home")
        yield web
    finally:
        web.stop()


def _shots(tmp_path: Path) -> Path:
    """Where the screenshots go: GCWRAP_WEB_SHOTS, to look at them."""
    shots = Path(os.environ.get("GCWRAP_WEB_SHOTS") or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    return shots


def test_the_jobs_page_fits_wide_and_narrow_windows(browser: Any, sweep: WebClient, tmp_path: Path) -> None:
    for width in WIDTHS:
        browser.set_window_size(width, 900)
        browser.get(sweep.base + "/")
        wait_for(browser, lambda d: len(d.find_elements("css selector", "#jobs tbody tr")) == 2, "the jobs")
        assert browser.execute_script("return innerWidth") == width
        wide, view = _fits(browser)
        assert wide <= view, f"the jobs page is {wide} px wide in a {view} px window"
        wait_for(browser, lambda d: text_of(d, "#refusals-count") == "(2)", "the refused connections")
        _shot(browser, _shots(tmp_path) / f"jobs-{width}.png")
        wide, view = _fits(browser)
        assert wide <= view, f"the jobs page with its refusals is {wide} px wide in a {view} px window"
        cells = browser.execute_script(
            "const r = document.querySelector('#jobs tbody tr');"
            " return Array.from(r.cells, c => c.getBoundingClientRect().top);")
        assert (len(set(cells)) > 1) == (width < 700), f"rows stack only when narrow ({width} px)"
        link = browser.execute_script("return document.querySelector(arguments[0]).getBoundingClientRect().width",
                                      f'tr[data-job="{LONG_ID}"] td.job a')
        assert link >= min(150, width - 60), f"the job id squeezed to {link} px"


def test_a_job_page_fits_wide_and_narrow_windows(browser: Any, sweep: WebClient, tmp_path: Path) -> None:
    for width in WIDTHS:
        browser.set_window_size(width, 900)
        browser.get(sweep.base + "/jobs/" + LONG_ID)
        wait_for(browser, lambda d: text_of(d, "#live") == "complete", "the job page")
        assert browser.execute_script("return innerWidth") == width
        wide, view = _fits(browser)
        assert wide <= view, f"the job page is {wide} px wide in a {view} px window"
        header = browser.execute_script("return document.getElementById('jobid').getBoundingClientRect().width")
        assert header >= min(250, width - 60), f"the job id in the header squeezed to {header} px"
        browser.execute_script("document.getElementById('timeline').open = true")
        wait_for(browser, lambda d: "connection lost" in text_of(d, "#events"), "the timeline")
        _shot(browser, _shots(tmp_path) / f"job-{width}.png")
        wide, view = _fits(browser)
        assert wide <= view, f"the job page with its timeline is {wide} px wide in a {view} px window"


def test_a_job_page_shows_the_files_it_writes(browser: Any, web: WebProc, shadow: ShadowProc, spool_dir: Path,
                                              tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)  # (gcwrap's --file PATHs are relative to its working directory)
    code = ("import os, time\n"
            "open('result.csv', 'w').write('a,b\\n' * 1000)\n"
            "open('tmp.txt', 'w').write('temporary')\n"
            "time.sleep(1.5)\n"
            "os.unlink('tmp.txt')\n"
            "while not os.path.exists('go'):\n"
            "    time.sleep(0.02)\n")
    w = Wrapper(["--shadow", shadow.address, "--stdout", "out/b-files.txt", "--job-id", "b-files", "--spool",
                 str(spool_dir), "--file", "result.csv=out/result.csv", "--file", "tmp.txt", "--", sys.executable,
                 "-c", code])
    wait_until(lambda: any(f["state"] == "committed" for f in (job_state(web, "b-files") or {}).get("files", [])),
               30, "the file committed at home")
    browser.get(web.base + "/jobs/b-files")
    row = 'tr[data-file="out/result.csv"]'
    wait_for(browser, lambda d: "3.91 KiB" in text_of(d, row), "the file's size in its row")
    assert text_of(browser, row).split() == ["out/result.csv", "3.91", "KiB", "1", "committed"]
    assert text_of(browser, "#files h2") == "Files"
    wait_for(browser, lambda d: "file_gone" in (d.execute_script(
        "return Array.from(document.querySelectorAll('#events li'), e => e.dataset.kind)") or []),
        "the deleted file in the timeline")
    browser.find_element("css selector", "#timeline summary").click()
    gone = text_of(browser, '#events li[data-kind="file_gone"]')
    assert "file deleted by the job: home keeps what it had" in gone and "tmp.txt" in gone, gone
    (work / "go").touch()
    assert w.wait(60) == 0, w.err
