"""The learning site works in a real browser, not only in `mkdocs build`.

The site is built strictly into a temporary folder, served from 127.0.0.1 by a thread, and
driven by headless Chromium through the Chrome DevTools Protocol (CDP). The checks are the
things a reader would notice first: the knowledge map on the home page, search, the mermaid
diagrams, the formulas, the light/dark toggle and the progress page's tick boxes.

No browser-automation package is needed: Chromium speaks CDP over two pipes when started with
`--remote-debugging-pipe` (it reads JSON commands from its file descriptor 3 and writes replies
and events to its descriptor 4, each message ended by a NUL byte), and `DevTools` below is
the few lines of client that takes. Install Chromium with `apt-get install -y chromium`, or
point `MINIVLLM_CHROMIUM` at a Chrome or Chromium binary. Without one the tests are skipped,
except under CI (`CI` set), where a missing browser is a failure.

Screenshots go to `$MINIVLLM_SCREENSHOT_DIR` when it is set, else to a pytest temporary folder.
"""

from __future__ import annotations

import base64
import fcntl
import functools
import http.server
import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
VIEWPORT = {"width": 1280, "height": 900}
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
    "--hide-scrollbars",
    "--mute-audio",
    f"--window-size={VIEWPORT['width']},{VIEWPORT['height']}",
    "--remote-debugging-pipe",
]


