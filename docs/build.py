"""Build the veloxquant docs site offline from the notebooks' stored outputs.

    pip install -e ".[docs]" && python docs/build.py      # then open _build/site/index.html

Steps (no notebook is executed; `nbdev_test` runs them):

1. every notebook nbdev knows (`nbdev.doclinks.nbglob` over `nbs_path` from settings.ini, recursive, files and
   folders starting with `_` or `.` skipped: the same set `nbdev_export`/`nbdev_test` use) is run through nbdev's
   own cell processors (`nbdev.processors`: `#|` directives stripped, `#| hide`/`export`/`default_exp` cells
   removed, `hide_line`, `filter_stream`, ANSI codes and magics cleaned, `show_doc` cells added after exported
   definitions) plus the few steps below, and written to `_build/site.src/` under the same relative path;
2. each `show_doc(name)` cell becomes a `showdoc` directive (docs/conf.py: autodoc of `veloxquant.<default_exp>.name`),
   so the notebook page shows the exported signature and docstring (the indexed entry is in the API reference);
3. Quarto cell options nbdev users write (`#| echo: false`, `#| output: false`, `#| include: false`) become
   myst-nb's `remove-input` / `remove-output` / `remove-cell` tags;
4. Vega-Lite outputs without a static image get an SVG rendered locally with vl-convert (no CDN), and
   JavaScript / widget-view outputs (which would need a CDN or a live kernel) are dropped when a static
   fallback exists;
5. `_build/site.src/api/<module>.rst` (automodule, members from `__all__`) is written for every module of the package,
   and the home page (from `index.ipynb`, the README source) gets the navigation toctrees (one per notebook folder,
   plus the API reference);
6. Sphinx (`docs/conf.py`: myst-nb with execution off, furo theme, docstrings rendered as markdown like nbdev's
   show_doc, math converted to MathML at build time) writes the HTML into `_build/site/`.

Exit status: 0 on success, 1 when the build fails (Sphinx warnings are printed, not fatal, unless `--strict`).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
STATIC_EXTS = {".png", ".jpg", ".jpeg", ".gif", ".svg", ".webp"}
_VEGA_RE = re.compile(r"^application/vnd\.vega(lite)?\.v(\d+)(\.\d+)*\+json$")
_IMAGE_MIMES = ("image/svg+xml", "image/png", "image/jpeg", "image/gif")
_LIVE_MIMES = ("application/javascript", "application/vnd.jupyter.widget-view+json")


def _config():
    from nbdev.config import get_config
    return get_config(path=ROOT)


def notebooks(nbs_path: Path | None = None) -> list[Path]:
    "Every notebook of the project (nbdev's own glob: recursive, `_*`/`.*` files and folders skipped), sorted by path."
    from nbdev.doclinks import nbglob
    cfg = _config()
    path = Path(nbs_path or cfg.config_path / cfg.nbs_path)
    if not path.is_dir(): raise ValueError(f"nbs_path={str(path)!r} is not a directory")
    res = sorted(Path(p) for p in nbglob(path, skip_folder_re=r"^[_.]|^\.ipynb_checkpoints$"))
    if not res: raise ValueError(f"nbs_path={str(path)!r} holds no notebook")
    return res


# ---------------------------------------------------------------- notebook processing
def _mk_procs(lib_name: str):
    from nbdev.processors import (populate_language, add_show_docs, strip_ansi, hide_line, filter_stream_,
                                  rm_header_dash, rm_export, clean_magics, hide_, strip_hidden_metadata)
    from nbdev.process import Processor

    class show_doc_autodoc(Processor):
        "Turn the `show_doc(name)` cells added by `add_show_docs` (or written by hand) into autodoc directives."
        def begin(self):
            exp = self.nb.get("default_exp_")  # read before NBProcessor strips the `#|` lines
            self.module = f"{lib_name}.{exp}" if exp and exp != "__init__" else lib_name
        def cell(self, cell):
            if cell.cell_type != "code" or not cell.source: return
            m = re.fullmatch(r"\s*show_doc\(\s*([\w.]+)\s*(?:,[^)]*)?\)\s*", cell.source)
            if not m: return
            cell.cell_type, cell.source = "markdown", f"```{{showdoc}} {self.module}.{m.group(1)}\n```"
            for k in ("outputs", "execution_count"): cell.pop(k, None)

    class quarto_options(Processor):
        """Map Quarto's `#| echo/output/include: false` cell options onto myst-nb's remove-* tags, and strip the
        `#| key: value` lines nbdev leaves in the source for Quarto."""
        def cell(self, cell):
            d, tags = cell.directives_, []
            if cell.cell_type != "code" or not d: return
            lines = cell.source.splitlines()
            while lines and re.match(r"\s*#\|", lines[0]): lines.pop(0)
            cell.source = "\n".join(lines)
            false = lambda k: str(d.get(k + ":", [""])[0]).lower() == "false"
            if false("include"): tags.append("remove-cell")
            if false("echo"): tags.append("remove-input")
            if false("output"): tags.append("remove-output")
            if tags: cell.setdefault("metadata", {}).setdefault("tags", []).extend(tags)

    def static_outputs(cell):
        "Vega(-Lite) specs -> local SVG; drop JS/widget-view data that needs a CDN or a live kernel when a fallback exists."
        for out in cell.get("outputs", []):
            data = out.get("data")
            if not data: continue
            vega = [k for k in data if _VEGA_RE.match(k)]
            if vega and not any(k in data for k in _IMAGE_MIMES):
                import vl_convert as vlc
                spec = data[vega[0]]
                if isinstance(spec, str): spec = json.loads(spec)
                svg = vlc.vegalite_to_svg(spec) if "lite" in vega[0] else vlc.vega_to_svg(spec)
                data["image/svg+xml"] = svg
            for k in vega: del data[k]
            if vega: data.pop("text/html", None)  # Altair's HTML loads vega from a CDN; the SVG replaces it
            for k in _LIVE_MIMES:
                if k in data and len(data) > 1: del data[k]

    return [populate_language, add_show_docs, strip_ansi, hide_line, filter_stream_, rm_header_dash,
            quarto_options, rm_export, clean_magics, hide_, show_doc_autodoc, static_outputs, strip_hidden_metadata]


def process_notebook(src: Path, lib_name: str) -> dict:
    "nbdev-process one notebook for Sphinx; returns the notebook as a JSON-able dict (outputs kept, nothing executed)."
    from execnb.nbio import read_nb
    from nbdev.process import NBProcessor
    from nbdev.processors import _default_exp
    nb = read_nb(src)
    nb["default_exp_"] = _default_exp(nb)
    NBProcessor(nb=nb, procs=_mk_procs(lib_name)).process()
    cells = []
    for c in nb.cells:
        cell = {"cell_type": c.cell_type, "metadata": dict(c.get("metadata", {})), "source": c.source}
        if c.cell_type == "code":
            cell["outputs"], cell["execution_count"] = [_plain(o) for o in c.get("outputs", [])], None
        cells.append(cell)
    meta = dict(nb.get("metadata", {}))
    meta.setdefault("kernelspec", {"display_name": "Python 3", "language": "python", "name": "python3"})
    meta.setdefault("language_info", {"name": "python"})
    return {"cells": cells, "metadata": meta, "nbformat": 4, "nbformat_minor": 4}  # 4.4: no cell ids (nbdev_clean drops them)


def _plain(o):
    "fastcore AttrDict trees -> plain dicts/lists (JSON)."
    if isinstance(o, dict): return {k: _plain(v) for k, v in o.items() if not k.endswith("_")}
    if isinstance(o, (list, tuple)): return [_plain(v) for v in o]
    return o


def _write_if_changed(path: Path, text: str):
    "Write only when the content differs, so Sphinx's incremental build re-reads only what changed."
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text(encoding="utf-8") != text: path.write_text(text, encoding="utf-8")


# ---------------------------------------------------------------- API reference and navigation
def modules(lib_path: Path, lib_name: str) -> list[str]:
    "Dotted names of the package's modules (generated by nbdev_export), `_modidx` and private modules left out."
    res = []
    for p in sorted(lib_path.rglob("*.py")):
        rel = p.relative_to(lib_path.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__": parts = parts[:-1]
        if any(x.startswith("_") for x in parts): continue
        res.append(".".join(parts))
    return res


def api_pages(mods: list[str], lib_name: str) -> dict[str, str]:
    "Sources of the API reference: an index page (markdown) and one automodule page (reST) per module."
    pages = {}
    for m in mods:
        pages[f"api/{m}.rst"] = f"``{m}``\n{'=' * (len(m) + 4)}\n\n.. automodule:: {m}\n   :members:\n   :show-inheritance:\n"
    toc = "\n".join(f"{m}" for m in mods)
    pages["api/index.md"] = (f"# API reference\n\nThe exported API of `{lib_name}`, one page per module, generated from the "
                             "docstrings of the code `nbdev_export` writes from the notebooks.\n\n"
                             f"```{{toctree}}\n:maxdepth: 1\n\n{toc}\n```\n")
    return pages


def _title(rel: Path) -> str:
    parent = rel.parent.as_posix()
    return "Notebooks" if parent == "." else parent.replace("_", " ").capitalize()


def nav_cell(docnames: list[str]) -> dict:
    "A markdown cell with one hidden toctree per notebook folder plus the API reference, for the home page."
    groups: dict[str, list[str]] = {}
    for d in docnames:
        if d == "index": continue
        groups.setdefault(_title(Path(d)), []).append(d)
    blocks = [f"```{{toctree}}\n:hidden:\n:caption: {t}\n:maxdepth: 1\n\n" + "\n".join(ds) + "\n```" for t, ds in groups.items()]
    blocks.append("```{toctree}\n:hidden:\n:caption: Reference\n:maxdepth: 1\n\napi/index\n```")
    return {"cell_type": "markdown", "metadata": {}, "source": "\n\n".join(blocks)}


def stage(src_dir: Path, nbs_path: Path | None = None) -> list[str]:
    """Write the processed notebooks of `nbs_path` (default: settings.ini's), their images and the API pages into
    `src_dir`; returns the docnames written (one per notebook, same relative path without `.ipynb`)."""
    cfg = _config()
    lib_name, lib_path = cfg.lib_name, cfg.config_path / cfg.lib_path
    nbs_path = Path(nbs_path or cfg.config_path / cfg.nbs_path)
    if str(ROOT) not in sys.path: sys.path.insert(0, str(ROOT))  # autodoc / show_doc import this tree's package
    nbs = notebooks(nbs_path)
    rels = [p.relative_to(nbs_path) for p in nbs]
    if Path("index.ipynb") not in rels: raise ValueError(f"nbs_path={str(nbs_path)!r} has no index.ipynb (the home page)")
    docnames = [r.with_suffix("").as_posix() for r in rels]
    keep = set()
    for p, r in zip(nbs, rels):
        nb = process_notebook(p, lib_name)
        if r == Path("index.ipynb"): nb["cells"].append(nav_cell(docnames))
        out = src_dir / r
        _write_if_changed(out, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        keep.add(out)
    for p in nbs_path.rglob("*"):  # images referenced from markdown cells
        if p.suffix.lower() in STATIC_EXTS and not any(x.startswith((".", "_")) for x in p.relative_to(nbs_path).parts):
            out = src_dir / p.relative_to(nbs_path)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, out)
            keep.add(out)
    for rel, text in api_pages(modules(lib_path, lib_name), lib_name).items():
        _write_if_changed(src_dir / rel, text)
        keep.add(src_dir / rel)
    for p in list(src_dir.rglob("*")):  # notebooks deleted or renamed since the last build
        if p.is_file() and p not in keep: p.unlink()
    return docnames


def build(out: Path = ROOT / "_build" / "site", clean: bool = False, strict: bool = False, quiet: bool = True,
          nbs_path: Path | None = None) -> Path:
    "Build the site into `out` (HTML; `out/index.html` is the home page). Raises RuntimeError if Sphinx fails."
    from sphinx.cmd.build import build_main
    out = Path(out).resolve()
    # staged sources and Sphinx's pickled doctrees live beside `out`, named after it (never a folder of the user's)
    src_dir, doctrees = out.with_name(out.name + ".src"), out.with_name(out.name + ".doctrees")
    if out.is_dir() and any(out.iterdir()) and not (out / ".buildinfo").is_file():
        raise ValueError(f"out={str(out)!r} is a non-empty folder that is not a Sphinx HTML build; pick another --out")
    if clean:
        for d in (src_dir, doctrees, out): shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    docnames = stage(src_dir, nbs_path)
    t1 = time.perf_counter()
    args = ["-b", "html", "-c", str(DOCS), "-d", str(doctrees), str(src_dir), str(out)]
    if quiet: args.insert(0, "-q")
    if strict: args[:0] = ["-W", "--keep-going"]
    rc = build_main(args)
    if rc: raise RuntimeError(f"sphinx-build exited with status {rc}")
    print(f"docs: {len(docnames)} notebooks staged in {t1 - t0:.1f} s, Sphinx {time.perf_counter() - t1:.1f} s -> "
          f"{out / 'index.html'}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "_build" / "site", help="HTML output folder (default: _build/site)")
    ap.add_argument("--clean", action="store_true", help="start from scratch (no incremental build)")
    ap.add_argument("--strict", action="store_true", help="turn Sphinx warnings into errors")
    ap.add_argument("--verbose", action="store_true", help="show Sphinx's progress output")
    ap.add_argument("--nbs", type=Path, default=None, help="notebook folder (default: nbs_path of settings.ini)")
    a = ap.parse_args(argv)
    try: build(a.out.resolve(), clean=a.clean, strict=a.strict, quiet=not a.verbose, nbs_path=a.nbs)
    except (RuntimeError, ValueError) as e:
        print(f"docs build failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
