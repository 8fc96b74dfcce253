"""The docs site, checked in a real browser: built offline from the notebooks (`python docs/build.py`), served on
localhost and opened page by page in Debian's headless Chromium (/usr/bin/chromium) driven by playwright, with every
non-loopback request blocked and recorded.

Every page must load with HTTP 200, log no console error or page error, make no external request, link only to pages
and anchors that exist, and draw every chart (images, output SVGs, canvases) and formula with a non-zero size; the
offline search must find a method page.

The site is the one `.ci/run` built when `VELOXQUANT_DOCS_SITE` names it, else it is built here. Missing Chromium,
playwright or docs dependencies FAIL these tests (they never skip): `.ci/run` installs them.
"""
import functools
import html.parser
import http.server
import importlib.util
import os
import re
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


def _docs_build():
    spec = importlib.util.spec_from_file_location("docs_build", ROOT / "docs" / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    given = os.environ.get("VELOXQUANT_DOCS_SITE")
    if given:
        out = Path(given)
        assert (out / "index.html").is_file(), f"VELOXQUANT_DOCS_SITE={given!r} holds no built site (index.html)"
        return out
    out = tmp_path_factory.mktemp("docs") / "site"
    r = subprocess.run([sys.executable, str(ROOT / "docs" / "build.py"), "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, f"docs build failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return out


def _pages(site: Path) -> list[Path]:
    return sorted(site.rglob("*.html"))


# ------------------------------------------------------------------ the notebook processing (no Sphinx)
def _nb(*cells):
    def cell(c):
        if isinstance(c, str): return {"cell_type": "markdown", "metadata": {}, "source": c}
        src, outs = c
        return {"cell_type": "code", "metadata": {}, "source": src, "outputs": outs, "execution_count": None}
    return {"cells": [cell(c) for c in cells], "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
            "language": "python"}}, "nbformat": 4, "nbformat_minor": 4}


def test_staging_picks_up_any_notebook_and_processes_it(tmp_path):
    "A notebook added to the folder (here a subfolder too) is staged with nbdev's processing and listed in the navigation."
    import json
    nbs = tmp_path / "nbs"
    (nbs / "guides").mkdir(parents=True)
    spec = {"$schema": "https://vega.github.io/schema/vega-lite/v5.json", "mark": "bar",
            "data": {"values": [{"a": "x", "b": 3}, {"a": "y", "b": 5}]},
            "encoding": {"x": {"field": "a", "type": "nominal"}, "y": {"field": "b", "type": "quantitative"}}}
    stream = [{"output_type": "stream", "name": "stdout", "text": "hello\n"}]
    chart = [{"output_type": "display_data", "metadata": {}, "data": {
        "application/vnd.vegalite.v5+json": spec, "text/plain": "alt.Chart(...)",
        "text/html": '<script src="https://cdn.jsdelivr.net/npm/vega@5"></script>'}}]
    widget = [{"output_type": "display_data", "metadata": {}, "data": {
        "application/vnd.jupyter.widget-view+json": {"model_id": "abc", "version_major": 2, "version_minor": 0},
        "text/plain": "IntSlider(value=3)"}}]
    (nbs / "index.ipynb").write_text(json.dumps(_nb("# Home\n\nThe README source.")))
    (nbs / "10_new.ipynb").write_text(json.dumps(_nb(
        "# new\n\n> a notebook no configuration mentions",
        ("#| default_exp quant", []),
        ("#| hide\nsecret = 1", []),
        ("#| export\ndef fwht(x):\n    \"doc\"\n    return x", []),
        ("#| echo: false\nprint('hello')", stream),
        ("#| slow\nchart", chart),
        ("slider", widget))))
    (nbs / "guides" / "howto.ipynb").write_text(json.dumps(_nb("# How to", ("1 + 1", []))))
    (nbs / "_private.ipynb").write_text(json.dumps(_nb("# skipped, as nbdev skips it")))
    src = tmp_path / "src"
    docnames = _docs_build().stage(src, nbs)
    assert docnames == ["10_new", "guides/howto", "index"]
    new = json.loads((src / "10_new.ipynb").read_text())
    srcs = [c["source"] for c in new["cells"]]
    assert not any("#|" in s or "secret" in s or "def fwht" in s for s in srcs), srcs  # directives, hide, export
    assert "```{showdoc} veloxquant.quant.fwht\n```" in srcs  # show_doc of the exported function
    echo = next(c for c in new["cells"] if c["source"] == "print('hello')")
    assert echo["metadata"]["tags"] == ["remove-input"] and "".join(echo["outputs"][0]["text"]) == "hello\n"
    data = next(c for c in new["cells"] if c["source"] == "chart")["outputs"][0]["data"]
    assert set(data) == {"image/svg+xml", "text/plain"}, set(data)  # vega -> local SVG, CDN HTML dropped
    assert "<svg" in data["image/svg+xml"] and "<rect" in data["image/svg+xml"]
    assert set(next(c for c in new["cells"] if c["source"] == "slider")["outputs"][0]["data"]) == {"text/plain"}
    nav = json.loads((src / "index.ipynb").read_text())["cells"][-1]["source"]
    assert ":caption: Notebooks" in nav and "\n10_new\n" in nav and ":caption: Guides" in nav and "guides/howto" in nav
    assert "api/index" in nav and (src / "api" / "veloxquant.quant.rst").is_file()
    assert not (src / "_private.ipynb").exists()


# ------------------------------------------------------------------ static checks of the built HTML
class _Refs(html.parser.HTMLParser):
    "Every resource URL a page makes the browser fetch (script/link/img/iframe/source/... src, href, srcset)."
    def __init__(self):
        super().__init__()
        self.refs = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in ("script", "img", "iframe", "source", "video", "audio", "embed", "track", "input") and a.get("src"):
            self.refs.append((tag, a["src"]))
        if tag == "link" and a.get("href"): self.refs.append((tag, a["href"]))
        if tag == "object" and a.get("data"): self.refs.append((tag, a["data"]))
        for s in (a.get("srcset") or "").split(","):
            if s.strip(): self.refs.append((tag, s.split()[0]))


def test_every_notebook_has_a_page_in_the_navigation(site):
    "One page per notebook nbdev knows (new notebooks included, no per-notebook configuration), all in the home page's navigation."
    b = _docs_build()
    cfg_nbs = ROOT / "nbs"
    nbs = b.notebooks(cfg_nbs)
    assert len(nbs) >= 2 and (cfg_nbs / "index.ipynb") in nbs
    index = (site / "index.html").read_text(encoding="utf-8")
    for nb in nbs:
        rel = nb.relative_to(cfg_nbs).with_suffix(".html").as_posix()
        assert (site / rel).is_file(), f"no page for {nb.relative_to(ROOT)}"
        if rel != "index.html": assert f'href="{rel}"' in index, f"{rel} is not in the home page's navigation"
    assert 'href="api/index.html"' in index, "the API reference is not in the navigation"
    for m in b.modules(ROOT / "veloxquant", "veloxquant"):
        page = site / "api" / f"{m}.html"
        assert page.is_file(), f"no API reference page for {m}"
        assert 'class="sig sig-object py"' in page.read_text(encoding="utf-8") or m in ("veloxquant", "veloxquant.methods"), \
            f"{page.name} documents no object"


def test_home_page_is_the_readme_source(site):
    "The home page is nbs/index.ipynb (README.md's source): its headings and the docs build command are there."
    index = (site / "index.html").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for line in readme.splitlines():
        if line.startswith("## "): assert line[3:].strip().split("`")[0] in index, f"README section {line!r} missing"
    assert "docs/build.py" in readme and "docs/build.py" in index


def test_no_resource_is_fetched_from_outside(site):
    "Every <script src>, <link href>, <img src>, ... of every page is a file of the site (no CDN, no scheme-relative URL)."
    bad, missing = [], []
    for page in _pages(site):
        p = _Refs()
        p.feed(page.read_text(encoding="utf-8"))
        for tag, ref in p.refs:
            u = urlsplit(ref)
            if u.scheme == "data": continue
            if u.scheme or u.netloc: bad.append(f"{page.relative_to(site)}: <{tag}> {ref}"); continue
            target = (page.parent / unquote(u.path)).resolve()
            if u.path and not target.is_file(): missing.append(f"{page.relative_to(site)}: <{tag}> {ref}")
    assert not bad, "resources from outside the site:\n" + "\n".join(bad)
    assert not missing, "resources missing from the site:\n" + "\n".join(missing)


def test_notebook_pages_show_their_stored_outputs_and_api(site):
    "Stored chart outputs become images of the site, show_doc entries are rendered, math is MathML (no MathJax)."
    b = _docs_build()
    nbs_dir = ROOT / "nbs"
    for nb in b.notebooks(nbs_dir):
        import json
        raw = json.loads(nb.read_text(encoding="utf-8"))
        page = (site / nb.relative_to(nbs_dir).with_suffix(".html")).read_text(encoding="utf-8")
        n_png = sum("image/png" in o.get("data", {}) for c in raw["cells"] if c["cell_type"] == "code"
                    for o in c.get("outputs", []))
        assert page.count("<img") >= n_png, f"{nb.name}: {n_png} stored PNG outputs, fewer <img> on the page"
        if any("$$" in "".join(c["source"]) for c in raw["cells"] if c["cell_type"] == "markdown"):
            assert "<math" in page, f"{nb.name}: display math was not rendered to MathML"
        assert "mathjax" not in page.lower().replace("mathjax_ignore", "").replace("tex2jax_ignore", ""), nb.name
        exported = any(c["cell_type"] == "code" and "".join(c["source"]).lstrip().startswith("#| export")
                       and re.search(r"^(async def|def|class) ", "".join(c["source"]), re.M) for c in raw["cells"])
        if exported: assert 'class="sig sig-object py"' in page, f"{nb.name}: exported definitions have no show_doc entry"
        # an nbdev directive left in a code cell is highlighted as a Python comment: `<span class="c1">#| ...`
        assert '<span class="c1">#|' not in page, f"{nb.name}: an nbdev `#|` directive leaked into a code cell"


# ------------------------------------------------------------------ the browser
class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *a): pass


