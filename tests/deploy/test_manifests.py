"""deploy/k8s checked offline: each build (tests/deploy/manifests.py) validates against the Kubernetes 1.30
schemas (strict), container args parse with the services' own parsers, probes and annotations name the
ports the args open, Services and PDBs select real pods, every prefix replica's owner is persistent on the
engines, and auth files are mounted Secret keys the real token parser accepts. Each check has a negative
control; the numbers are test_rollout.py's and test_resources.py's."""

from __future__ import annotations

import copy
import dataclasses
import shutil
from pathlib import Path

import kubernetes_validate
import pytest

from engine_service.api.owners import PERSISTENT_OWNER, PersistentOwners
from engine_service.serving.drain import LIVENESS_SERVICE
from engine_service.serving.tokens import TokenTable, read_token_file
from protos import engine_pb2, prefix_pb2
from tests.deploy.manifests import (
    BUILDS,
    CLIENT_TOKEN,
    K8S,
    REPLICA_TOKENS,
    TOKEN_FILES,
    Build,
    arg,
    containers,
    layout_problems,
    load,
    mutate,
    parse_container_args,
    pod_names,
    quantity,
    set_arg,
    workloads,
)

K8S_VERSION = "1.30"
SERVED = {
    "forkline-engine": engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name,
    "forkline-prefix": prefix_pb2.DESCRIPTOR.services_by_name["PrefixCache"].full_name,
}
FILE_FLAGS = ("auth_tokens", "engine_token_file", "tls_cert", "tls_key", "tls_client_ca", "engine_tls_ca")


def pod_spec(w: dict) -> dict:
    return w["spec"]["template"]["spec"]


def pod_meta(w: dict) -> dict:
    return w["spec"]["template"]["metadata"]


def pods_of(docs: list[dict], selector: dict) -> list[dict]:
    return [w for w in workloads(docs) if selector and selector.items() <= pod_meta(w)["labels"].items()]


class Problems(list):
    """Problems of ``where`` (a name the messages start with)."""

    def __init__(self, where: str = "") -> None:
        super().__init__()
        self.where = where

    def need(self, ok: object, problem: str) -> None:
        if not ok:
            self.append(f"{self.where}: {problem}" if self.where else problem)


def container_problems(build: Build) -> list[str]:
    """Args parse; ports, probes and Prometheus annotations follow them; resources, user, image."""
    problems = []
    for w, c in containers(build.docs):
        a, found = parse_container_args(c)
        problems += found
        if a is None:
            continue
        container = Problems(c["name"])
        need = container.need
        ports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        listens = {"grpc": a.port, "metrics": a.metrics_port, "http": getattr(a, "http_port", None)}
        need(ports == {k: v for k, v in listens.items() if v}, f"container ports {ports}, args {listens}")
        served = SERVED[c["command"][0]]
        asks = {}
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c.get(kind, {}).get("grpc", {})
            need(probe.get("port") == a.port, f"{kind} is not a gRPC probe of port {a.port}")
            asks[kind] = probe.get("service", "")
            need(asks[kind] in ("", served, LIVENESS_SERVICE), f"{kind}: not a served service")
        # readiness: NOT_SERVING while draining or without engines
        need(asks["readinessProbe"] == served, f"readinessProbe must ask for {served}")
        # liveness: NOT_SERVING when the work stops, SERVING while draining (a draining pod stays)
        need(asks["livenessProbe"] == LIVENESS_SERVICE, f"livenessProbe must ask for {LIVENESS_SERVICE}")
        notes = pod_meta(w).get("annotations", {})
        scrape = (notes.get("prometheus.io/scrape"), notes.get("prometheus.io/port"))
        need(scrape == ("true", str(a.metrics_port)), "prometheus annotations do not name --metrics_port")
        for kind in ("cpu", "memory"):
            req, lim = (
                quantity(c.get("resources", {}).get(f, {}).get(kind, 0)) for f in ("requests", "limits")
            )
            need(0 < req <= lim, f"{kind} request above its limit or unset")
        user = pod_spec(w).get("securityContext", {})
        need(user.get("runAsNonRoot") and user.get("runAsUser", 0) != 0, "not run as a non-root user")
        tag = c["image"].rsplit("/", 1)[-1].partition(":")[2]
        need(tag not in ("", "latest"), f"image {c['image']} has no pinned tag")
        problems += container
    return problems


