"""Sphinx configuration of the veloxquant docs site; run through `python docs/build.py` (which stages the
nbdev-processed notebooks and passes `-c docs`), not with sphinx-build on nbs/ directly."""
import importlib
import re
import sys
from pathlib import Path

from docutils import nodes
from docutils.utils import new_document
from sphinx import addnodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # autodoc documents this tree's package

from nbdev.config import get_config  # noqa: E402

_cfg = get_config(path=ROOT)
project = _cfg.title
author = _cfg.author
copyright = _cfg.copyright
release = version = _cfg.version

extensions = [
    "myst_nb",               # notebooks (.ipynb) and markdown, with their stored outputs
    "sphinx.ext.autodoc",    # API reference and show_doc from the exported docstrings
    "sphinx.ext.viewcode",   # highlighted source pages of the generated modules, served locally
]
root_doc = "index"
exclude_patterns = ["**.ipynb_checkpoints"]

# Notebooks are never executed here: `nbdev_test` runs them; the site shows their stored outputs.
nb_execution_mode = "off"
nb_merge_streams = True
nb_ipywidgets_js = {}  # no require.js / widget manager from a CDN (stored widget views have no live kernel)
# Static images before HTML (an output that has both is shown as the image); JS and widget views never.
nb_mime_priority_overrides = [
    ("html", "image/svg+xml", 1), ("html", "image/png", 2), ("html", "image/jpeg", 3), ("html", "image/gif", 4),
    ("html", "text/html", 5), ("html", "text/markdown", 6), ("html", "text/latex", 7), ("html", "text/plain", 8),
    ("html", "application/javascript", None), ("html", "application/vnd.jupyter.widget-view+json", None),
]
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
suppress_warnings = ["mystnb.unknown_mime_type"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_default_options = {"undoc-members": False}
# nbdev docstrings are markdown (nbdev's show_doc renders them so): autodoc hands each one to the `markdown-docstring`
# directive below, which parses it with MyST (backticks are code, `|x|` is not a reST substitution, lists and links work).
default_role = "py:obj"
add_module_names = False

html_theme = "furo"
html_title = f"{project} {version}"
html_show_sourcelink = False
html_copy_source = False
html_theme_options = {"navigation_with_keys": True}

# Math ($$ … $$ in the notebooks' markdown, :math: in docstrings) is converted to MathML at build time: the browser
# renders it natively, no MathJax script and no CDN. Converter: docutils' LaTeX -> MathML (the one Sphinx's own
# dependency ships; it knows \arg, \operatorname, \langle, ...). It has no \big/\Big/\bigg sizing commands: they
# are dropped (the delimiter stays, at normal size). What docutils still rejects goes through latex2mathml; a
# command neither converts is reported as a Sphinx warning (and tests/test_docs_site.py fails on leaked TeX).
html_math_renderer = "mathml"
_SIZE_CMD = re.compile(r"\\[bB]igg?[lrm]?(?![a-zA-Z])")


def _mathml(latex: str, display: str, node=None) -> str:
    from docutils.utils.math import MathError
    from docutils.utils.math.latex2mathml import tex2mathml
    tex = _SIZE_CMD.sub("", latex.strip())
    try: return tex2mathml(tex, as_block=display == "block")
    except MathError: pass
    from latex2mathml.converter import convert
    out = convert(tex, display=display)
    if re.search(r">[^<]*\\[A-Za-z]", out):
        logger.warning(f"math not fully converted to MathML: {latex.strip()[:80]!r}", location=node)
    return out


def _visit_math(self, node):
    self.body.append(self.starttag(node, "span", "", CLASS="math notranslate") + _mathml(node.astext(), "inline", node) + "</span>")
    raise nodes.SkipNode


def _visit_displaymath(self, node):
    latex = node.astext()
    if node.get("nowrap"):  # amsmath environments (align, equation, ...) arrive whole
        latex = latex.strip()
    self.body.append(self.starttag(node, "div", CLASS="math notranslate nohighlight"))
    if node.get("number"):
        from sphinx.util.math import get_node_equation_number
        self.body.append(f'<span class="eqno">({get_node_equation_number(self, node)})</span>')
    self.body.append(_mathml(latex, "block", node) + "</div>\n")
    raise nodes.SkipNode


class ShowDoc(SphinxDirective):
    """```{showdoc} veloxquant.quant.fwht``` — nbdev's `show_doc` on a notebook page: the autodoc entry (signature,
    docstring; a class with its public members) of one exported object, not indexed (the API reference page is).
    The generated reStructuredText is parsed on its own: myst's `eval-rst` would pad it with one blank line per
    line of the notebook before it, which takes minutes on the larger notebooks."""
    required_arguments = 1

    def run(self):
        from myst_parser.mocking import MockRSTParser
        name = self.arguments[0]
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):  # longest importable module prefix, then attributes
            try: obj = importlib.import_module(".".join(parts[:i]))
            except ImportError: continue
            try:
                for p in parts[i:]: obj = getattr(obj, p)
            except AttributeError as e: raise self.error(f"showdoc: {name} does not exist ({e})") from e
            break
        else: raise self.error(f"showdoc: no module in {name!r} can be imported")
        mod_depth = i
        if isinstance(obj, type): kind, opts = "autoclass", ["members", "no-index"]
        elif len(parts) - mod_depth > 1: kind, opts = "automethod", ["no-index"]
        else: kind, opts = "autofunction", ["no-index"]
        rst = f".. {kind}:: {name}\n" + "".join(f"   :{o}:\n" for o in opts)
        doc = new_document(self.state.document["source"], self.state.document.settings)
        doc.reporter = self.state.document.reporter
        MockRSTParser().parse(rst, doc)
        for sig in doc.findall(addnodes.desc_signature):
            # not indexed here, so no anchor: keep viewcode's "[docs]" back-links on the API reference page
            sig["module"] = None
        return list(doc.children)


class MarkdownDocstring(SphinxDirective):
    "The content (one docstring, from autodoc) rendered as MyST markdown with the site's MyST settings."
    has_content = True

    def run(self):
        from myst_parser.mdit_to_docutils.sphinx_ import SphinxRenderer
        from myst_parser.parsers.mdit import create_md_parser
        doc = new_document(self.state.document["source"], self.state.document.settings)
        doc.reporter = self.state.document.reporter
        parser = create_md_parser(self.env.myst_config, SphinxRenderer)
        parser.options["document"] = doc
        parser.render("\n".join(self.content))
        return list(doc.children)


def _markdown_docstring(app, what, name, obj, options, lines):
    if any(l.strip() for l in lines):
        lines[:] = [".. markdown-docstring::", ""] + [("   " + l) if l.strip() else "" for l in lines] + [""]


def setup(app):
    app.add_html_math_renderer("mathml", (_visit_math, None), (_visit_displaymath, None))
    app.add_directive("showdoc", ShowDoc)
    app.add_directive("markdown-docstring", MarkdownDocstring)
    app.connect("autodoc-process-docstring", _markdown_docstring)
