#!/usr/bin/env python3
"""What a team checks before it adopts a crate, for the libraries a service embeds:

- the LICENSE file is the licence every crate declares (Apache-2.0);
- each library states a description, the licence, a minimum Rust version, a readme, keywords
  and categories;
- the workspace's minimum Rust version (rust-version) is no lower than any dependency built for
  this platform declares (cargo refuses an older toolchain; clippy's incompatible_msrv lint, in
  the test command's clippy step, holds the workspace's own code to it).

Reads `cargo metadata`; exit status 1, naming each problem, when one is found.

    python3 scripts/check-metadata.py
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARIES = ["outbox", "pipeline-core", "relay", "consumer", "pipeline-operator"]
FIELDS = ["description", "license", "rust_version", "readme", "keywords", "categories"]


def version(text):
    parts = [int(part) for part in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def main():
    host = next(
        line.split(": ", 1)[1]
        for line in subprocess.run(
            ["rustc", "-vV"], capture_output=True, text=True, check=True
        ).stdout.splitlines()
        if line.startswith("host: ")
    )
    metadata = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--filter-platform", host],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    problems = []
    licence = (ROOT / "LICENSE").read_text() if (ROOT / "LICENSE").exists() else ""
    if "Apache License" not in licence or "Version 2.0, January 2004" not in licence:
        problems.append("LICENSE is not the Apache License 2.0 the crates declare")
    members = set(metadata["workspace_members"])
    packages = {p["id"]: p for p in metadata["packages"]}
    ours = {p["name"]: p for i, p in packages.items() if i in members}
    for name in LIBRARIES:
        package = ours.get(name)
        if package is None:
            problems.append(f"no workspace crate named {name}")
            continue
        missing = [f for f in FIELDS if not package.get(f)]
        if missing:
            problems.append(f"{name} lacks {', '.join(missing)}")
        if package.get("license") != "Apache-2.0":
            problems.append(f"{name}'s licence is {package.get('license')}, not Apache-2.0")
    declared = {p.get("rust_version") for p in ours.values()}
    if len(declared) != 1 or None in declared:
        problems.append(f"the crates declare different minimum Rust versions: {sorted(map(str, declared))}")
    workspace_msrv = max((version(v) for v in declared if v), default=(0,))
    built = {node["id"] for node in metadata["resolve"]["nodes"]}
    needed = max(
        (
            (version(p["rust_version"]), p["name"])
            for i, p in packages.items()
            if i in built and i not in members and p.get("rust_version")
        ),
        default=((0,), ""),
    )
    if needed[0] > workspace_msrv:
        shown = ".".join(map(str, needed[0]))
        problems.append(f"rust-version is below {shown}, which {needed[1]} needs")
    for problem in problems:
        print(problem)
    if problems:
        return 1
    shown = ".".join(map(str, workspace_msrv))
    print(f"LICENSE matches; {len(LIBRARIES)} libraries state their metadata; rust-version {shown} "
          f"covers every dependency (the highest: {needed[1]}, {'.'.join(map(str, needed[0]))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