def find_chromium() -> str | None:
    for candidate in (os.environ.get("MINIVLLM_CHROMIUM"), shutil.which("chromium"), "/usr/bin/chromium"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


class DevTools:
    """A minimal CDP client over Chromium's debugging pipes, with one page (tab) attached.

    Calls are synchronous: `send` writes a command and reads messages until its reply comes;
    events read on the way are kept in `events` (uncaught page errors are checked from there).
    """

    def __init__(self, executable: str, profile_dir: Path, log_path: Path) -> None:
        commands_read, self._commands = os.pipe()
        self._replies, replies_write = os.pipe()
        # bash puts our pipe ends on Chromium's fds 3 and 4 (plain sh may refuse fds above 9).
        # Moving them to 10 and above first keeps the redirections from clobbering each other
        # when a pipe end happens to *be* 3 or 4.
        theirs = [_fd_at_or_above(fd, 10) for fd in (commands_read, replies_write)]
        script = f'exec "$0" "$@" 3<&{theirs[0]} 4>&{theirs[1]} {theirs[0]}<&- {theirs[1]}>&-'
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [shutil.which("bash") or "/bin/bash", "-c", script, executable, f"--user-data-dir={profile_dir}", *CHROMIUM_FLAGS, "about:blank"],
                pass_fds=theirs,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        for fd in theirs:
            os.close(fd)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        # Commands go to the browser itself until a page is attached; then to that page.
        self.session: str | None = None
        target = self.send("Target.createTarget", {"url": "about:blank"})
        self.session = self.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})["sessionId"]
        self.send("Page.enable")
        self.send("Runtime.enable")  # reports uncaught page errors as Runtime.exceptionThrown
        self.send("Emulation.setDeviceMetricsOverride", {**VIEWPORT, "deviceScaleFactor": 1, "mobile": False})
        # The site follows the system's colour scheme until the reader picks one: fix it.
        self.send("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "light"}]})

    # ---- protocol ------------------------------------------------------------------------
    def send(self, method: str, params: dict[str, Any] | None = None, *, timeout: float = 30.0) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if self.session is not None and not method.startswith(("Browser.", "Target.")):
            message["sessionId"] = self.session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._commands, data):]
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline, method)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"CDP {method} failed: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def _read_message(self, deadline: float, waiting_for: str) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no reply from Chromium to {waiting_for}")
            if select.select([self._replies], [], [], remaining)[0]:
                chunk = os.read(self._replies, 1 << 16)
                if not chunk:
                    log = self.log_path.read_text(errors="replace")[-3000:]
                    raise ConnectionError(f"Chromium closed its debugging pipe (exit {self.process.poll()}); its log ends:\n{log}")
                self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(message)

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except Exception:
            pass  # it may already be gone; the process is stopped below either way
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._commands)
        os.close(self._replies)

    # ---- page helpers --------------------------------------------------------------------
    def evaluate(self, expression: str, timeout: float = 30.0) -> Any:
        """The value of a JavaScript expression in the page (promises are awaited)."""
        result = self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            timeout=timeout,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"JavaScript failed: {result['exceptionDetails']}\n{expression}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout: float = 20.0, explain: str | None = None) -> Any:
        """Poll a JavaScript expression until it is truthy; fail with `what` if it never is.

        `explain`, an expression too, is shown on failure: what the page had instead.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                value, error = self.evaluate(expression), None
            except RuntimeError as exc:  # e.g. asked while the page is between two documents
                value, error = None, exc
            if value:
                return value
            if time.monotonic() > deadline:
                instead = f"; instead: {self.evaluate(explain)!r}" if explain else ""
                last_error = f"; last error: {error}" if error else ""
                pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}{instead}{last_error}")
            time.sleep(0.1)

    def goto(self, url: str) -> None:
        self.send("Page.navigate", {"url": url})
        self._wait_for_new_document(url)

    def reload(self) -> None:
        url = self.evaluate("location.href")
        self.evaluate("window.__stillTheOldPage = true")
        self.send("Page.reload")
        self._wait_for_new_document(url)

    def _wait_for_new_document(self, url: str) -> None:
        self.wait_for(
            f"location.href === {json.dumps(url)} && !window.__stillTheOldPage && document.readyState === 'complete'",
            f"{url} to load",
        )
        self.evaluate("window.__stillTheOldPage = true")  # so the next load is told apart

    def click(self, selector: str) -> None:
        """A real mouse click in the middle of the first element matching `selector`."""
        box = self.evaluate(
            f"""(() => {{
                const el = document.querySelector({json.dumps(selector)});
                if (!el) return null;
                el.scrollIntoView({{block: "center"}});
                const r = el.getBoundingClientRect();
                return {{x: r.x + r.width / 2, y: r.y + r.height / 2, w: r.width, h: r.height}};
            }})()"""
        )
        assert box and box["w"] > 0 and box["h"] > 0, f"nothing visible to click at {selector!r}"
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", {"type": kind, "x": box["x"], "y": box["y"], "button": "left", "clickCount": 1})

    def type_text(self, text: str) -> None:
        """Key presses into the focused element, one character at a time (keydown, input, keyup)."""
        for char in text:
            self.send("Input.dispatchKeyEvent", {"type": "keyDown", "text": char, "key": char})
            self.send("Input.dispatchKeyEvent", {"type": "keyUp", "key": char})

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot", {"format": "png"})["data"]))

    def page_errors(self) -> list[str]:
        """Uncaught JavaScript exceptions seen so far, as text; clears the record."""
        errors = [
            event["params"]["exceptionDetails"].get("exception", {}).get("description")
            or event["params"]["exceptionDetails"].get("text", "")
            for event in self.events
            if event.get("method") == "Runtime.exceptionThrown"
        ]
        self.events.clear()
        return errors


def _fd_at_or_above(fd: int, lowest: int) -> int:
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)
    os.close(fd)
    return moved


# ---- fixtures ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chromium() -> str:
    executable = find_chromium()
    if executable is None:
        message = "no Chromium found (apt-get install -y chromium, or set MINIVLLM_CHROMIUM)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}: CI must run the browser tests")
        pytest.skip(message)
    return executable


@pytest.fixture(scope="module")
def site_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Build the site strictly and serve it on 127.0.0.1 at a free port."""
    site = tmp_path_factory.mktemp("browser-site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO_ROOT,  # snippet paths are relative to the repository root
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"`mkdocs build --strict` failed:\n{result.stderr}\n{result.stdout}"

    class QuietHandler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, name="site-server", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def browser(chromium: str, site_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevTools]:
    workdir = tmp_path_factory.mktemp("chromium")
    devtools = DevTools(chromium, profile_dir=workdir / "profile", log_path=workdir / "chromium.log")
    yield devtools
    devtools.close()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = os.environ.get("MINIVLLM_SCREENSHOT_DIR")
    path = Path(folder) if folder else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def color_scheme(browser: DevTools) -> str:
    return browser.evaluate("document.body.getAttribute('data-md-color-scheme')")


# ---- the checks --------------------------------------------------------------------------
def test_home_page_shows_the_knowledge_map(browser: DevTools, site_url: str, screenshots: Path) -> None:
    browser.goto(site_url)
    row = browser.evaluate(
        """(() => {
            const cell = [...document.querySelectorAll("td")].find(td => td.textContent.trim() === "Continuous batching");
            if (!cell) return null;
            const style = getComputedStyle(cell);
            return {
                visible: cell.getClientRects().length > 0 && style.visibility === "visible" && style.display !== "none",
                row: cell.parentElement.textContent,
            };
        })()"""
    )
    assert row is not None, "the home page should have a knowledge-map row for 'Continuous batching'"
    assert row["visible"], "the 'Continuous batching' row of the knowledge map is in the page but not shown"
    assert "连续批处理" in row["row"], f"the row should give the Chinese name too, got {row['row']!r}"
    assert color_scheme(browser) == "default", "with a light system theme the site should start light"
    browser.screenshot(screenshots / "home-light.png")
    assert browser.page_errors() == [], "the home page raised JavaScript errors"


def test_search_finds_paged_attention(browser: DevTools, site_url: str, screenshots: Path) -> None:
    browser.goto(site_url)
    browser.click("input.md-search__input")
    browser.wait_for("document.activeElement && document.activeElement.matches('input.md-search__input')", "the search box to take focus")
    # The index loads in a web worker; Material shows this placeholder once it is ready.
    browser.wait_for(
        "document.querySelector('.md-search-result__meta').textContent.trim() === 'Type to start searching'",
        "the search index to load",
    )
    browser.type_text("PagedAttention")
    # Results are redrawn after every key; wait for those of the whole word to settle in.
    results_js = """[...document.querySelectorAll(".md-search-result__item")].map(item => ({
        href: item.querySelector("a").getAttribute("href"), title: item.querySelector("h1, h2").textContent,
    }))"""
    results = browser.wait_for(
        f"""(() => {{
            if (document.querySelector("input.md-search__input").value !== "PagedAttention") return null;
            const results = {results_js};
            return results.some(r => r.href.includes("knowledge-index/")) ? results : null;
        }})()""",
        "search results for 'PagedAttention' that include the knowledge index, which defines it",
        explain=results_js,
    )
    meta = browser.evaluate("document.querySelector('.md-search-result__meta').textContent")
    time.sleep(0.3)  # the result list slides open
    browser.screenshot(screenshots / "search-results.png")
    assert meta.endswith("matching documents"), f"the search meta line should count the matches, got {meta!r}"
    assert len(results) >= 3, f"PagedAttention appears on several pages, but search found only {results}"
    assert browser.page_errors() == [], "searching raised JavaScript errors"


def test_chapter_01_mermaid_diagrams_render_as_svg(browser: DevTools, site_url: str, screenshots: Path) -> None:
    browser.goto(site_url + "chapters/01-architecture/")
    browser.wait_for(
        "!document.querySelector('pre.mermaid') && document.querySelectorAll('div.mermaid').length >= 2",
        "Material to hand chapter 01's two mermaid diagrams to mermaid",
    )
    # Material draws each diagram inside a *closed* shadow root, out of reach of page scripts;
    # DevTools can still see it when asked to pierce shadow roots.
    def diagrams() -> list[str]:
        root = browser.send("DOM.getDocument", {"depth": -1, "pierce": True})["root"]
        return [text for host in _find(root, _is_mermaid_host) for text in _svg_texts(host)]

    deadline = time.monotonic() + 20
    while len(rendered := diagrams()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(rendered) >= 2, f"chapter 01 has two mermaid diagrams, but {len(rendered)} rendered to SVG"
    assert "Scheduler.schedule" in rendered[0], "the request-flow diagram should show its nodes' text"
    assert "EngineCoreOutputs over ZMQ" in rendered[1], "the vLLM diagram should show its edge labels"
    browser.evaluate("document.querySelector('div.mermaid').scrollIntoView({block: 'start'})")
    time.sleep(0.3)
    browser.screenshot(screenshots / "chapter-01-diagram.png")
    assert browser.page_errors() == [], "chapter 01 raised JavaScript errors"


def test_mathjax_renders_the_kv_cache_formula(browser: DevTools, site_url: str, screenshots: Path) -> None:
    browser.goto(site_url + "knowledge-index/")
    browser.wait_for("window.MathJax && MathJax.startup && MathJax.startup.promise.then(() => true)", "MathJax to finish typesetting")
    math = browser.evaluate(
        """({
            spans: document.querySelectorAll(".arithmatex").length,
            rendered: document.querySelectorAll(".arithmatex mjx-container svg").length,
            display: document.querySelectorAll(".arithmatex mjx-container[display='true'] svg").length,
            errors: [...document.querySelectorAll("[data-mml-node='merror']")].map(e => e.textContent),
            // MathJax keeps the TeX source of everything it typeset.
            kvFormula: [...MathJax.startup.document.math].some(m => m.display && m.math.includes("H_{kv}")),
        })"""
    )
    assert math["spans"] > 0, "the knowledge index should contain formulas"
    assert math["rendered"] == math["spans"], f"MathJax rendered {math['rendered']} of {math['spans']} formulas as SVG"
    assert math["display"] >= 1, "the KV-cache formula is a display formula and should render as one"
    assert math["errors"] == [], f"MathJax could not parse: {math['errors']}"
    assert math["kvFormula"], "the KV-cache-per-token formula (with H_{kv}) should be typeset as a display formula"
    browser.evaluate("document.getElementById('formulas').scrollIntoView({block: 'start'})")
    time.sleep(0.3)
    browser.screenshot(screenshots / "knowledge-index-formulas.png")
    assert browser.page_errors() == [], "the knowledge index raised JavaScript errors"


def test_palette_toggle_switches_to_dark_and_back(browser: DevTools, site_url: str, screenshots: Path) -> None:
    browser.goto(site_url)
    assert color_scheme(browser) == "default"
    toggle = "form[data-md-component='palette'] label:not([hidden])"
    browser.click(toggle)
    browser.wait_for("document.body.getAttribute('data-md-color-scheme') === 'slate'", "the dark (slate) scheme after one click")
    time.sleep(0.3)  # let the colour transition finish before the picture
    browser.screenshot(screenshots / "home-dark.png")
    browser.click(toggle)
    browser.wait_for("document.body.getAttribute('data-md-color-scheme') === 'default'", "the light scheme after a second click")
    assert browser.page_errors() == [], "toggling the palette raised JavaScript errors"


def test_progress_tick_survives_a_reload(browser: DevTools, site_url: str, screenshots: Path) -> None:
    browser.goto(site_url + "progress/")
    browser.evaluate("localStorage.removeItem('minivllm.progress')")
    browser.reload()
    count = ".mv-progress__count"
    browser.wait_for(f"document.querySelectorAll('.mv-progress input[type=checkbox]').length === 11", "eleven tick boxes")
    assert browser.evaluate(f"document.querySelector('{count}').textContent") == "0 of 11 chapters done"

    browser.click(".mv-progress li[data-chapter='03'] input[type=checkbox]")
    browser.wait_for(f"document.querySelector('{count}').textContent === '1 of 11 chapters done'", "the count to show one chapter done")
    assert json.loads(browser.evaluate("localStorage.getItem('minivllm.progress')")) == ["03"]

    browser.reload()
    browser.wait_for("!!document.querySelector('.mv-progress__count')", "the progress tracker after the reload")
    state = browser.evaluate(
        """({
            ticked: [...document.querySelectorAll(".mv-progress input:checked")].map(box => box.value),
            count: document.querySelector(".mv-progress__count").textContent,
            fill: document.querySelector(".mv-progress__fill").style.width,
        })"""
    )
    assert state["ticked"] == ["03"], f"the tick on chapter 03 should survive a reload, got {state['ticked']}"
    assert state["count"] == "1 of 11 chapters done"
    assert state["fill"].startswith("9.09"), f"one of eleven is about 9% of the bar, got {state['fill']}"
    browser.screenshot(screenshots / "progress.png")
    assert browser.page_errors() == [], "the progress page raised JavaScript errors"


# ---- DOM-tree helpers for the closed shadow roots ----------------------------------------
def _find(node: dict[str, Any], matches: Any) -> Iterator[dict[str, Any]]:
    if matches(node):
        yield node
    for child in node.get("children", []) + node.get("shadowRoots", []):
        yield from _find(child, matches)


def _is_mermaid_host(node: dict[str, Any]) -> bool:
    attributes = node.get("attributes", [])
    classes = dict(zip(attributes[::2], attributes[1::2])).get("class", "").split()
    return node.get("nodeName") == "DIV" and "mermaid" in classes and bool(node.get("shadowRoots"))


def _svg_texts(host: dict[str, Any]) -> list[str]:
    """The text of each <svg> in a host's shadow root (empty when nothing was drawn)."""
    texts = []
    for svg in _find({"children": host["shadowRoots"]}, lambda n: n.get("nodeName", "").lower() == "svg"):
        words = [n["nodeValue"].strip() for n in _find(svg, lambda n: n.get("nodeType") == 3)]
        texts.append(" ".join(w for w in words if w))
    return texts
