#!/usr/bin/env python3
"""Which top-level part of gridshard imports which: the graph docs/architecture.md is drawn from.

A *part* is a sub-package (``gridshard/comm/``) or a top-level module (``gridshard/mesh.py``).
Every ``import`` / ``from … import`` in ``gridshard/**/*.py`` is read with :mod:`ast`
(relative imports resolved); an import at module level is an *eager* edge, one inside a
function or class body a *lazy* edge (taken only when that code runs; lazy imports keep
optional dependencies and heavy modules off the import path; none may close a cycle between
files, :func:`file_graph`).

Prints, for each part, the parts it imports eagerly and those it imports only lazily; then
the strongly connected groups of the eager+lazy graph with more than one part (cycles), and
the parts in dependency order (a part after everything it imports eagerly, cycles collapsed).

Below the parts, :func:`file_graph` is the same reading one level down: module (file) → the
modules it imports, every import counted (lazy ones too; its docstring has the rules), and
:func:`file_cycles` its circles — ``tests/test_import_graph.py`` holds the files free of them too.

Usage: ``python scripts/import_graph.py [--root gridshard] [--markdown | --files]``. ``--markdown`` prints
the levels and the table that docs/architecture.md holds between its ``import_graph`` markers
(``tests/test_import_graph.py`` holds the page equal to it, and the graph free of cycles);
``--files`` prints the circles between files, with the imports that close each.
"""
from __future__ import annotations

import argparse
import ast
import os
from collections import defaultdict


