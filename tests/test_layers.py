"""The package's architecture, read from its source: no import circles (top-level and in-function imports alike),
every module in a layer of the diagram on the index page (nbs/index.ipynb, "Layers"), no module importing a higher
layer, and no module over 700 lines (the generated `_modidx.py` excepted)."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "veloxquant"
MAX_LINES = 700

# lowest first; a module may import its own layer and the layers below it. Keep in sync with nbs/index.ipynb.
LAYERS = [
    ("foundations", ["veloxquant.core", "veloxquant.models", "veloxquant.gemma", "veloxquant.methods"]),
    ("attention", ["veloxquant.attention"]),
    ("cache, primitives, GPU", ["veloxquant.cache", "veloxquant.quant", "veloxquant.gpu"]),
    ("methods", ["veloxquant.methods.*"]),
    ("sliding and batch caches", ["veloxquant.sliding", "veloxquant.batch"]),
    ("builder", ["veloxquant.builder"]),
    ("evaluation and benchmarks", ["veloxquant.eval", "veloxquant.bench"]),
    ("applications", ["veloxquant.cli", "veloxquant.serve", "veloxquant.widgets"]),
    ("package", ["veloxquant"]),
]


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        if p.name == "_modidx.py": continue
        name = ".".join(p.relative_to(PKG.parent).with_suffix("").parts)
        out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = p
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> package modules it imports, anywhere in its file (in-function imports too). `from veloxquant import x`
    counts as importing the package `veloxquant` itself (its `__init__`) and `veloxquant.x`."""
    mods = modules(); graph = {m: set() for m in mods}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import): targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split("."); base = base[:len(base) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else: mod = node.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else: continue
            graph[m] |= {t for t in targets if t in mods and t != m}
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


def test_checker_sees_in_function_imports_and_cycles():
    "The checker itself: an in-function import makes an edge, and a two-module circle is found."
    g = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert cycles(g) == [["a", "b"]]
    src = "def f():\n    from .cache import VQCache\n"
    node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ImportFrom))
    assert node.level == 1 and node.module == "cache"


def test_diagram_lists_every_layer():
    "The index page's layer diagram names every module of LAYERS."
    import json
    nb = json.loads((PKG.parent / "nbs" / "index.ipynb").read_text(encoding="utf-8"))
    text = "".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    for _, pats in LAYERS[:-1]:
        for pat in pats:
            short = pat.removeprefix("veloxquant.").removesuffix(".*")
            assert short in text, f"{short} is missing from the layer diagram in nbs/index.ipynb"
