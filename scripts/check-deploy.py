#!/usr/bin/env python3
"""The deployment files, checked where no container engine or cluster runs:

- deploy/compose/compose.yaml against the Compose specification's schema (check-jsonschema's copy
  of it), and for what the stack promises: the brokers' durability settings are the ones the
  verification run's three-node cluster runs with (deploy/kafka/cluster.properties.in), the
  broker image is the Apache Kafka release the scripts test against, every long-running service
  has a health check, every start waits on a condition, only the `migrate` step migrates, and
  Prometheus scrapes the jobs the alert rules and the dashboard name;
- deploy/kubernetes (both kustomizations) against the Kubernetes API's schemas
  (kubernetes-validate, --strict), every file listed in its kustomization, and every Deployment
  with liveness and readiness probes, CPU and memory requests, a memory limit, a grace period at
  least as long as the part needs to finish its work, no migration of its own, and a
  PodDisruptionBudget that selects it;
- deploy/docker/Dockerfile with hadolint, its build stage running the test command's release
  build, and its runtime stage holding a package for every shared library the release binaries
  link (ldd); its health check script against a live HTTP server;
- deploy/systemd's units with `systemd-analyze verify`.

Needs PyYAML, check-jsonschema, kubernetes-validate and hadolint on PATH: scripts/lib.sh
ensure_deploy_checkers installs them in a virtual environment and the test command runs this
with its python. Exit status 1, naming each problem, when one is found.

    python3 scripts/check-deploy.py [--bin-dir target/release]
"""
import argparse
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PROBLEMS = []

# The grace period each kind of Deployment needs at least: the relay's delivery timeout (30 s)
# plus the mark; a consumer's batch transaction, offset commit and leaving the group.
LEAST_GRACE = {"order-relay": 45, "order-consumer": 60, "order-service": 15, "order-console": 5}
# Runtime packages that hold each shared library the binaries link (Debian bookworm).
LIBRARY_PACKAGES = {
    "libssl.so.3": "libssl3",
    "libcrypto.so.3": "libssl3",
    "libz.so.1": "zlib1g",
    "libgcc_s.so.1": "libgcc-s1",
    "libc.so.6": "libc6",
    "libm.so.6": "libc6",
    "ld-linux-x86-64.so.2": "libc6",
    "ld-linux-aarch64.so.1": "libc6",
}
# Packages every Debian image has (Priority: required).
BASE_PACKAGES = {"libc6", "libgcc-s1", "zlib1g"}
BINARIES = ["producer", "relay", "consumer", "pipeline"]


def problem(where, what):
    PROBLEMS.append(f"{where}: {what}")