def part_of(module: str) -> str:
    """``gridshard.comm.ledger`` → ``comm``; ``gridshard.mesh`` → ``mesh``; ``gridshard`` → ``gridshard``."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else pieces[0]


def module_name(root: str, path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def imported_modules(tree: ast.Module, module: str, is_package: bool):
    """(module imported, eager?) for every gridshard import in ``tree``."""
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _from_target(node, module, is_package)
            names = [f"{target}.{a.name}" if target == "gridshard" else target for a in node.names]
        else:
            continue
        eager = id(node) in top_level or _inside_top_level_block(tree, node)
        for name in names:
            if name == "gridshard" or name.startswith("gridshard."):
                yield name, eager


def _from_target(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module ``from … import`` reads from (relative imports resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _inside_top_level_block(tree: ast.Module, target: ast.AST) -> bool:
    """An import under a module-level ``if`` / ``try`` runs at import time too."""
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)) and any(n is target for n in ast.walk(node)):
            return True
    return False


def graph(root: str):
    eager, lazy = defaultdict(set), defaultdict(set)
    parts, known = set(), _known_parts(root)
    for folder, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            module = module_name(root, path)
            src = part_of(module)
            parts.add(src)
            tree = ast.parse(open(path, encoding="utf-8").read(), path)
            for name, is_eager in imported_modules(tree, module, f == "__init__.py"):
                dst = part_of(name)
                if dst not in known:                  # ``from gridshard import LEDGER``: the package itself
                    dst = "gridshard"
                if dst != src:
                    (eager if is_eager else lazy)[src].add(dst)
    for src in parts:
        lazy[src] -= eager[src]
    return sorted(parts), eager, lazy


def _known_parts(root: str) -> set:
    out = set()
    for entry in os.listdir(root):
        if entry.endswith(".py") and entry != "__init__.py":
            out.add(entry[:-3])
        elif os.path.isfile(os.path.join(root, entry, "__init__.py")):
            out.add(entry)
    return out | {"gridshard"}


def file_graph(root: str) -> dict:
    """The file-level graph: every module of ``root`` (a file; a package is named by its
    ``__init__.py``: ``gridshard.zero`` is ``gridshard/zero/__init__.py``) → the set of modules of
    ``root`` it imports. Every import statement counts, wherever it is: at module level, under a
    module-level ``if``/``try`` (``TYPE_CHECKING`` included) and inside a function or class body
    (lazy) alike — a lazy import that closes a circle still makes the two files one unit that
    cannot be understood, tested or moved apart. Resolution:

    * ``import gridshard.a.b`` → ``gridshard.a.b``;
    * ``from X import n`` (``X`` absolute, or relative and resolved against the importing
      module) → ``X.n`` when ``X.n`` is a module of its own (``from . import files``,
      ``from .pkg import sub``), else ``X`` itself: a name defined in ``X.py`` or, for a package,
      in or re-exported by its ``__init__.py`` — importing a package's name is importing that
      ``__init__`` module (which runs every import it holds);
    * no edge from a module to itself, and none for the parent packages Python initialises
      before a submodule (``import gridshard.a.b`` first runs ``gridshard/__init__.py`` and
      ``gridshard/a/__init__.py``): every file would then import the top-level ``__init__``,
      which imports most of the package, and the graph would be one circle that says nothing.

    The edges from a package's ``__init__`` to its own submodules (its re-exports) are kept:
    a submodule that imports a name through its own package's ``__init__`` while that
    ``__init__`` imports the submodule is a real circle (the name may not exist yet at import
    time, depending on which file is imported first), not a false one, so nothing is dropped."""
    modules = {}
    for folder, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                modules[module_name(root, path)] = (path, f == "__init__.py")
    edges = {}
    for module, (path, is_package) in sorted(modules.items()):
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                target = _from_target(node, module, is_package)
                out |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
        edges[module] = {m for m in out if m in modules and m != module}
    return edges


def file_cycles(edges: dict) -> list:
    """The circles of a file graph (:func:`file_graph`): its strongly connected groups of more
    than one module, each sorted, in sorted order."""
    return sorted(g for g in strongly_connected(sorted(edges), edges) if len(g) > 1)


def strongly_connected(parts, edges) -> list:
    """Tarjan's strongly connected components of ``edges`` (dict part → set of parts)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            out.append(sorted(group))

    for v in parts:
        if v not in index:
            visit(v)
    return out                                    # Tarjan emits a component after all it reaches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                  "gridshard"))
    ap.add_argument("--markdown", action="store_true", help="print the block docs/architecture.md holds")
    ap.add_argument("--files", action="store_true", help="print the circles between files (file_graph)")
    args = ap.parse_args()
    if args.markdown:
        print(markdown(args.root))
        return
    if args.files:
        edges = file_graph(args.root)
        cycles = file_cycles(edges)
        print(f"{len(edges)} modules; circles between files (every import, lazy ones included):")
        for group in cycles:
            print("  " + " <-> ".join(group))
            for m in group:
                print(f"      {m} imports {', '.join(sorted(edges[m] & set(group)))}")
        print("  none" if not cycles else "")
        return
    parts, eager, lazy = graph(args.root)
    width = max(len(p) for p in parts)
    print(f"{'part':<{width}}  imports at module level  |  only inside functions")
    for p in parts:
        print(f"{p:<{width}}  {', '.join(sorted(eager[p])) or '-'}  |  {', '.join(sorted(lazy[p])) or '-'}")
    both = {p: eager[p] | lazy[p] for p in parts}
    cycles = [g for g in strongly_connected(parts, both) if len(g) > 1]
    print("\ncycles (eager + lazy):", "; ".join(" <-> ".join(g) for g in cycles) or "none")
    eager_cycles = [g for g in strongly_connected(parts, eager) if len(g) > 1]
    print("cycles (module level only):", "; ".join(" <-> ".join(g) for g in eager_cycles) or "none")
    print("\nlevels (module-level imports; a part imports only parts of lower levels, cycles collapsed):")
    for level, group in enumerate(levels(strongly_connected(parts, eager), eager)):
        print(f"  {level}: {', '.join(group)}")


def markdown(root: str) -> str:
    """The levels (a fenced block) and one table row per part: what docs/architecture.md holds
    between ``<!-- import_graph:begin -->`` and ``<!-- import_graph:end -->``."""
    parts, eager, lazy = graph(root)
    rows = ["```", "level  parts"]
    rows += [f"{i:<7}{', '.join(g)}" for i, g in enumerate(levels(strongly_connected(parts, eager), eager))]
    rows += ["```", "", "| part | imports at module level | only inside functions |", "|---|---|---|"]
    rows += [f"| {p} | {', '.join(sorted(eager[p])) or '–'} | {', '.join(sorted(lazy[p])) or '–'} |" for p in parts]
    return "\n".join(rows)


def levels(components: list, edges) -> list:
    """Parts grouped by the length of their longest chain of imports down to a part that imports none."""
    depth, of = {}, {p: tuple(g) for g in components for p in g}
    for group in components:                      # Tarjan's order: a component after all it reaches
        below = [depth[of[w]] for p in group for w in edges.get(p, ()) if of[w] != tuple(group)]
        depth[tuple(group)] = 1 + max(below, default=-1)
    out = [[] for _ in range(1 + max(depth.values()))]
    for group, d in depth.items():
        out[d].append("{" + ", ".join(group) + "}" if len(group) > 1 else group[0])
    return [sorted(g) for g in out]


if __name__ == "__main__":
    main()
