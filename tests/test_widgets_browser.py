"""Real-browser test of the widgets: JupyterLab on localhost, driven by Debian's Chromium through Python playwright.

Starts JupyterLab (random free port, random token, temporary root folder holding a small notebook that
shows `veloxquant.widgets.tradeoff_explorer` and `codebook_explorer`), opens the notebook in headless
Chromium, runs all cells, drags the trade-off explorer's "max bits" slider, changes its quality dropdown,
steps the codebook explorer's bits slider with the keyboard, and checks that the chart (an SVG drawn in
the kernel by vl-convert) changed each time as expected, that no output is an error and that the kernel is alive.
Every request that does not go to the loopback interface is blocked (the charts must not need a CDN).

Nothing is installed here: Chromium (`/usr/bin/chromium`, Debian package `chromium`), `jupyterlab`,
`ipywidgets` and `playwright` (the `dev` extra) are required, and their absence is a failure, not a skip.
Set `VQ_SCREENSHOT_DIR` to keep screenshots of the widgets after their sliders moved."""
import json, os, re, shutil, signal, socket, subprocess, sys, time, urllib.request, uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    "A JupyterLab server on 127.0.0.1 serving a temporary folder with the demo notebook; yields (base url, token, root)."
    for mod in ("jupyterlab", "ipykernel", "ipywidgets", "playwright"):
        try: __import__(mod)
        except ImportError as e: pytest.fail(f"{mod} is not installed ({e}); install the dev extra: pip install -e '.[dev]'")
    if not os.access(CHROMIUM, os.X_OK): pytest.fail(f"{CHROMIUM} is missing; install Debian's chromium (apt-get install chromium)")
    import nbformat
    root = tmp_path_factory.mktemp("lab")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Trade-off explorer (browser test)"),
                nbformat.v4.new_code_cell("from veloxquant.widgets import tradeoff_explorer\n"
                                          f"explorer = tradeoff_explorer({str(REPO / 'nbs' / 'leaderboard_results.json')!r})\n"
                                          "explorer"),
                nbformat.v4.new_code_cell("from veloxquant.widgets import codebook_explorer\n"
                                          "codebook_explorer('sphere', bits=3, dim=128, n=512)")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, root / "demo.ipynb")
    (root / ".config" / "labconfig").mkdir(parents=True)   # no "Jupyter news?" prompt over the page
    (root / ".config" / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    port, token = _free_port(), uuid.uuid4().hex
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               JUPYTER_CONFIG_DIR=str(root / ".config"), JUPYTER_RUNTIME_DIR=str(root / ".runtime"),
               JUPYTERLAB_WORKSPACES_DIR=str(root / ".workspaces"), JUPYTER_PLATFORM_DIRS="1")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"] + (["--allow-root"] if os.geteuid() == 0 else [])
    log = open(root / "jupyterlab.log", "w")
    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            if proc.poll() is not None: break
            try: _get(f"{base}/api/status?token={token}"); break
            except OSError: time.sleep(0.5)
        else: pytest.fail("JupyterLab did not answer within 120 s")
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{(root / 'jupyterlab.log').read_text()[-3000:]}")
        yield base, token, root
    finally:
        try: os.killpg(proc.pid, signal.SIGTERM)      # the server and the kernels it started (own session)
        except ProcessLookupError: pass
        try: proc.wait(20)
        except subprocess.TimeoutExpired: os.killpg(proc.pid, signal.SIGKILL); proc.wait(10)
        log.close()


def _chart(cell):
    "outerHTML of the first chart of a cell's widget (an SVG in an ipywidgets HTML pane) and its number of symbols."
    svg = cell.locator(".jp-OutputArea-output .widget-html-content > svg").first
    return svg.evaluate("e => e.outerHTML"), svg.locator(".mark-symbol path").count()


def _wait_changed(page, cell, before: str, timeout_s: float = 60.0) -> str:
    t = time.time()
    while time.time() - t < timeout_s:
        now = _chart(cell)[0]
        if now != before: return now
        page.wait_for_timeout(250)
    raise AssertionError(f"the chart did not change within {timeout_s:.0f} s")


