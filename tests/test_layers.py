"""The package's architecture, read from its source: no import circles (top-level and in-function imports alike,
`importlib.import_module`/`__import__` calls included), every module in a layer of the diagram on the index page
(nbs/index.ipynb, "### Layers": the diagram itself is what this test reads), no module importing a higher layer, and
no module over 700 lines (the generated `_modidx.py` excepted)."""
import ast, json, re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "veloxquant"
MAX_LINES = 700
PLUGIN_PREFIX = "veloxquant.methods."  # the registry's discovery of a method module by its id: allowed, not an edge


def diagram_layers(text: str | None = None) -> list[tuple[str, list[str]]]:
    """The layers of the diagram under "### Layers" in nbs/index.ipynb, lowest first: (label, modules), each line of the
    fenced block being `label<two or more spaces>module · module`. The package itself is the top layer."""
    if text is None:
        nb = json.loads((ROOT / "nbs" / "index.ipynb").read_text(encoding="utf-8"))
        text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    m = re.search(r"### Layers\n.*?```\n(.*?)```", text, re.S)
    assert m, "no fenced layer diagram under '### Layers' in nbs/index.ipynb"
    layers = []
    for line in m.group(1).strip("\n").splitlines():
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        assert len(parts) == 2, f"diagram line {line!r} is not 'label  module · module'"
        label, names = parts
        layers.append((label, [f"veloxquant.{n.strip()}" for n in names.split("·")]))
    return layers[::-1] + [("package", ["veloxquant"])]


LAYERS = diagram_layers()


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        if p.name == "_modidx.py": continue
        name = ".".join(p.relative_to(PKG.parent).with_suffix("").parts)
        out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = p
    return out


DYNAMIC = {"import_module", "__import__"}


def _dynamic_target(node: ast.Call):
    """For an `importlib.import_module(...)` / `import_module(...)` / `__import__(...)` call: its module name when it
    is a literal, `PLUGIN_PREFIX` for an f-string that starts with it, `"?"` for anything else; None for other calls.
    `sys.modules["veloxquant.x"]` subscripts are read by `_edges` too."""
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in DYNAMIC or not node.args: return None
    a = node.args[0]
    if isinstance(a, ast.Constant) and isinstance(a.value, str): return a.value
    if isinstance(a, ast.JoinedStr) and a.values and isinstance(a.values[0], ast.Constant) \
            and str(a.values[0].value).startswith(PLUGIN_PREFIX) and len(a.values) == 2:
        return PLUGIN_PREFIX
    return "?"


def _edges(tree, m: str, pkg: str, mods) -> tuple[set[str], list[str]]:
    "(modules of the package that `tree` imports, dynamic imports it cannot check)."
    out, unchecked = set(), []
    aliases = {n.asname or n.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               for n in node.names if n.name in DYNAMIC}  # from importlib import import_module as im
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import): targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split("."); base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else: mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in aliases: node = ast.Call(ast.Name("import_module"), node.args, [])
            t = _dynamic_target(node)
            if t == "?": unchecked.append(ast.unparse(node) if hasattr(ast, "unparse") else "dynamic import")
            elif t and t != PLUGIN_PREFIX: targets = [t]
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
            k = node.slice
            if isinstance(k, ast.Constant) and isinstance(k.value, str): targets = [k.value]
            else: unchecked.append(ast.unparse(node))
        out |= {t for t in targets if t in mods and t != m}
    return out, unchecked