@pytest.fixture(scope="module")
def server(site):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser():
    assert CHROMIUM.is_file(), f"{CHROMIUM} is missing: `apt-get install -y chromium` (.ci/run does it)"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        pytest.fail(f"playwright is not installed ({e}): pip install -e '.[docs]'")
    # CI preloads OpenBLAS for MLX (LD_PRELOAD); inside playwright's node driver and Chromium it makes
    # pthread_create fail and the renderer crash, so neither process inherits it.
    preload = os.environ.pop("LD_PRELOAD", None)
    try: pw = sync_playwright().start()
    finally:
        if preload is not None: os.environ["LD_PRELOAD"] = preload
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    try:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, env=env)
        yield b
        b.close()
    finally: pw.stop()


def _offline_context(browser, blocked: list, **kw):
    "A browser context whose every non-loopback request is aborted and recorded in `blocked`."
    ctx = browser.new_context(service_workers="block", **kw)

    def route(r):
        u = urlsplit(r.request.url)
        if u.scheme in ("data", "blob", "about") or (u.hostname or "") in LOOPBACK: return r.continue_()
        blocked.append(r.request.url)
        return r.abort("blockedbyclient")

    ctx.route("**/*", route)
    return ctx


_PAGE_JS = """async () => {
  const links = [...document.querySelectorAll('a[href]')].map(a => a.href);
  const ids = [...document.querySelectorAll('[id]')].map(e => e.id)
      .concat([...document.querySelectorAll('a[name]')].map(a => a.name));
  const imgs = [];
  for (const img of document.querySelectorAll('img')) {
    img.loading = 'eager';
    try { await img.decode(); } catch (e) {}
    imgs.push({src: img.getAttribute('src'), w: img.naturalWidth, h: img.naturalHeight, ok: img.complete});
  }
  // chart SVGs are the ones inside cell outputs (theme icons are <svg><use>); canvases anywhere
  const box = e => { const r = e.getBoundingClientRect(); return {w: r.width, h: r.height}; };
  const svgs = [...document.querySelectorAll('.cell_output svg, .output svg')]
      .filter(s => !s.parentElement.closest('svg')).map(s => ({...box(s), n: s.querySelectorAll('*').length}));
  const canvases = [...document.querySelectorAll('canvas')].map(c => ({w: c.width, h: c.height, ...box(c)}));
  const maths = [...document.querySelectorAll('math')].map(m => ({...box(m), text: m.textContent}));
  return {links, ids, imgs, svgs, canvases, maths, title: document.title};
}"""