def test_widgets_in_jupyterlab(lab, tmp_path):
    "Run the demo notebook in JupyterLab, move sliders and change a dropdown; the charts must follow, offline."
    from playwright.sync_api import sync_playwright
    base, token, root = lab
    blocked, errors = [], []
    def route(r):
        host = urlparse(r.request.url).hostname or ""
        if host in LOOPBACK: r.continue_()
        else: blocked.append(r.request.url); r.abort()
    # LD_PRELOAD (CI preloads OpenBLAS for MLX) breaks playwright's node driver and Chromium: start them without it
    preload = os.environ.pop("LD_PRELOAD", None)
    try: p = sync_playwright().start()
    finally:
        if preload is not None: os.environ["LD_PRELOAD"] = preload
    try:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            page.route("**/*", route)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{base}/lab/tree/demo.ipynb?token={token}", wait_until="domcontentloaded", timeout=90_000)
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell.currentWidget "
                                   "&& window.jupyterapp.shell.currentWidget.sessionContext", timeout=90_000)
            page.evaluate("""async () => {
                const nb = window.jupyterapp.shell.currentWidget;
                await nb.context.ready; await nb.sessionContext.ready;
                await window.jupyterapp.commands.execute('notebook:run-all-cells');
            }""")
            trade, books = page.locator(".jp-CodeCell").nth(0), page.locator(".jp-CodeCell").nth(1)
            for cell in (trade, books):
                cell.locator(".jp-OutputArea-output .widget-html-content > svg").first.wait_for(timeout=90_000)

            # trade-off explorer: drag the "max bits" slider handle to ~10 % of its track
            svg0, n0 = _chart(trade)
            info = trade.locator(".jp-OutputArea-output .widget-html-content").nth(0)
            shown0, total = map(int, re.match(r"(\d+) of (\d+) configurations shown", info.inner_text()).groups())
            assert shown0 == total >= 10 and n0 > total, (info.inner_text(), n0)  # dots + frontier rings + legend
            slider = trade.locator(".widget-slider").filter(has_text="max bits").first
            track = slider.locator(".noUi-target").bounding_box()
            handle = slider.locator(".noUi-handle").bounding_box()
            page.mouse.move(handle["x"] + handle["width"] / 2, handle["y"] + handle["height"] / 2)
            page.mouse.down()
            page.mouse.move(track["x"] + 0.1 * track["width"], track["y"] + track["height"] / 2, steps=12)
            page.mouse.up()
            _wait_changed(page, trade, svg0)
            page.wait_for_timeout(500)
            svg1, n1 = _chart(trade)
            shown1 = int(re.match(r"(\d+) of \d+ configurations shown", info.inner_text()).group(1))
            assert 0 < shown1 < shown0 and n1 < n0, (info.inner_text(), n0, n1)
            shot = tmp_path / "tradeoff_after_slider.png"
            trade.locator(".jp-OutputArea-output .widget-vbox").first.screenshot(path=str(shot))
            if os.environ.get("VQ_SCREENSHOT_DIR"):
                Path(os.environ["VQ_SCREENSHOT_DIR"]).mkdir(parents=True, exist_ok=True)
                shutil.copy(shot, Path(os.environ["VQ_SCREENSHOT_DIR"]) / shot.name)

            # trade-off explorer: change the quality dropdown; the y axis follows
            trade.locator(".widget-dropdown select").first.select_option(label="NIAH miss rate")
            svg2 = _wait_changed(page, trade, svg1)
            assert "NIAH miss rate" in svg2 and "NIAH miss rate" not in svg1

            # codebook explorer: one step right on the bits slider with the keyboard (3 -> 4 bits: 8 -> 16 centroids)
            c0, _ = _chart(books)
            assert "8 centroids (3 bits)" in c0
            books.locator(".widget-slider").filter(has_text="bits").first.locator(".noUi-handle").press("ArrowRight")
            c1 = _wait_changed(page, books, c0)
            assert "16 centroids (4 bits)" in c1
            if os.environ.get("VQ_SCREENSHOT_DIR"):
                books.locator(".jp-OutputArea-output .widget-vbox").first.screenshot(
                    path=str(Path(os.environ["VQ_SCREENSHOT_DIR"]) / "codebook_after_slider.png"))
            page.wait_for_function("e => e.innerText.includes('4 bits')",
                                   arg=books.locator(".widget-html-content").first.element_handle(), timeout=30_000)

            # no error output, kernel alive and idle
            assert page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').count() == 0
            status = page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status")
            assert status in ("idle", "busy"), status
        finally:
            browser.close()
    finally:
        p.stop()
    sessions = _get(f"{base}/api/sessions?token={token}")
    assert sessions and all(s["kernel"]["execution_state"] != "dead" for s in sessions), sessions
    assert not errors, errors
    assert not blocked, f"non-loopback requests were attempted (and blocked): {blocked}"
