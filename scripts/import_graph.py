#!/usr/bin/env python3
"""The import graph inside one crate: which source file uses which, where an import runs back up
the module tree, and the import circles.

    scripts/import_graph.py crates/ferry-router          # the report
    scripts/import_graph.py --check crates/ferry-router  # exit 1 on a circle or a use back up
    scripts/import_graph.py --dot crates/ferry-router    # the graph, for Graphviz

A node is a source file (module). An edge A -> B is a path in A (a `use` or a path in code, such as
`crate::registry::Registry` or `super::Job`) that names an item of module B; `mod` declarations
are not edges. Re-exports are not followed: a file that takes `Foo` from its parent's
`pub use child::Foo` depends on the parent, which is what the rule below forbids.

Two rules (docs/architecture.md, "Layering"):
- **No use back up**: a module never uses an item of a module above it in the tree (its parent, or
  an ancestor's own items). A parent (`mod.rs`, `lib.rs`) is the folder's front: it declares and
  re-exports its children; its children reach each other directly.
- **No circles**: the file graph is acyclic.

Test modules (`*_tests.rs`, `tests.rs`, and `#[cfg(test)]` blocks in a file) are left out: a test
looks at its subject from above.
"""

import re
import sys
from pathlib import Path

USE_RE = re.compile(r"\b(?:pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", re.S)
PATH_RE = re.compile(r"\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")
MOD_RE = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+([a-z_][a-z0-9_]*)\s*;", re.M)


def strip_comments_and_tests(text):
    """Source without comments, string literals and `#[cfg(test)]` items."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'\br#*"(?:.|\n)*?"#*', '""', text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    out, i = [], 0
    for m in re.finditer(r"#\[cfg\(test\)\]\s*", text):
        if m.start() < i:
            continue
        out.append(text[i:m.start()])
        j = m.end()
        # Skip one item: up to its `;` (a `mod x;`) or its balanced braces.
        depth, k = 0, j
        while k < len(text):
            c = text[k]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    k += 1
                    break
            elif c == ";" and depth == 0:
                k += 1
                break
            k += 1
        i = k
    out.append(text[i:])
    return "".join(out)


def expand_use_tree(tree):
    """`a::{b, c::{d, e as f}}` -> ["a::b", "a::c::d", "a::c::e"]."""
    tree = re.sub(r"\s+as\s+[A-Za-z_][A-Za-z0-9_]*", "", tree)
    tree = re.sub(r"\s+", "", tree)

    def split_top(s):
        parts, depth, cur = [], 0, ""
        for c in s:
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            if c == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += c
        if cur:
            parts.append(cur)
        return parts

    def go(prefix, s):
        brace = s.find("{")
        if brace < 0:
            return [prefix + s]
        head = prefix + s[:brace]
        inner = s[brace + 1: s.rfind("}")]
        out = []
        for part in split_top(inner):
            out.extend(go(head, part))
        return out

    return [re.sub(r"::self$", "", p.rstrip(":")) for p in go("", tree)]


class Crate:
    def __init__(self, root):
        self.src = Path(root) / "src"
        self.files = {}  # module path (tuple) -> file
        for f in sorted(self.src.rglob("*.rs")):
            rel = f.relative_to(self.src)
            name = rel.stem
            if name.endswith("_tests") or name == "tests" or "tests" in rel.parts[:-1]:
                continue
            parts = list(rel.parts[:-1])
            if name not in ("mod", "lib", "main"):
                parts.append(name)
            self.files[tuple(parts)] = f

        self.reexports = {}  # module -> {name: the module that defines it}
        for module, f in self.files.items():
            text = strip_comments_and_tests(f.read_text())
            for m in re.finditer(r"\bpub(?:\([^)]*\))?\s+use\s+([^;]+);", text):
                for p in expand_use_tree(m.group(1)):
                    self.reexports.setdefault(module, {})[p.split("::")[-1]] = p

    def children(self, module):
        return {m[-1] for m in self.files if len(m) == len(module) + 1 and m[:-1] == module}

    def resolve(self, module, path, depth=0):
        """The module (file) that defines the item a path used in `module` names (re-exports
        followed), or None (outside the crate)."""
        segs = path.split("::")
        if segs[0] == "crate":
            base, segs = (), segs[1:]
        elif segs[0] in ("super", "self"):
            base = module
            while segs and segs[0] in ("super", "self"):
                if segs[0] == "super":
                    base = base[:-1]
                segs = segs[1:]
        elif segs[0] in self.children(module):
            base = module
        else:
            return None
        target, rest = base, list(segs)
        while rest and target + (rest[0],) in self.files:
            target = target + (rest.pop(0),)
        if target not in self.files:
            return None
        again = self.reexports.get(target, {}).get(rest[0]) if rest else None
        if again and depth < 8:
            return self.resolve(target, again, depth + 1) or target
        return target

    def edges(self):
        out = {}
        for module, f in self.files.items():
            text = strip_comments_and_tests(f.read_text())
            declared = set(MOD_RE.findall(text))
            paths = set()
            for m in USE_RE.finditer(text):
                paths.update(expand_use_tree(m.group(1)))
            paths.update(PATH_RE.findall(USE_RE.sub("", text)))
            for p in paths:
                t = self.resolve(module, p)
                if t is None or t == module:
                    continue
                # `pub use child::Item` in a parent: the front re-exporting its own child.
                if t[: len(module)] == module and t[len(module)] in declared | self.children(module):
                    out.setdefault(module, {}).setdefault(t, set()).add(p)
                    continue
                out.setdefault(module, {}).setdefault(t, set()).add(p)
        return out


def name(m):
    return "::".join(m) or "crate"


def cycles(edges, nodes):
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    return comps


def main(argv):
    check = "--check" in argv
    dot = "--dot" in argv
    roots = [a for a in argv if not a.startswith("--")]
    bad = 0
    for root in roots:
        crate = Crate(root)
        edges = crate.edges()
        up = [(a, b, sorted(ps)) for a, bs in edges.items() for b, ps in bs.items() if a[: len(b)] == b]
        circles = cycles(edges, list(crate.files))
        if dot:
            print(f'digraph "{root}" {{')
            for a, bs in sorted(edges.items()):
                for b in sorted(bs):
                    print(f'  "{name(a)}" -> "{name(b)}";')
            print("}")
            continue
        n_edges = sum(len(bs) for bs in edges.values())
        print(f"{root}: {len(crate.files)} files, {n_edges} imports between them, "
              f"{len(up)} back up the tree, {len(circles)} circles")
        for a, b, ps in sorted(up):
            print(f"  up:     {name(a)} -> {name(b)}  ({', '.join(ps[:3])})")
        for comp in circles:
            print(f"  circle: {' <-> '.join(name(m) for m in comp)}")
            for a in comp:
                for b, ps in sorted(edges.get(a, {}).items()):
                    if b in comp:
                        print(f"            {name(a)} -> {name(b)}  ({', '.join(sorted(ps)[:3])})")
        bad += len(up) + len(circles)
    return 1 if check and bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