def import_graph(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """module -> package modules it imports, anywhere in its file (in-function imports and literal `importlib` /
    `__import__` / `sys.modules[...]` names too). `from veloxquant import x` counts as importing the package
    `veloxquant` itself (its `__init__`) and `veloxquant.x`. `sources`: module -> source text (default: the package)."""
    if sources is None: sources = {m: p.read_text(encoding="utf-8") for m, p in modules().items()}
    graph = {m: set() for m in sources}
    for m, src in sources.items():
        pkg = m if m == "veloxquant" or (PKG / m.removeprefix("veloxquant.").replace(".", "/") / "__init__.py").exists() \
            else m.rsplit(".", 1)[0]
        graph[m] = _edges(ast.parse(src), m, pkg, sources)[0]
    return graph


def layer_of(m: str) -> int:
    for i, (_, pats) in enumerate(LAYERS):
        for pat in pats:
            if m == pat or (pat.endswith(".*") and m.startswith(pat[:-1])): return i
    raise KeyError(m)


def cycles(graph) -> list[list[str]]:
    "Strongly connected components with more than one module (Tarjan)."
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
    def visit(v):
        index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
        for w in sorted(graph[v]):
            if w not in index: visit(w); low[v] = min(low[v], low[w])
            elif w in on: low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v: break
            if len(comp) > 1: out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index: visit(v)
    return out


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_unchecked_dynamic_import():
    "Every dynamic import names its module literally, or is the registry's plugin discovery of `veloxquant.methods.<id>`."
    bad = {m: u for m, p in modules().items()
           if (u := _edges(ast.parse(p.read_text(encoding="utf-8")), m, m, modules())[1])}
    assert not bad, bad


def test_every_module_has_a_layer():
    missing = []
    for m in modules():
        try: layer_of(m)
        except KeyError: missing.append(m)
    assert not missing, f"modules not in LAYERS (place them in the diagram of nbs/index.ipynb and here): {missing}"


def test_no_import_of_a_higher_layer():
    bad = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
           for m, ts in import_graph().items() for t in sorted(ts) if layer_of(t) > layer_of(m)]
    assert not bad, "\n".join(bad)


def test_methods_namespace_is_empty():
    "`veloxquant.methods` is only the folder the registry discovers methods in: it imports nothing."
    assert import_graph()["veloxquant.methods"] == set()


def test_module_size():
    big = {m: n for m, p in modules().items() if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_checker_sees_every_import_form():
    "The checker itself, on made-up sources: each form below makes an edge core -> cli, and a circle is found."
    mods = {"veloxquant.core": "", "veloxquant.cli": "import veloxquant.core\n", "veloxquant.methods": "",
            "veloxquant.methods.x": ""}
    forms = ["def f():\n    from .cli import main\n", "def f():\n    import veloxquant.cli\n",
             "import importlib\ndef f(): importlib.import_module('veloxquant.cli')\n", "def f(): __import__('veloxquant.cli')\n",
             "from importlib import import_module as im\ndef f(): im('veloxquant.cli')\n",
             "import sys\ndef f(): sys.modules['veloxquant.cli']\n"]
    for src in forms:
        g = import_graph({**mods, "veloxquant.core": src})
        assert g["veloxquant.core"] == {"veloxquant.cli"}, src
        assert cycles(g) == [["veloxquant.cli", "veloxquant.core"]]
    plugin = "import importlib\ndef f(i): importlib.import_module(f'veloxquant.methods.{i}')\n"
    assert _edges(ast.parse(plugin), "veloxquant.core", "veloxquant", mods) == (set(), [])
    hidden = "import importlib\ndef f(n): importlib.import_module(n)\n"
    assert _edges(ast.parse(hidden), "veloxquant.core", "veloxquant", mods)[1], "a non-literal import must be reported"


def test_diagram_is_parsed_strictly():
    "The diagram's lines become the layers, lowest first; a line without a label column is refused."
    text = "### Layers\n\n```\ntop        a · b\nbottom     c\n```\n"
    assert diagram_layers(text) == [("bottom", ["veloxquant.c"]), ("top", ["veloxquant.a", "veloxquant.b"]),
                                    ("package", ["veloxquant"])]
    import pytest
    with pytest.raises(AssertionError): diagram_layers("### Layers\n```\nnolabel\n```\n")
    with pytest.raises(AssertionError): diagram_layers("no diagram here")
    assert [lab for lab, _ in LAYERS][:2] == ["foundations", "attention"] and LAYERS[-1] == ("package", ["veloxquant"])


def test_diagram_has_no_stale_module():
    "Every module the diagram names exists (a renamed or deleted module must leave the diagram too)."
    mods = set(modules())
    for _, pats in LAYERS:
        for pat in pats:
            assert pat.endswith(".*") or pat in mods, f"the layer diagram names {pat}, which does not exist"
