"""The import graph of the package (``scripts/import_graph.py``, read with ``ast``, nothing imported).

* no cycle between parts, lazy (function-level) imports included: every lazy import could be
  made eager without a cycle, so none exists to break one;
* no cycle between files either (``file_graph``: every import of every module, lazy ones
  included; a package's re-exported name is an import of its ``__init__``);
* ``theory`` is arithmetic: it imports no layer, model or layout code (``nn``, ``models``,
  ``parallel``); ``schedule`` imports nothing;
* docs/architecture.md holds the graph as it is: the block between its ``import_graph`` markers
  is the output of ``scripts/import_graph.py --markdown``.
"""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "gridshard")


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", os.path.join(ROOT, "scripts", "import_graph.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_cycle_between_parts_lazy_imports_included():
    g = _import_graph()
    parts, eager, lazy = g.graph(PACKAGE)
    both = {p: eager[p] | lazy[p] for p in parts}
    cycles = [c for c in g.strongly_connected(parts, both) if len(c) > 1]
    assert cycles == [], f"import cycles between parts: {cycles}"
    assert g.strongly_connected(["a", "b", "c"], {"a": {"b"}, "b": {"a"}}) == [["a", "b"], ["c"]]  # it finds one


def test_no_file_level_import_cycle(tmp_path):
    g = _import_graph()
    cycles = g.file_cycles(g.file_graph(PACKAGE))
    assert cycles == [], (f"import circles between files: {cycles}. `python scripts/import_graph.py --files` "
                          f"names the imports that close each")
    assert g.file_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # it finds one
    # ... and the graph sees one planted through a lazy import and a package's re-export
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import B\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from . import b\n    return b\n")
    (pkg / "sub" / "b.py").write_text("from ..sub import c\nB = 1\n")
    (pkg / "sub" / "c.py").write_text("import pkg.sub.a\nfrom pkg.sub import B\n")
    edges = g.file_graph(str(pkg))
    assert edges["pkg.sub.a"] == {"pkg.sub.b"} and edges["pkg.sub.c"] == {"pkg.sub.a", "pkg.sub"}
    assert g.file_cycles(edges) == [["pkg.sub", "pkg.sub.a", "pkg.sub.b", "pkg.sub.c"]]


def test_theory_and_schedule_import_no_model_code():
    g = _import_graph()
    _, eager, lazy = g.graph(PACKAGE)
    assert not (eager["theory"] | lazy["theory"]) & {"nn", "models", "parallel", "engine", "pipeline", "zero"}
    assert not eager["schedule"] | lazy["schedule"]


def test_architecture_page_holds_the_graph():
    block = _import_graph().markdown(PACKAGE)
    page = open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8").read()
    begin, end = "<!-- import_graph:begin -->\n", "\n<!-- import_graph:end -->"
    assert begin in page and end in page, "docs/architecture.md lost its import_graph markers"
    held = page[page.index(begin) + len(begin):page.index(end)]
    assert held == block, ("docs/architecture.md's import graph is not the package's. Fix: paste the output of "
                           "`python scripts/import_graph.py --markdown` between its import_graph markers "
                           "and update the text around it")