def run(command, where):
    """Runs `command`; a non-zero exit is a problem, reported with its output."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()
        problem(where, f"{' '.join(command[:2])} failed:\n{output}")
    return done


def properties(path):
    """key=value lines of a Java properties file."""
    pairs = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            pairs[key.strip()] = value.strip()
    return pairs


def kafka_version():
    text = (DEPLOY / "kafka" / "pom.xml").read_text()
    return re.search(r"<kafka.version>([^<]+)</kafka.version>", text).group(1)


def check_compose():
    path = DEPLOY / "compose" / "compose.yaml"
    where = str(path.relative_to(ROOT))
    run(["check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)], where)
    compose = yaml.safe_load(path.read_text())
    services = compose["services"]

    # The brokers: the verification cluster's durability settings, the tested release.
    cluster = properties(DEPLOY / "kafka" / "cluster.properties.in")
    must_match = [
        "default.replication.factor",
        "min.insync.replicas",
        "unclean.leader.election.enable",
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "transaction.state.log.min.isr",
    ]
    brokers = {name: s for name, s in services.items() if "kafka" in s.get("image", "")}
    if len(brokers) != 3:
        problem(where, f"{len(brokers)} Kafka brokers, not 3")
    ids = set()
    for name, broker in brokers.items():
        env = broker.get("environment", {})
        image = broker["image"]
        if not image.startswith("apache/kafka:") or image.split(":")[1] != kafka_version():
            problem(where, f"{name}: image {image}, not apache/kafka:{kafka_version()}")
        for key in must_match:
            variable = "KAFKA_" + key.upper().replace(".", "_")
            if str(env.get(variable)) != cluster[key]:
                problem(where, f"{name}: {variable}={env.get(variable)}, the verification "
                        f"cluster runs {key}={cluster[key]}")
        if env.get("KAFKA_PROCESS_ROLES") != cluster["process.roles"]:
            problem(where, f"{name}: not a KRaft broker and controller")
        ids.add(env.get("KAFKA_NODE_ID"))
    if len(ids) != len(brokers):
        problem(where, f"broker node ids repeat: {sorted(map(str, ids))}")

    # Health checks and start order.
    one_off = {"migrate", "topics"}
    for name, service in services.items():
        if name not in one_off and "healthcheck" not in service:
            problem(where, f"{name}: no health check")
        depends = service.get("depends_on", {})
        if isinstance(depends, list):
            problem(where, f"{name}: depends_on without conditions")
            continue
        for other, how in depends.items():
            if other not in services:
                problem(where, f"{name}: depends on unknown service {other}")
            wanted = ("service_completed_successfully" if other in one_off
                      else "service_healthy")
            if how.get("condition") != wanted:
                problem(where, f"{name}: waits on {other} with {how.get('condition')}, "
                        f"not {wanted}")
        if service.get("image", "").startswith("${PIPELINE_IMAGE"):
            migrates = service.get("environment", {}).get("DATABASE_MIGRATE")
            if (migrates == "true") != (name == "migrate"):
                problem(where, f"{name}: DATABASE_MIGRATE={migrates}")
            if name not in one_off and not {"migrate", "topics"} <= set(depends):
                problem(where, f"{name}: starts before the migrations and the topics")
    for name in ("relay", "consumer-inventory", "consumer-notification"):
        if services.get(name, {}).get("deploy", {}).get("replicas", 1) < 2:
            problem(where, f"{name}: fewer than two instances")

    # Prometheus: the jobs the alert rules and the dashboard select on.
    scrape = yaml.safe_load((DEPLOY / "compose" / "prometheus.yml").read_text())
    reference = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in scrape["scrape_configs"]}
    wanted = {job["job_name"] for job in reference["scrape_configs"]}
    if jobs != wanted:
        problem(where, f"Prometheus scrapes jobs {sorted(jobs)}, the rules expect {sorted(wanted)}")


def documents(path):
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def check_kubernetes():
    objects = []
    for kustomization in (DEPLOY / "kubernetes").rglob("kustomization.yaml"):
        folder = kustomization.parent
        where = str(folder.relative_to(ROOT))
        listed = set(yaml.safe_load(kustomization.read_text())["resources"])
        present = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
        if listed != present:
            problem(where, f"kustomization lists {sorted(listed)}, the folder has "
                    f"{sorted(present)}")
        for name in sorted(present):
            path = folder / name
            run(["kubernetes-validate", "--strict", "--quiet", str(path)],
                str(path.relative_to(ROOT)))
            objects.extend(documents(path))

    config = next((o for o in objects if o["kind"] == "ConfigMap"), None)
    if config is None or config["data"].get("DATABASE_MIGRATE") != "false":
        problem("deploy/kubernetes", "the ConfigMap does not keep replicas from migrating")
    if not any(o["kind"] == "Secret" for o in objects):
        problem("deploy/kubernetes", "no Secret")
    if not any(o["kind"] == "Job" and "migrate" in o["metadata"]["name"] for o in objects):
        problem("deploy/kubernetes", "no migration Job")
    if not any(o["kind"] == "NetworkPolicy" and o["spec"]["podSelector"] == {}
               and set(o["spec"]["policyTypes"]) == {"Ingress", "Egress"} for o in objects):
        problem("deploy/kubernetes", "no NetworkPolicy denying what the others do not allow")
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        name = deployment["metadata"]["name"]
        where = f"deploy/kubernetes Deployment {name}"
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        pod = deployment["spec"]["template"]["spec"]
        kind = labels["app.kubernetes.io/name"]
        if pod.get("terminationGracePeriodSeconds", 30) < LEAST_GRACE.get(kind, 30):
            problem(where, f"grace period {pod.get('terminationGracePeriodSeconds')} s, "
                    f"needs {LEAST_GRACE.get(kind)}")
        if not any(set(b["spec"]["selector"]["matchLabels"].items()) <= set(labels.items())
                   for b in budgets):
            problem(where, "no PodDisruptionBudget selects it")
        for container in pod["containers"]:
            for probe in ("livenessProbe", "readinessProbe"):
                if probe not in container:
                    problem(where, f"{container['name']}: no {probe}")
            resources = container.get("resources", {})
            if not {"cpu", "memory"} <= set(resources.get("requests", {})):
                problem(where, f"{container['name']}: no CPU and memory requests")
            if "memory" not in resources.get("limits", {}):
                problem(where, f"{container['name']}: no memory limit")
            for variable in container.get("env", []):
                if variable["name"] == "DATABASE_MIGRATE" and variable.get("value") != "false":
                    problem(where, f"{container['name']}: migrates at start-up")


def check_dockerfile(bin_dir):
    path = DEPLOY / "docker" / "Dockerfile"
    where = str(path.relative_to(ROOT))
    run(["hadolint", "--no-color", "--config", str(DEPLOY / "docker" / ".hadolint.yaml"), str(path)], where)
    text = path.read_text()
    test_command = (ROOT / "scripts" / "test.sh").read_text()
    if not re.search(r"cargo build --release --locked --workspace --bins", text):
        problem(where, "the build stage does not run the release build of the workspace's binaries")
    if "cargo build --release --workspace --bins" not in test_command:
        problem(where, "the test command no longer runs the release build the image runs")
    stages = re.split(r"^FROM ", text, flags=re.M)
    runtime = stages[-1]
    installed = set(BASE_PACKAGES)
    for command in re.findall(r"apt-get install ([^&\n]+)", runtime):
        installed.update(w for w in command.split() if not w.startswith("-"))
    for binary in BINARIES:
        if not re.search(rf"\b{binary}\b", stages[-2] if len(stages) > 2 else ""):
            problem(where, f"the build stage does not copy out {binary}")
        path_to = Path(bin_dir) / binary
        if not path_to.exists():
            problem(where, f"{path_to} is missing: build the release binaries first")
            continue
        linked = subprocess.run(["ldd", str(path_to)], capture_output=True, text=True).stdout
        for library in re.findall(r"^\s*(\S+\.so[.\d]*)\s", linked, flags=re.M):
            library = Path(library).name
            if library.startswith("linux-vdso"):
                continue
            package = LIBRARY_PACKAGES.get(library)
            if package is None:
                problem(where, f"{binary} links {library}, which no known package of the "
                        "runtime stage holds")
            elif package not in installed:
                problem(where, f"{binary} links {library}: the runtime stage lacks {package}")
    if not re.search(r"^USER (?!0\b|root\b)", runtime, flags=re.M):
        problem(where, "the runtime stage runs as root")
    if "HEALTHCHECK" not in runtime:
        problem(where, "the runtime stage has no health check")


def check_healthcheck():
    """The image's health check against a server answering 200 on /healthz and 404 elsewhere, and
    against a closed port."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    script = DEPLOY / "docker" / "healthcheck"
    where = str(script.relative_to(ROOT))
    port = server.server_address[1]
    cases = [
        (f"127.0.0.1:{port}", "/healthz", 0),
        (f"127.0.0.1:{port}", "/readyz", 1),
    ]
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        cases.append((f"127.0.0.1:{closed.getsockname()[1]}", "/healthz", 1))
        for addr, path, wanted in cases:
            done = subprocess.run(["bash", str(script)], capture_output=True,
                                  env={"HEALTH_ADDR": addr, "HEALTH_PATH": path}, timeout=10)
            if (done.returncode == 0) != (wanted == 0):
                problem(where, f"GET {path} on {addr}: exit status {done.returncode}")
    server.shutdown()


