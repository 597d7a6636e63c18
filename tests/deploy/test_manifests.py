"""deploy/: the Kubernetes manifests and the Dockerfile, checked offline.

Every kustomization under deploy/k8s (base and overlays) is rendered by a small renderer below that
follows exactly the kustomize features the manifests use (resources, components, namespace, JSON
patches, strategic-merge deletes, secretGenerator without hash suffix) and refuses any other. Each
rendered resource is validated against the Kubernetes 1.30 schemas (kubernetes-validate, strict: unknown
fields fail), and the set is checked for what the schemas cannot see: container args parse with the
services' real argparse parsers, probes and annotations name the ports the args open, Services and PDBs
select real pods, the termination grace covers the drain, every prefix replica's owner is a persistent
owner on the engines, auth files resolve to mounted secret keys that the real token parser accepts.
Each check has a negative control: a broken copy of the real manifests is caught by the same check.
The numbers (grace, preStop, probes, memory) are recomputed from docs/DEPLOY.md's measurements in
test_rollout.py and test_resources.py; the image recipe is test_image.py's.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import io
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from engine_service import __main__ as engine_main
from engine_service.api.owners import PERSISTENT_OWNER, PersistentOwners
from engine_service.serving.drain import LIVENESS_SERVICE
from engine_service.serving.tokens import TokenTable, read_token_file
from prefix_service import __main__ as prefix_main
from protos import engine_pb2, prefix_pb2

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.30"
PARSERS: dict[str, Callable] = {
    "forkline-engine": engine_main.build_parser,
    "forkline-prefix": prefix_main.build_parser,
}
SERVED = {
    "forkline-engine": engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name,
    "forkline-prefix": prefix_pb2.DESCRIPTOR.services_by_name["PrefixCache"].full_name,
}
TEST_CLIENT_TOKEN = "alice-token-0123456789abcdef"
TEST_REPLICA_TOKENS = {f"forkline-prefix-{i}": f"replica-{i}-token-0123456789abcdef" for i in range(2)}
TEST_TOKEN_FILES = {
    "tokens.txt": f"{TEST_CLIENT_TOKEN} alice\n"
    + "".join(f"{token} {owner}\n" for owner, token in TEST_REPLICA_TOKENS.items()),
    **{f"{owner}.token": f"{token}\n" for owner, token in TEST_REPLICA_TOKENS.items()},
}
CLUSTER_SCOPED = {"Namespace"}


# --- a renderer for the kustomize subset the manifests use ------------------------------------------------

KNOWN_KEYS = {"apiVersion", "kind", "namespace", "resources", "components", "patches", "secretGenerator"}


class RenderError(Exception):
    pass


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def kustomization(folder: Path) -> dict:
    path = folder / "kustomization.yaml"
    if not path.is_file():
        raise RenderError(f"{folder}: no kustomization.yaml")
    k = yaml.safe_load(path.read_text(encoding="utf-8"))
    unknown = set(k) - KNOWN_KEYS
    if unknown:
        raise RenderError(f"{path}: keys this renderer does not implement: {sorted(unknown)}")
    return k


def render(folder: Path, generator_files: Mapping[str, str] | None = None) -> list[dict]:
    """The resources ``kustomize build folder`` produces (for the features in KNOWN_KEYS)."""
    k = kustomization(folder)
    if k["kind"] != "Kustomization":
        raise RenderError(f"{folder}: a {k['kind']} is not built on its own")
    return _build(folder, k, [], generator_files or {})


def _build(folder: Path, k: dict, docs: list[dict], generator_files: Mapping[str, str]) -> list[dict]:
    docs = list(docs)
    for entry in k.get("resources", []):
        path = (folder / entry).resolve()
        if path.is_dir():
            docs += render(path, generator_files)
        elif path.is_file():
            docs += load_docs(path)
        else:
            raise RenderError(f"{folder}: resource {entry} does not exist")
    for entry in k.get("components", []):
        path = (folder / entry).resolve()
        component = kustomization(path)
        if component["kind"] != "Component":
            raise RenderError(f"{path}: listed as a component but is a {component['kind']}")
        docs = _build(path, component, docs, generator_files)
    for generator in k.get("secretGenerator", []):
        docs.append(_secret(folder, generator, generator_files))
    for patch in k.get("patches", []):
        docs = _patch(folder, patch, docs)
    if "namespace" in k:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = k["namespace"]
    return docs


def _secret(folder: Path, generator: dict, generator_files: Mapping[str, str]) -> dict:
    if not generator.get("options", {}).get("disableNameSuffixHash"):
        raise RenderError(f"{folder}: secretGenerator {generator['name']}: name hashes are not implemented")
    data = {}
    for entry in generator["files"]:
        key, _, name = entry.partition("=") if "=" in entry else (entry, "", entry)
        path = folder / name
        if path.is_file():
            text = path.read_text(encoding="utf-8")
        elif name in generator_files:
            text = generator_files[name]
        else:
            raise RenderError(f"{folder}: secretGenerator file {name} is missing")
        data[key] = base64.b64encode(text.encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": generator["name"]},
        "type": "Opaque",
        "data": data,
    }


def _matches(doc: dict, target: dict) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    wanted = {"kind": doc["kind"], "name": doc["metadata"]["name"], "group": group, "version": version}
    unknown = set(target) - set(wanted)
    if unknown:
        raise RenderError(f"patch target keys not implemented: {sorted(unknown)}")
    return all(wanted[key] == value for key, value in target.items())


def _patch(folder: Path, patch: dict, docs: list[dict]) -> list[dict]:
    body = yaml.safe_load((folder / patch["path"]).read_text(encoding="utf-8"))
    if isinstance(body, list):  # RFC 6902
        hits = [d for d in docs if _matches(d, patch["target"])]
        if not hits:
            raise RenderError(f"{folder}/{patch['path']}: the target matches nothing")
        return [json_patch(d, body) if d in hits else d for d in docs]
    if body.get("$patch") == "delete":  # strategic merge: only deletion is used
        target = {"kind": body["kind"], "name": body["metadata"]["name"]}
        kept = [d for d in docs if not _matches(d, target)]
        if len(kept) == len(docs):
            raise RenderError(f"{folder}/{patch['path']}: deletes nothing")
        return kept
    raise RenderError(
        f"{folder}/{patch['path']}: strategic-merge patches other than delete are not implemented"
    )


def json_patch(doc: dict, ops: list[dict]) -> dict:
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        try:
            if isinstance(parent, list):
                index = len(parent) if last == "-" and op["op"] == "add" else int(last)
                if op["op"] == "add":
                    parent.insert(index, op["value"])
                elif op["op"] == "test":
                    if parent[index] != op["value"]:
                        raise RenderError(
                            f"test failed at {op['path']}: {parent[index]!r} != {op['value']!r}"
                        )
                elif op["op"] == "replace":
                    parent[index] = op["value"]
                elif op["op"] == "remove":
                    del parent[index]
                else:
                    raise RenderError(f"op {op['op']} not implemented")
            elif op["op"] in ("add", "replace"):
                if op["op"] == "replace" and last not in parent:
                    raise RenderError(f"replace of a missing {op['path']}")
                parent[last] = op["value"]
            elif op["op"] == "test":
                if parent[last] != op["value"]:
                    raise RenderError(f"test failed at {op['path']}: {parent[last]!r} != {op['value']!r}")
            elif op["op"] == "remove":
                del parent[last]
            else:
                raise RenderError(f"op {op['op']} not implemented")
        except (KeyError, IndexError, ValueError) as exc:
            raise RenderError(f"{op['op']} {op['path']}: {exc!r}") from None
    return doc


def builds(root: Path = K8S) -> list[Path]:
    """Every kustomization under root that is built on its own (not a component)."""
    return sorted(
        p.parent
        for p in root.rglob("kustomization.yaml")
        if yaml.safe_load(p.read_text(encoding="utf-8"))["kind"] == "Kustomization"
    )


def listing_problems(root: Path) -> list[str]:
    """Every file a kustomization names exists; every YAML file under root is named by one."""
    problems, named = [], set()
    for path in root.rglob("kustomization.yaml"):
        named.add(path.resolve())
        k = yaml.safe_load(path.read_text(encoding="utf-8"))
        entries = k.get("resources", []) + k.get("components", []) + [p["path"] for p in k.get("patches", [])]
        for entry in entries:
            target = (path.parent / entry).resolve()
            if not target.exists():
                problems.append(f"{path.relative_to(root)}: {entry} does not exist")
            named.add(target if target.is_file() else target / "kustomization.yaml")
    for path in root.rglob("*.y*ml"):
        if path.resolve() not in named:
            problems.append(f"{path.relative_to(root)} is not listed in any kustomization")
    return problems


# --- checks on a rendered set -------------------------------------------------------------------------------


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def containers(docs: list[dict]):
    for w in workloads(docs):
        for c in w["spec"]["template"]["spec"]["containers"]:
            yield w, c


def pod_names(w: dict) -> list[str]:
    """The pods a workload runs: a StatefulSet's ordinal names; one stand-in for a Deployment's."""
    if w["kind"] == "StatefulSet":
        return [f"{w['metadata']['name']}-{i}" for i in range(w["spec"].get("replicas", 1))]
    return [f"{w['metadata']['name']}-pod"]


def parse_container_args(container: dict, pod: str | None = None):
    """(the parsed argparse namespace or None, problems); ``pod``: the pod name $(POD_NAME) expands
    to (else every $(VAR) becomes VAR-value)."""
    command = container.get("command") or []
    if not command or command[0] not in PARSERS:
        return None, [f"{container['name']}: command {command} is not one of {sorted(PARSERS)}"]
    env = {e["name"] for e in container.get("env", [])}
    args, problems = [], []
    for arg in container.get("args", []):
        for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
            if var not in env:
                problems.append(f"{container['name']}: {arg} names no env var of the container")
        args.append(  # as the kubelet expands
            re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                lambda m: pod if pod is not None and m[1] == "POD_NAME" else f"{m[1]}-value",
                arg,
            )
        )
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parsed = PARSERS[command[0]]().parse_args(args)
    except SystemExit:
        return None, [
            *problems,
            f"{container['name']}: {command[0]} refuses its args: {err.getvalue().strip()}",
        ]
    return parsed, problems


def flag_problems(docs: list[dict]) -> list[str]:
    problems = []
    for _, c in containers(docs):
        problems += parse_container_args(c)[1]
    return problems


def port_problems(docs: list[dict]) -> list[str]:
    problems = []
    for w, c in containers(docs):
        parsed = parse_container_args(c)[0]
        if parsed is None:
            problems.append(f"{c['name']}: args do not parse")
            continue
        by_name = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
        wanted = {
            "grpc": parsed.port,
            "metrics": parsed.metrics_port,
            "http": getattr(parsed, "http_port", None),
        }
        wanted = {k: v for k, v in wanted.items() if v is not None}
        if by_name != wanted:
            problems.append(f"{c['name']}: container ports {by_name} but the args listen on {wanted}")
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = c.get(kind)
            if probe is None:
                problems.append(f"{c['name']}: no {kind}")
                continue
            if "grpc" not in probe:
                problems.append(f"{c['name']}: {kind} is not a gRPC health probe")
                continue
            if probe["grpc"]["port"] != parsed.port:
                problems.append(
                    f"{c['name']}: {kind} probes port {probe['grpc']['port']}, gRPC is on {parsed.port}"
                )
            service = probe["grpc"].get("service", "")
            served = SERVED[c["command"][0]]
            if kind == "readinessProbe" and service != served:
                problems.append(
                    f"{c['name']}: readiness must ask for {served} (NOT_SERVING while draining "
                    f"or without engines), asks for {service!r}"
                )
            if kind == "livenessProbe" and service != LIVENESS_SERVICE:
                problems.append(
                    f"{c['name']}: liveness must ask for {LIVENESS_SERVICE} (NOT_SERVING when the work "
                    f"stops, SERVING while draining), asks for {service!r}"
                )
            if service not in ("", served, LIVENESS_SERVICE):
                problems.append(f"{c['name']}: {kind} asks for {service!r}, which the server does not serve")
        annotations = w["spec"]["template"]["metadata"].get("annotations", {})
        if annotations.get("prometheus.io/scrape") != "true" or annotations.get("prometheus.io/port") != str(
            parsed.metrics_port
        ):
            problems.append(f"{w['metadata']['name']}: prometheus annotations do not name --metrics_port")
    return problems


def grace_problems(docs: list[dict]) -> list[str]:
    problems = []
    for w, c in containers(docs):
        parsed = parse_container_args(c)[0]
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        grace = w["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        if parsed is None or grace <= sleep + parsed.grace:
            problems.append(
                f"{w['metadata']['name']}: terminationGracePeriodSeconds {grace} does not cover "
                f"preStop {sleep} s + --grace {None if parsed is None else parsed.grace} s"
            )
        startup = c.get("startupProbe", {})
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        if parsed is not None and budget <= getattr(parsed, "engine_timeout", 0):
            problems.append(
                f"{w['metadata']['name']}: the startup probe gives up after {budget} s, before "
                f"--engine_timeout {parsed.engine_timeout} s"
            )
    return problems


def selects(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pods_selected(docs: list[dict], selector: dict, namespace: str | None) -> list[dict]:
    return [
        w
        for w in workloads(docs)
        if w["metadata"].get("namespace") == namespace
        and selects(selector, w["spec"]["template"]["metadata"]["labels"])
    ]


def selector_problems(docs: list[dict]) -> list[str]:
    problems = []
    for w in workloads(docs):
        if not selects(w["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"]):
            problems.append(f"{w['metadata']['name']}: selector does not match its own pod labels")
        if not [
            p
            for p in docs
            if p["kind"] == "PodDisruptionBudget"
            and selects(p["spec"]["selector"]["matchLabels"], w["spec"]["template"]["metadata"]["labels"])
        ]:
            problems.append(f"{w['metadata']['name']}: no PodDisruptionBudget")
    for doc in docs:
        ns = doc["metadata"].get("namespace")
        if doc["kind"] == "Service":
            targets = pods_selected(docs, doc["spec"]["selector"], ns)
            if not targets:
                problems.append(f"Service {doc['metadata']['name']} selects no pods")
            for port in doc["spec"]["ports"]:
                for w in targets:
                    cports = [
                        p for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
                    ]
                    if port["targetPort"] not in [p["name"] for p in cports] + [
                        p["containerPort"] for p in cports
                    ]:
                        problems.append(
                            f"Service {doc['metadata']['name']}: targetPort {port['targetPort']} "
                            f"is no port of {w['metadata']['name']}"
                        )
        elif doc["kind"] == "PodDisruptionBudget" and not pods_selected(
            docs, doc["spec"]["selector"]["matchLabels"], ns
        ):
            problems.append(f"PodDisruptionBudget {doc['metadata']['name']} selects no pods")
        elif doc["kind"] == "StatefulSet":
            governing = [
                s
                for s in docs
                if s["kind"] == "Service"
                and s["metadata"]["name"] == doc["spec"]["serviceName"]
                and s["metadata"].get("namespace") == ns
            ]
            if not governing or governing[0]["spec"].get("clusterIP") != "None":
                problems.append(f"StatefulSet {doc['metadata']['name']}: serviceName is no headless Service")
            elif governing[0]["spec"].get("publishNotReadyAddresses", False):
                problems.append(f"Service {doc['spec']['serviceName']} publishes pods that are not ready")
    return problems


def engine_wiring_problems(docs: list[dict]) -> list[str]:
    """The prefix service's --engines names the engines' headless Service; every prefix owner is a
    persistent owner on the engines; no two live pods share an owner id."""
    problems = []
    engines = [(w, c) for w, c in containers(docs) if c["command"][0] == "forkline-engine"]
    persistent: list[PersistentOwners] = []
    for _, c in engines:
        parsed = parse_container_args(c)[0]
        if parsed is not None:
            prefixes = tuple(parsed.persistent_owner_prefix or ())
            listed = parsed.persistent_owner or ([] if prefixes else [PERSISTENT_OWNER])
            persistent.append(PersistentOwners(listed, prefixes))
    for w, c in containers(docs):
        if c["command"][0] != "forkline-prefix":
            continue
        args = c["args"]
        target = args[args.index("--engines") + 1] if "--engines" in args else ""
        m = re.fullmatch(r"dns:///([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:(\d+)", target)
        svc = [
            s
            for s in docs
            if m
            and s["kind"] == "Service"
            and s["metadata"]["name"] == m[1]
            and s["metadata"].get("namespace") == m[2]
        ]
        if not svc:
            problems.append(f"{w['metadata']['name']}: --engines {target!r} names no Service")
        else:
            engine_pods = pods_selected(docs, svc[0]["spec"]["selector"], m[2])
            ports = [p["port"] for p in svc[0]["spec"]["ports"] if p["name"] == "grpc"]
            if svc[0]["spec"].get("clusterIP") != "None":
                problems.append(f"--engines: Service {m[1]} is not headless (DNS would give one virtual IP)")
            if (
                ports != [int(m[3])]
                or not engine_pods
                or any(
                    p["spec"]["template"]["spec"]["containers"][0]["command"][0] != "forkline-engine"
                    for p in engine_pods
                )
            ):
                problems.append(f"--engines {target!r} is not the engines' gRPC port")
        owner = args[args.index("--owner") + 1] if "--owner" in args else "prefix-service"
        if w["kind"] == "Deployment":
            if (
                "$(" in owner
                or w["spec"].get("replicas", 1) != 1
                or w["spec"].get("strategy", {}).get("type") != "Recreate"
            ):
                problems.append(
                    f"{w['metadata']['name']}: a Deployment's pods share --owner {owner}: it needs "
                    "replicas 1 and strategy Recreate (several replicas: a StatefulSet)"
                )
            owners = {owner}
        else:
            env = {e["name"]: e for e in c.get("env", [])}
            pod_name = env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if owner != "$(POD_NAME)" or pod_name != "metadata.name":
                problems.append(
                    f"{w['metadata']['name']}: replicas need --owner $(POD_NAME) from metadata.name"
                )
            owners = {f"{w['metadata']['name']}-{i}" for i in range(w["spec"].get("replicas", 1))}
        missing = sorted(o for o in owners if not persistent or not all(o in p for p in persistent))
        if missing:
            problems.append(f"owners {missing} are not --persistent_owner on the engines ({persistent})")
    return problems


QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
FACTORS = {
    None: 1,
    "m": 1e-3,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
}


def quantity(text: str | int) -> float:
    m = QUANTITY.match(str(text))
    if not m:
        raise ValueError(f"not a quantity: {text!r}")
    return float(m[1]) * FACTORS[m[2]]


def pod_problems(docs: list[dict]) -> list[str]:
    """Resources, a non-root user, a pinned image; one namespace for all."""
    problems = []
    for w, c in containers(docs):
        res = c.get("resources", {})
        for kind in ("cpu", "memory"):
            req, lim = res.get("requests", {}).get(kind), res.get("limits", {}).get(kind)
            if req is None or lim is None or quantity(req) > quantity(lim):
                problems.append(f"{c['name']}: {kind} request {req} / limit {lim}")
        pod_sc = w["spec"]["template"]["spec"].get("securityContext", {})
        if not pod_sc.get("runAsNonRoot") or pod_sc.get("runAsUser", 0) == 0:
            problems.append(f"{w['metadata']['name']}: not run as a non-root user")
        image = c["image"]
        if ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest"):
            problems.append(f"{c['name']}: image {image} has no pinned tag")
    namespaces = [d["metadata"]["name"] for d in docs if d["kind"] == "Namespace"]
    for d in docs:
        if d["kind"] not in CLUSTER_SCOPED and d["metadata"].get("namespace") not in namespaces:
            problems.append(
                f"{d['kind']} {d['metadata']['name']}: namespace {d['metadata'].get('namespace')} "
                f"is not the deployed one ({namespaces})"
            )
    keys = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    problems += [f"{k} defined twice" for k in {k for k in keys if keys.count(k) > 1}]
    return problems


FILE_FLAGS = ("auth_tokens", "engine_token_file", "tls_cert", "tls_key", "tls_client_ca", "engine_tls_ca")


def mounted_files(docs: list[dict], tmp: Path) -> tuple[dict[tuple[str, str], Path], list[str]]:
    """Write every file flag's secret key where the kubelet would mount it (under tmp); problems for a
    flag whose path is not a mounted secret key."""
    problems, files = [], {}
    secrets = {
        (d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs if d["kind"] == "Secret"
    }
    for w, c, pod in [(w_, c_, pod_) for w_, c_ in containers(docs) for pod_ in pod_names(w_)]:
        parsed = parse_container_args(c, pod)[0]
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"].get("volumes", [])}
        for flag in FILE_FLAGS:
            path = getattr(parsed, flag, None) if parsed else None
            if path is None:
                continue
            mounts = [
                m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")
            ]
            volume = volumes.get(mounts[0]["name"], {}).get("secret") if mounts else None
            secret = secrets.get((w["metadata"].get("namespace"), volume["secretName"])) if volume else None
            if not mounts or not mounts[0].get("readOnly") or secret is None:
                problems.append(f"{c['name']}: --{flag} {path} is not in a read-only mounted Secret")
                continue
            relative = path[len(mounts[0]["mountPath"].rstrip("/")) + 1 :]
            items = {i["path"]: i["key"] for i in volume.get("items", [])} or {k: k for k in secret["data"]}
            if relative not in items or items[relative] not in secret["data"]:
                problems.append(f"{c['name']}: --{flag} {path}: the Secret has no such key")
                continue
            out = tmp / pod / relative
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(base64.b64decode(secret["data"][items[relative]]))
            files[(pod, flag)] = out
    return files, problems


def auth_problems(docs: list[dict], tmp: Path) -> list[str]:
    """Auth on both services or neither; the mounted token files parse with the services' own parser and
    map the prefix service's engine token to its --owner."""
    files, problems = mounted_files(docs, tmp)
    pods = [(w, c, pod) for w, c in containers(docs) for pod in pod_names(w)]
    with_auth = {pod for _, _, pod in pods if (pod, "auth_tokens") in files}
    if with_auth and with_auth != {pod for _, _, pod in pods}:
        problems.append(f"auth is on for {sorted(with_auth)} only: turn it on for both services or neither")
    for _, c, name in pods:
        if (name, "engine_token_file") in files:
            token = read_token_file(str(files[(name, "engine_token_file")]))
            parsed = parse_container_args(c, name)[0]
            owner = parsed.owner if parsed is not None else PERSISTENT_OWNER
            for (other, flag), path in files.items():
                if (
                    flag == "auth_tokens"
                    and other != name
                    and TokenTable.load(str(path)).owner_for(token) != owner
                ):
                    problems.append(f"{other}'s token file does not map {name}'s engine token to {owner}")
        elif (name, "auth_tokens") in files:
            TokenTable.load(str(files[(name, "auth_tokens")]))  # raises on a bad file
    return problems


