#!/usr/bin/env python3
"""The structure the product's crates keep, checked from their sources and manifests:

- no import circle between the modules of a crate: module A naming module B (`use crate::b`,
  `super::b::f()`, a child named from its parent) and B naming A, directly or through others;
  a module naming its own ancestors is not counted (a parent holds its children);
- no arrow upward between crates: each product crate depends only on crates of a lower layer
  (LAYERS below; the libraries a service embeds at the bottom, the binaries and examples at the
  top), so no two crates of one layer depend on each other.

The test crates (tests/) are left out. Exit status 1, with each circle and arrow named, when one
is found.

    python3 scripts/check-structure.py [REPO]
"""
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent.parent).resolve()

# Lower layers first; a crate may depend only on crates of lower layers. Crates not named here
# are at the top (binaries, demonstrations, examples).
LAYERS = [
    {"pipeline-core", "outbox"},
    {"relay", "consumer"},
    {"pipeline-operator"},
]
TOP = len(LAYERS)

TEST_MODULE = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{")
CHILD_DECL = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", re.M)
# Modules declared through pipeline-core's `inner_modules!(a, b, …)`.
INNER_MODULES = re.compile(r"\binner_modules!\s*\(([^)]*)\)")
PATH = re.compile(r"\b(crate|super|self)((?:::\w+)+)")
USE_GROUP = re.compile(r"\buse\s+(crate|super|self)((?:::\w+)*)::\{([^;]*)\};", re.S)


def product_crates():
    workspace = tomllib.loads((ROOT / "Cargo.toml").read_text())
    for member in workspace["workspace"]["members"]:
        if member.startswith("tests/"):
            continue
        directory = ROOT / member
        manifest = tomllib.loads((directory / "Cargo.toml").read_text())
        yield manifest["package"]["name"], directory, manifest


def code(path):
    """The file's text without comments, strings' contents or its test module."""
    text = path.read_text()
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    found = TEST_MODULE.search(text)
    return text[: found.start()] if found else text


def modules_of(root_file):
    """Module path (a tuple of names) -> its file, for the module tree under `root_file`."""
    found = {}

    def walk(path, file):
        found[path] = file
        here = file.parent if file.name in ("lib.rs", "main.rs", "mod.rs") else file.parent / file.stem
        text = code(file)
        declared = CHILD_DECL.findall(text)
        for listed in INNER_MODULES.findall(text):
            declared += [n.strip() for n in listed.split(",") if n.strip()]
        for name in declared:
            for candidate in (here / f"{name}.rs", here / name / "mod.rs"):
                if candidate.exists():
                    walk(path + (name,), candidate)
                    break

    walk((), root_file)
    return found


def named_modules(path, text, modules):
    """The modules the module at `path` names, its ancestors and itself left out."""
    references = []
    for group in USE_GROUP.finditer(text):
        prefix = [p for p in group.group(2).split("::") if p]
        items = re.sub(r"\{[^{}]*\}", "", group.group(3))
        for item in items.split(","):
            item = item.strip().split(" as ")[0].strip()
            if item:
                parts = [p for p in item.split("::") if p and p != "self"]
                references.append((group.group(1), prefix + parts))
        for nested in re.finditer(r"(\w+(?:::\w+)*)::\{", group.group(3)):
            references.append((group.group(1), prefix + nested.group(1).split("::")))
    for found in PATH.finditer(text):
        references.append((found.group(1), [p for p in found.group(2).split("::") if p]))
    # A child named from its parent without `self::`.
    for child in {m[-1] for m in modules if len(m) == len(path) + 1 and m[: len(path)] == path}:
        if re.search(rf"(?<![\w:]){child}::", text):
            references.append(("self", [child]))
    named = set()
    for head, parts in references:
        if head == "crate":
            base = ()
        elif head == "self":
            base = path
        else:
            base = path[:-1]
            while parts and parts[0] == "super":
                base, parts = base[:-1], parts[1:]
        full = base + tuple(parts)
        target = next(full[:i] for i in range(len(full), -1, -1) if full[:i] in modules)
        if target[: len(path)] == path and len(target) <= len(path):
            continue  # itself
        if path[: len(target)] == target:
            continue  # an ancestor
        named.add(target)
    return named


def circles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(100_000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    return found


def layer(name):
    return next((i for i, names in enumerate(LAYERS) if name in names), TOP)


def main():
    problems = 0
    crates = list(product_crates())
    names = {name for name, _, _ in crates}
    for name, directory, manifest in crates:
        for dependency in manifest.get("dependencies", {}):
            if dependency in names and layer(dependency) >= layer(name) and layer(name) < TOP:
                print(f"{name} depends on {dependency}, a crate of its own layer or above")
                problems += 1
        roots = [directory / manifest.get("lib", {}).get("path", "src/lib.rs")]
        roots += [directory / b["path"] for b in manifest.get("bin", []) if "path" in b]
        roots += [directory / "src/main.rs"]
        for root in dict.fromkeys(r for r in roots if r.exists()):
            modules = modules_of(root)
            graph = {path: named_modules(path, code(file), modules) for path, file in modules.items()}
            for component in circles(graph):
                shown = sorted("::".join(m) or root.name for m in component)
                print(f"{name}: import circle among {', '.join(shown)}")
                problems += 1
    if problems:
        print(f"{problems} structure problem(s)")
        return 1
    print(f"{len(crates)} product crates: no import circle, no arrow upward between crates")
    return 0


if __name__ == "__main__":
    sys.exit(main())