def check_systemd():
    """`systemd-analyze verify` of each unit, in a root where the binaries they start exist."""
    if shutil.which("systemd-analyze") is None:
        problem("deploy/systemd", "systemd-analyze is missing")
        return
    with tempfile.TemporaryDirectory() as scratch:
        units = Path(scratch)
        for unit in sorted((DEPLOY / "systemd").glob("*.service")):
            text = unit.read_text()
            for binary in re.findall(r"^ExecStart=(\S+)", text, flags=re.M):
                stand_in = units / "bin" / Path(binary).name
                stand_in.parent.mkdir(exist_ok=True)
                stand_in.write_text("#!/bin/sh\n")
                stand_in.chmod(0o755)
                text = text.replace(binary, str(stand_in))
            text = re.sub(r"^EnvironmentFile=", "EnvironmentFile=-", text, flags=re.M)
            name = unit.name.replace("@.service", "@inventory.service")
            (units / name).write_text(text)
        checked = sorted(p for p in units.glob("*.service"))
        done = subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, checked)],
                              capture_output=True, text=True)
        # Lines about the host's own units (systemd-analyze loads their dependencies too) are
        # not about these files.
        ours = [line for line in (done.stdout + done.stderr).splitlines()
                if scratch in line and "is not executable" not in line]
        if done.returncode != 0 or ours:
            problem("deploy/systemd", "systemd-analyze verify:\n" + "\n".join(ours or
                    [(done.stdout + done.stderr).strip()]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bin-dir", default=str(ROOT / "target" / "release"))
    args = parser.parse_args()
    check_compose()
    check_kubernetes()
    check_dockerfile(args.bin_dir)
    check_healthcheck()
    check_systemd()
    if PROBLEMS:
        print("deployment files:", *PROBLEMS, sep="\n  ", file=sys.stderr)
        sys.exit(1)
    print("deployment files: compose, Kubernetes, Dockerfile and systemd units check out")


if __name__ == "__main__":
    main()