CHECKS = [
    flag_problems,
    port_problems,
    grace_problems,
    selector_problems,
    engine_wiring_problems,
    pod_problems,
]


# --- the tests ------------------------------------------------------------------------------------------

BUILDS = builds()


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {str(b.relative_to(K8S)): render(b, TEST_TOKEN_FILES) for b in BUILDS}


def test_the_builds_are_base_and_the_overlays() -> None:
    assert [str(b.relative_to(K8S)) for b in BUILDS] == ["base", "overlays/auth"]


def test_every_listed_file_exists_and_every_manifest_is_listed() -> None:
    assert listing_problems(K8S) == []


def test_control_an_unlisted_or_missing_file_is_caught(tmp_path) -> None:
    copy_root = tmp_path / "k8s"
    shutil.copytree(K8S, copy_root)
    (copy_root / "base" / "stray.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    (copy_root / "base" / "prefix-pdb.yaml").unlink()
    problems = listing_problems(copy_root)
    assert any("stray.yaml is not listed" in p for p in problems)
    assert any("prefix-pdb.yaml does not exist" in p for p in problems)


@pytest.mark.parametrize("build", [str(b.relative_to(K8S)) for b in BUILDS])
def test_every_rendered_resource_validates_against_the_kubernetes_schemas(rendered, build) -> None:
    docs = rendered[build]
    assert {d["kind"] for d in docs} >= {"Namespace", "StatefulSet", "Service", "PodDisruptionBudget"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises ValidationError


def test_every_manifest_file_validates_on_its_own() -> None:
    resources = [
        p
        for p in K8S.rglob("*.yaml")
        if p.name != "kustomization.yaml"
        and isinstance(yaml.safe_load(p.read_text(encoding="utf-8")), dict)
        and "$patch" not in yaml.safe_load(p.read_text(encoding="utf-8"))
    ]
    assert len(resources) >= 8
    for path in resources:
        for doc in load_docs(path):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_control_schema_violations_are_rejected(rendered) -> None:
    engine = next(d for d in rendered["base"] if d["kind"] == "StatefulSet")
    kubernetes_validate.validate(engine, K8S_VERSION, strict=True)
    misspelled = copy.deepcopy(engine)
    misspelled["spec"]["replica"] = misspelled["spec"].pop("replicas")
    wrong_type = copy.deepcopy(engine)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "fifty"
    bad_probe = copy.deepcopy(engine)
    bad_probe["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["svc"] = "x"
    for broken in (misspelled, wrong_type, bad_probe):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


@pytest.mark.parametrize("build", [str(b.relative_to(K8S)) for b in BUILDS])
@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_rendered_set_passes(rendered, build, check) -> None:
    assert check(rendered[build]) == []


def test_auth_overlay_mounts_token_files_the_services_accept(rendered, tmp_path) -> None:
    docs = rendered["overlays/auth"]
    files, problems = mounted_files(docs, tmp_path)
    assert problems == [] and auth_problems(docs, tmp_path / "again") == []
    assert {flag for _, flag in files} == {"auth_tokens", "engine_token_file"}
    assert {pod for pod, flag in files if flag == "engine_token_file"} == set(TEST_REPLICA_TOKENS)
    assert not mounted_files(rendered["base"], tmp_path / "base")[0]  # the base runs without auth


def mutate(docs: list[dict], name: str, edit: Callable[[dict, dict], None]) -> list[dict]:
    docs = copy.deepcopy(docs)
    w = next(d for d in workloads(docs) if d["metadata"]["name"] == name)
    edit(w, w["spec"]["template"]["spec"]["containers"][0])
    return docs


def _args_add(*extra):
    return lambda w, c: c["args"].extend(extra)


def _set_arg(flag, value):
    def edit(w, c):
        c["args"][c["args"].index(flag) + 1] = value

    return edit


CONTROLS = [
    # (check, workload, edit, what the problem says)
    (flag_problems, "forkline-engine", _args_add("--max_sesions", "8"), "unrecognized arguments"),
    (flag_problems, "forkline-engine", _args_add("--cache_kind", "paged"), "invalid choice"),
    (flag_problems, "forkline-engine", _args_add("--grace", "soon"), "invalid float value"),
    (
        port_problems,
        "forkline-engine",
        lambda w, c: c["readinessProbe"]["grpc"].update(port=50052),
        "probes port",
    ),
    (
        port_problems,
        "forkline-engine",
        lambda w, c: c["readinessProbe"]["grpc"].pop("service"),
        "readiness must",
    ),
    (port_problems, "forkline-engine", _set_arg("--metrics_port", "9999"), "container ports"),
    (
        port_problems,
        "forkline-engine",
        lambda w, c: w["spec"]["template"]["metadata"]["annotations"].update({"prometheus.io/port": "9090"}),
        "prometheus annotations",
    ),
    (
        grace_problems,
        "forkline-engine",
        lambda w, c: w["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=25),
        "does not cover",
    ),
    (grace_problems, "forkline-prefix", _set_arg("--engine_timeout", "300"), "startup probe gives up"),
    (
        selector_problems,
        "forkline-engine",
        lambda w, c: w["spec"]["template"]["metadata"]["labels"].update({"app.kubernetes.io/name": "engine"}),
        "selects no pods",
    ),
    (selector_problems, "forkline-engine", lambda w, c: c["ports"][0].update(name="rpc"), "targetPort grpc"),
    (
        engine_wiring_problems,
        "forkline-engine",
        _set_arg("--persistent_owner_prefix", "someone-else-"),
        "not --persistent_owner",
    ),
    (
        pod_problems,
        "forkline-engine",
        lambda w, c: c["resources"]["requests"].update(memory="8Gi"),
        "memory request",
    ),
    (pod_problems, "forkline-engine", lambda w, c: c.update(image="forkline:latest"), "no pinned tag"),
    (
        port_problems,
        "forkline-engine",
        lambda w, c: c["livenessProbe"]["grpc"].pop("service"),
        "liveness must",
    ),
    (
        pod_problems,
        "forkline-engine",
        lambda w, c: w["spec"]["template"]["spec"]["securityContext"].update(runAsUser=0),
        "non-root",
    ),
]


@pytest.mark.parametrize("check,name,edit,says", CONTROLS, ids=[f"{c[0].__name__}-{c[3]}" for c in CONTROLS])
def test_control_a_broken_copy_is_caught(rendered, check, name, edit, says) -> None:
    problems = check(mutate(rendered["base"], name, edit))
    assert any(says in p for p in problems), problems


def test_control_prefix_owner_and_engine_wiring_mistakes_are_caught(rendered) -> None:
    base = rendered["base"]

    def as_deployment(w, c):
        w["kind"] = "Deployment"
        c["args"][c["args"].index("--owner") + 1] = "prefix-service"

    shared = mutate(base, "forkline-prefix", as_deployment)
    assert any("share --owner" in p for p in engine_wiring_problems(shared))
    listed = mutate(
        base, "forkline-engine", _set_arg("--persistent_owner_prefix", "forkline-prefix-0")
    )  # a prefix that covers replica 0 only
    assert any("forkline-prefix-1" in p for p in engine_wiring_problems(listed))
    fixed = mutate(base, "forkline-prefix", _set_arg("--owner", "prefix-service"))
    assert any("$(POD_NAME)" in p for p in engine_wiring_problems(fixed))
    wrong_dns = mutate(
        base,
        "forkline-prefix",
        _set_arg("--engines", "dns:///forkline-engine.default.svc.cluster.local:50051"),
    )
    assert any("names no Service" in p for p in engine_wiring_problems(wrong_dns))
    wrong_port = mutate(
        base,
        "forkline-prefix",
        _set_arg("--engines", "dns:///forkline-engine.forkline.svc.cluster.local:9091"),
    )
    assert any("gRPC port" in p for p in engine_wiring_problems(wrong_port))
    unset = mutate(base, "forkline-prefix", lambda w, c: c["args"].append("$(NODE_NAME)"))
    assert any(
        "names no env var" in p
        for p in parse_container_args(
            next(c for w, c in containers(unset) if w["metadata"]["name"] == "forkline-prefix")
        )[1]
    )


def test_control_auth_wiring_mistakes_are_caught(rendered, tmp_path) -> None:
    docs = rendered["overlays/auth"]
    unmounted = mutate(docs, "forkline-prefix", lambda w, c: c["volumeMounts"].pop())
    assert any("not in a read-only mounted Secret" in p for p in auth_problems(unmounted, tmp_path / "a"))
    no_key = mutate(
        docs,
        "forkline-engine",
        lambda w, c: w["spec"]["template"]["spec"]["volumes"][-1]["secret"]["items"][0].update(path="tokens"),
    )
    assert any("no such key" in p for p in auth_problems(no_key, tmp_path / "b"))
    one_sided = mutate(docs, "forkline-engine", lambda w, c: c["args"].__delitem__(slice(-2, None)))
    assert any("both services or neither" in p for p in auth_problems(one_sided, tmp_path / "c"))
    other = render(
        K8S / "overlays" / "auth", {**TEST_TOKEN_FILES, "forkline-prefix-1.token": f"{TEST_CLIENT_TOKEN}\n"}
    )
    assert any("does not map" in p for p in auth_problems(other, tmp_path / "d"))


def test_control_the_auth_overlay_cannot_render_without_token_files() -> None:
    if (K8S / "components" / "auth" / "tokens.txt").exists():
        pytest.skip("a local tokens.txt exists (git-ignored)")
    with pytest.raises(RenderError, match="tokens.txt is missing"):
        render(K8S / "overlays" / "auth")


def test_control_the_renderer_refuses_what_it_does_not_implement(tmp_path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\ncommonLabels: {a: b}\n"
    )
    with pytest.raises(RenderError, match="commonLabels"):
        render(tmp_path)
    doc = {"spec": {"args": ["a", "b"]}}
    with pytest.raises(RenderError, match="test failed"):
        json_patch(doc, [{"op": "test", "path": "/spec/args/1", "value": "a"}])
    assert json_patch(doc, [{"op": "add", "path": "/spec/args/-", "value": "c"}])["spec"]["args"] == [
        "a",
        "b",
        "c",
    ]