def test_every_page_in_chromium(site, server, browser):
    pages = _pages(site)
    assert len(pages) >= 10
    blocked, console, failed = [], [], []
    ctx = _offline_context(browser, blocked)
    page = ctx.new_page()
    page.on("console", lambda m: m.type == "error" and console.append(f"{page.url}: {m.text}"))
    page.on("pageerror", lambda e: console.append(f"{page.url}: uncaught {e}"))
    page.on("requestfailed", lambda r: failed.append(f"{page.url}: {r.url} ({r.failure})"))
    ids, links, problems = {}, set(), []
    for p in pages:
        rel = p.relative_to(site).as_posix()
        resp = page.goto(server + rel, wait_until="load")
        if resp is None or resp.status != 200:
            problems.append(f"{rel}: HTTP {resp.status if resp else 'no response'}"); continue
        info = page.evaluate(_PAGE_JS)
        ids[rel] = set(info["ids"])
        for h in info["links"]:
            u = urlsplit(h)
            if u.scheme in ("http", "https") and (u.hostname or "") in LOOPBACK: links.add((rel, h))
        for im in info["imgs"]:
            if not (im["ok"] and im["w"] > 0 and im["h"] > 0): problems.append(f"{rel}: image {im['src']} not drawn ({im})")
        for s in info["svgs"]:
            if not (s["w"] > 0 and s["h"] > 0 and s["n"] > 0): problems.append(f"{rel}: output SVG not drawn ({s})")
        for c in info["canvases"]:
            if not (c["w"] > 0 and c["h"] > 0): problems.append(f"{rel}: canvas not drawn ({c})")
        for m in info["maths"]:
            if not (m["w"] > 0 and m["h"] > 0): problems.append(f"{rel}: formula not drawn ({m})")
            if re.search(r"\\[A-Za-z]", m["text"]): problems.append(f"{rel}: TeX left unconverted in a formula: {m['text'][:80]!r}")
    # the offline full-text search (searchindex.js) finds a method's page
    page.goto(server + "search.html?q=Hadamard", wait_until="load")
    page.wait_for_selector("ul.search li", timeout=30_000)
    hits = page.eval_on_selector_all("ul.search li a", "els => els.map(a => a.getAttribute('href'))")
    if not any(h.startswith("methods/") for h in hits): problems.append(f"search for 'Hadamard' found no method page: {hits}")
    ctx.close()
    base = urlsplit(server)
    for src, h in sorted(links):
        u = urlsplit(h)
        if u.netloc != base.netloc: problems.append(f"{src}: link to another local server {h}"); continue
        path = unquote(u.path).lstrip("/")
        target = site / path
        if path == "" or target.is_dir(): path, target = (path.rstrip("/") + "/index.html").lstrip("/"), target / "index.html"
        if not target.is_file(): problems.append(f"{src}: broken link {h}"); continue
        if u.fragment and path.endswith(".html") and unquote(u.fragment) not in ids.get(path, set()):
            problems.append(f"{src}: link {h}: no element with id {unquote(u.fragment)!r} in {path}")
    report = [f"external request (blocked): {u}" for u in sorted(set(blocked))] + \
             [f"console: {c}" for c in console] + [f"request failed: {f}" for f in failed] + problems
    assert not report, f"{len(report)} problems on {len(pages)} pages:\n" + "\n".join(report[:80])
    assert len(links) > len(pages), "suspiciously few internal links"


def test_screenshots_when_asked(site, server, browser):
    "With VELOXQUANT_DOCS_SCREENSHOTS=DIR, save full-page screenshots of the home page and every method page."
    out = os.environ.get("VELOXQUANT_DOCS_SCREENSHOTS")
    targets = ["index.html"] + sorted(p.relative_to(site).as_posix() for p in (site / "methods").glob("*.html"))
    blocked = []
    ctx = _offline_context(browser, blocked, viewport={"width": 1280, "height": 900})
    page = ctx.new_page()
    for rel in targets:
        resp = page.goto(server + rel, wait_until="load")
        assert resp.status == 200
        png = page.screenshot(full_page=bool(out), path=str(Path(out) / rel.replace("/", "_").replace(".html", ".png")) if out else None)
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, f"{rel}: blank screenshot"
    ctx.close()
    assert not blocked, blocked