def selector_problems(build: Build) -> list[str]:
    """Workloads select their pods and have a PDB; a StatefulSet's governing Service is headless and
    publishes ready pods only; Services and PDBs select pods on their ports; one namespace, no duplicates."""
    docs, problems = build.docs, Problems()
    services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
    pdbs = [d["spec"]["selector"]["matchLabels"] for d in docs if d["kind"] == "PodDisruptionBudget"]
    for w in workloads(docs):
        name = w["metadata"]["name"]
        problems.need(
            w in pods_of(docs, w["spec"]["selector"]["matchLabels"]),
            f"{name}: selector does not match its own pod labels",
        )
        problems.need(any(w in pods_of(docs, s) for s in pdbs), f"{name}: no PodDisruptionBudget")
        governing = services.get(w["spec"].get("serviceName"), {})
        if w["kind"] == "StatefulSet":
            problems.need(governing.get("clusterIP") == "None", f"{name}: serviceName is no headless Service")
            problems.need(not governing.get("publishNotReadyAddresses"), f"{name}: not-ready pods published")
    for d in (d for d in docs if d["kind"] in ("Service", "PodDisruptionBudget")):
        selected = pods_of(docs, d["spec"]["selector"].get("matchLabels", d["spec"]["selector"]))
        problems.need(selected, f"{d['kind']} {d['metadata']['name']} selects no pods")
        for w in selected if d["kind"] == "Service" else []:
            named = {x for c in pod_spec(w)["containers"] for p in c.get("ports", []) for x in p.values()}
            for port in d["spec"]["ports"]:
                problems.need(
                    port["targetPort"] in named, f"{d['metadata']['name']}: targetPort {port['targetPort']}"
                )
    namespaces = [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"]
    one = namespaces == [build.namespace] and not any("namespace" in d["metadata"] for d in docs)
    problems.need(one, f"not every resource is in the kustomization's namespace {build.namespace}")
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    return problems + [f"{k} defined twice" for k in {k for k in keys if keys.count(k) > 1}]


def wiring_problems(build: Build) -> list[str]:
    """A prefix service's --engines is the engines' headless Service and gRPC port; its owner ids are
    persistent on every engine; no two live pods share an owner id."""
    docs, problems = build.docs, Problems()
    engines = [parse_container_args(c)[0] for _, c in containers(docs) if c["command"] == ["forkline-engine"]]
    persistent = [
        PersistentOwners(
            e.persistent_owner or ([] if e.persistent_owner_prefix else [PERSISTENT_OWNER]),
            e.persistent_owner_prefix or (),
        )
        for e in engines
        if e is not None
    ]
    services = {
        f"{d['metadata']['name']}.{build.namespace}.svc.cluster.local": d["spec"]
        for d in docs
        if d["kind"] == "Service"
    }
    for w, c in ((w, c) for w, c in containers(docs) if c["command"] == ["forkline-prefix"]):
        target = arg(c, "--engines")
        host, _, port = target.removeprefix("dns:///").rpartition(":")
        svc = services.get(host, {})
        problems.need(svc, f"--engines {target!r} names no Service")
        problems.need(svc.get("clusterIP") == "None", f"--engines {target!r}: not headless (one virtual IP)")
        grpc = [p["port"] for p in svc.get("ports", []) if p["name"] == "grpc"]
        serving = {pod_spec(e)["containers"][0]["command"][0] for e in pods_of(docs, svc.get("selector"))}
        problems.need(
            grpc == [int(port)] and serving == {"forkline-engine"},
            f"--engines {target!r}: not the engines' gRPC port",
        )
        owner, name = arg(c, "--owner", "prefix-service"), w["metadata"]["name"]
        if w["kind"] == "Deployment":  # its pods share one --owner: one pod at a time
            one = "$(" not in owner and w["spec"].get("replicas", 1) == 1
            problems.need(
                one and w["spec"].get("strategy", {}).get("type") == "Recreate",
                f"{name}: pods share --owner {owner}",
            )
        else:
            env = {
                e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
                for e in c.get("env", [])
            }
            problems.need(
                (owner, env.get("POD_NAME")) == ("$(POD_NAME)", "metadata.name"),
                f"{name}: replicas need --owner $(POD_NAME)",
            )
        owners = set(pod_names(w)) if w["kind"] == "StatefulSet" else {owner}
        covered = persistent and all(o in p for o in owners for p in persistent)
        problems.need(
            covered, f"owners {sorted(owners)} are not all --persistent_owner on the engines ({persistent})"
        )
    return problems


def mounted_files(build: Build, tmp: Path) -> tuple[dict[tuple[str, str], Path], list[str]]:
    """Each file flag's Secret key, written under tmp where the kubelet would mount it, by (pod, flag)."""
    files, problems = {}, []
    for w, c in containers(build.docs):
        volumes = {v["name"]: v.get("secret", {}) for v in w["spec"]["template"]["spec"].get("volumes", [])}
        for pod, flag in ((pod, flag) for pod in pod_names(w) for flag in FILE_FLAGS):
            path = getattr(parse_container_args(c, pod)[0], flag, None)
            folder, _, relative = (path or "").rpartition("/")
            mount = next((m for m in c.get("volumeMounts", []) if m["mountPath"].rstrip("/") == folder), {})
            volume = volumes.get(mount.get("name"), {})
            secret = build.secrets.get(volume.get("secretName"))
            key = {i["path"]: i["key"] for i in volume.get("items", [])}.get(
                relative, "" if volume.get("items") else relative
            )
            if path is None:
                continue
            if not mount.get("readOnly") or secret is None:
                problems.append(f"{c['name']}: --{flag} {path} is not in a read-only mounted Secret")
            elif key not in secret:
                problems.append(f"{c['name']}: --{flag} {path}: the Secret has no such key")
            else:
                files[pod, flag] = tmp / pod / relative
                files[pod, flag].parent.mkdir(parents=True, exist_ok=True)
                files[pod, flag].write_text(secret[key], encoding="utf-8")
    return files, problems


def auth_problems(build: Build, tmp: Path) -> list[str]:
    """Auth on both services or neither; the token files parse with the services' own parser and map each
    prefix replica's engine token to its --owner."""
    files, problems = mounted_files(build, tmp)
    pods = {pod: c for w, c in containers(build.docs) for pod in pod_names(w)}
    tables = {pod: TokenTable.load(str(path)) for (pod, flag), path in files.items() if flag == "auth_tokens"}
    if tables and set(tables) != set(pods):
        problems.append(f"auth is on for {sorted(tables)} only: turn it on for both services or neither")
    for pod, path in ((pod, path) for (pod, flag), path in files.items() if flag == "engine_token_file"):
        token, owner = read_token_file(str(path)), parse_container_args(pods[pod], pod)[0].owner
        problems += [
            f"{other}'s token file does not map {pod}'s engine token to {owner}"
            for other, table in tables.items()
            if other != pod and table.owner_for(token) != owner
        ]
    return problems


def problems(build: Build, tmp: Path) -> list[str]:
    checks = (container_problems, selector_problems, wiring_problems)
    return [p for check in checks for p in check(build)] + auth_problems(build, tmp)


@pytest.fixture(scope="module")
def builds() -> dict[str, Build]:
    return {name: load(name) for name in BUILDS}


def test_the_builds_are_base_and_the_auth_overlay_in_the_layout_this_reading_covers() -> None:
    found = sorted(str(p.parent.relative_to(K8S)) for p in K8S.rglob("kustomization.yaml"))
    assert found == ["base", "components/auth", "overlays/auth"] and layout_problems() == []


@pytest.mark.parametrize("name", BUILDS)
def test_each_build_validates_and_passes_every_check(builds, name, tmp_path) -> None:
    docs = builds[name].docs
    assert {d["kind"] for d in docs} >= {"Namespace", "StatefulSet", "Service", "PodDisruptionBudget"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError
    assert problems(builds[name], tmp_path) == []


def test_the_auth_overlay_mounts_token_files_the_services_accept(builds, tmp_path) -> None:
    files = mounted_files(builds["overlays/auth"], tmp_path)[0]
    assert {flag for _, flag in files} == {"auth_tokens", "engine_token_file"}
    assert {pod for pod, flag in files if flag == "engine_token_file"} == set(REPLICA_TOKENS)
    assert not mounted_files(builds["base"], tmp_path / "base")[0]  # the base runs without auth


def test_control_layout_mistakes_are_caught(tmp_path) -> None:
    shutil.copytree(K8S, tmp_path / "k8s")
    (tmp_path / "k8s/base/stray.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    (tmp_path / "k8s/base/prefix-pdb.yaml").unlink()
    auth = tmp_path / "k8s/components/auth/kustomization.yaml"
    text = auth.read_text().replace("- tokens.txt", "- tokens.yaml").replace("Hash: true", "Hash: false")
    auth.write_text(text + "commonLabels: {a: b}\n")
    found = "\n".join(layout_problems(tmp_path / "k8s"))
    for says in (
        "stray.yaml is not listed",
        "prefix-pdb.yaml does not exist",
        "tokens.yaml is not a git-ignored",
        "hashed name",
        "commonLabels is not covered",
    ):
        assert says in found


@pytest.mark.parametrize(
    "file,old,new,says",
    [
        ("engine-auth.yaml", "op: add", "op: replace", "not an append"),
        ("kustomization.yaml", "name: forkline-engine", "name: other", "not one resource of the base"),
    ],
)
def test_control_a_patch_this_reading_does_not_cover_fails_to_load(tmp_path, file, old, new, says) -> None:
    shutil.copytree(K8S, tmp_path / "k8s")
    path = tmp_path / "k8s/components/auth" / file
    path.write_text(path.read_text().replace(old, new, 1))
    with pytest.raises(AssertionError, match=says):
        load(tmp_path / "k8s/overlays/auth")


def test_control_schema_violations_are_rejected(builds) -> None:
    engine = next(d for d in builds["base"].docs if d["kind"] == "StatefulSet")
    c = lambda e: e["spec"]["template"]["spec"]["containers"][0]  # noqa: E731
    for edit in (
        lambda e: e["spec"].update(replica=e["spec"].pop("replicas")),
        lambda e: c(e)["ports"][0].update(containerPort="fifty"),
        lambda e: c(e)["readinessProbe"]["grpc"].update(svc="x"),
    ):
        broken = copy.deepcopy(engine)
        edit(broken)
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def _as_deployment(w: dict, c: dict) -> None:
    w["kind"] = "Deployment"
    set_arg("--owner", "prefix-service")(w, c)


ENGINE, PREFIX, DNS = "forkline-engine", "forkline-prefix", "dns:///{}.svc.cluster.local:{}"
CONTROLS = [  # (build, workload, edit, what a problem says)
    ("base", ENGINE, lambda w, c: c["args"].extend(["--max_sesions", "8"]), "unrecognized arguments"),
    ("base", ENGINE, lambda w, c: c["args"].extend(["--cache_kind", "paged"]), "invalid choice"),
    ("base", ENGINE, lambda w, c: c["args"].extend(["--grace", "soon"]), "invalid float value"),
    ("base", PREFIX, lambda w, c: c["args"].append("$(NODE_NAME)"), "names no env var"),
    ("base", ENGINE, lambda w, c: c.update(command=["forkline"]), "is not one of"),
    ("base", ENGINE, lambda w, c: c["readinessProbe"]["grpc"].update(port=50052), "not a gRPC probe of port"),
    ("base", ENGINE, lambda w, c: c["readinessProbe"]["grpc"].pop("service"), "readinessProbe must ask"),
    ("base", ENGINE, lambda w, c: c["livenessProbe"]["grpc"].pop("service"), "livenessProbe must ask"),
    ("base", ENGINE, lambda w, c: c["startupProbe"]["grpc"].update(service="x"), "not a served service"),
    ("base", ENGINE, set_arg("--metrics_port", "9999"), "container ports"),
    (
        "base",
        ENGINE,
        lambda w, c: pod_meta(w)["annotations"].update({"prometheus.io/port": "1"}),
        "prometheus",
    ),
    ("base", ENGINE, lambda w, c: c["resources"]["requests"].update(memory="8Gi"), "memory request"),
    ("base", ENGINE, lambda w, c: c.update(image="forkline:latest"), "no pinned tag"),
    ("base", ENGINE, lambda w, c: pod_spec(w)["securityContext"].update(runAsUser=0), "non-root"),
    (
        "base",
        ENGINE,
        lambda w, c: pod_meta(w)["labels"].update({"app.kubernetes.io/name": "x"}),
        "selects no pods",
    ),
    ("base", ENGINE, lambda w, c: w["spec"]["selector"]["matchLabels"].update(x="y"), "its own pod labels"),
    ("base", ENGINE, lambda w, c: c["ports"][0].update(name="rpc"), "targetPort grpc"),
    ("base", PREFIX, lambda w, c: w["spec"].update(serviceName="forkline-prefix"), "no headless Service"),
    ("base", ENGINE, set_arg("--persistent_owner_prefix", "someone-else-"), "not all --persistent_owner"),
    ("base", ENGINE, set_arg("--persistent_owner_prefix", "forkline-prefix-0"), "not all --persistent_owner"),
    ("base", PREFIX, _as_deployment, "pods share --owner"),
    ("base", PREFIX, set_arg("--owner", "prefix-service"), "$(POD_NAME)"),
    ("base", PREFIX, set_arg("--engines", DNS.format("forkline-engine.default", 50051)), "names no Service"),
    ("base", PREFIX, set_arg("--engines", DNS.format("forkline-engine.forkline", 9091)), "gRPC port"),
    ("base", PREFIX, set_arg("--engines", DNS.format("forkline-prefix.forkline", 50052)), "not headless"),
    ("base", PREFIX, lambda w, c: w["metadata"].update(namespace="default"), "kustomization's namespace"),
    ("base", PREFIX, lambda w, c: w["metadata"].update(name=ENGINE), "defined twice"),
    ("overlays/auth", PREFIX, lambda w, c: c["volumeMounts"].pop(), "not in a read-only mounted Secret"),
    (
        "overlays/auth",
        ENGINE,
        lambda w, c: pod_spec(w)["volumes"][1]["secret"]["items"][0].update(key="t"),
        "no such key",
    ),
    (
        "overlays/auth",
        ENGINE,
        lambda w, c: c["args"].__delitem__(slice(-2, None)),
        "both services or neither",
    ),
]


@pytest.mark.parametrize("build,name,edit,says", CONTROLS, ids=[f"{c[1]}-{c[3]}" for c in CONTROLS])
def test_control_a_broken_copy_is_caught(builds, tmp_path, build, name, edit, says) -> None:
    broken = dataclasses.replace(builds[build], docs=mutate(builds[build].docs, name, edit))
    found = problems(broken, tmp_path)
    assert any(says in p for p in found), found


def test_control_a_token_file_that_maps_a_replica_to_another_owner_is_caught(tmp_path) -> None:
    swapped = load("overlays/auth", {**TOKEN_FILES, "forkline-prefix-1.token": f"{CLIENT_TOKEN}\n"})
    assert any("does not map" in p for p in auth_problems(swapped, tmp_path))
