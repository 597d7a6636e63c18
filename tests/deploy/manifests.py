"""deploy/k8s read without kustomize: a build is the files its kustomization lists, plus what its
components append (JSON-patch `add .../-` only) and the Secrets they generate. `layout_problems` holds
the manifests to that subset, so what the tests read is what `kubectl apply -k` applies."""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import io
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from engine_service import __main__ as engine_main
from prefix_service import __main__ as prefix_main

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BUILDS = ("base", "overlays/auth")
PARSERS: dict[str, Callable] = {
    "forkline-engine": engine_main.build_parser,
    "forkline-prefix": prefix_main.build_parser,
}
CLIENT_TOKEN = "alice-token-0123456789abcdef"
REPLICA_TOKENS = {f"forkline-prefix-{i}": f"replica-{i}-token-0123456789abcdef" for i in range(2)}
TOKEN_FILES = {  # the auth component's git-ignored files, as an operator would write them
    "tokens.txt": f"{CLIENT_TOKEN} alice\n" + "".join(f"{t} {o}\n" for o, t in REPLICA_TOKENS.items()),
    **{f"{owner}.token": f"{token}\n" for owner, token in REPLICA_TOKENS.items()},
}
KEYS = {  # what this reading covers, by kind
    "Kustomization": {"apiVersion", "kind", "namespace", "resources", "components"},
    "Component": {"apiVersion", "kind", "secretGenerator", "patches"},
}


@dataclass
class Build:
    docs: list[dict]
    secrets: dict[str, dict[str, str]]  # generated Secret name -> key -> text
    namespace: str | None


def read_docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def kustomization(folder: Path) -> dict:
    return read_docs(folder / "kustomization.yaml")[0]


def load(folder: Path | str, files: Mapping[str, str] = TOKEN_FILES) -> Build:
    """The build in ``folder`` (under deploy/k8s); raises AssertionError on a patch it does not cover."""
    folder, k = K8S / folder, kustomization(K8S / folder)
    build = Build([], {}, k.get("namespace"))
    for entry in k.get("resources", []):
        inner = load(folder / entry, files) if (folder / entry).is_dir() else None
        build.docs += inner.docs if inner else read_docs(folder / entry)
        build.secrets |= inner.secrets if inner else {}
    for component in (folder / entry for entry in k.get("components", [])):
        for generator in kustomization(component).get("secretGenerator", []):
            build.secrets[generator["name"]] = {name: files[name] for name in generator["files"]}
        for patch in kustomization(component).get("patches", []):
            t = patch["target"]
            key = ("/".join(filter(None, (t.get("group"), t.get("version")))), t["kind"], t["name"])
            hits = [d for d in build.docs if (d["apiVersion"], d["kind"], d["metadata"]["name"]) == key]
            assert len(hits) == 1, f"{patch['path']}: the target {t} is not one resource of the base"
            for op in read_docs(component / patch["path"])[0]:
                assert op["op"] == "add" and op["path"].endswith("/-"), f"{op} is not an append"
                node = hits[0]
                for part in op["path"].split("/")[1:-1]:  # the manifests' pointers need no ~ escapes
                    node = node[int(part)] if isinstance(node, list) else node[part]
                node.append(copy.deepcopy(op["value"]))
    return build


def layout_problems(root: Path = K8S) -> list[str]:
    """Kustomizations use only KEYS and name files that exist; every YAML file is named; generated
    Secrets keep their name (the pods mount it) and come from git-ignored files (no committed token)."""
    problems, named = [], set()
    for path in root.rglob("kustomization.yaml"):
        folder, k, where = path.parent, kustomization(path.parent), path.relative_to(root)
        named.add(path.resolve())
        problems += [f"{where}: {key} is not covered by this reading" for key in set(k) - KEYS[k["kind"]]]
        for entry in (
            k.get("resources", []) + k.get("components", []) + [p["path"] for p in k.get("patches", [])]
        ):
            target = (folder / entry).resolve()
            named.add(target if target.is_file() else target / "kustomization.yaml")
            if not target.exists():
                problems.append(f"{where}: {entry} does not exist")
        gitignore = (folder / ".gitignore").read_text() if (folder / ".gitignore").exists() else ""
        ignored = [line for line in gitignore.splitlines() if line.strip() and not line.startswith("#")]
        for generator in k.get("secretGenerator", []):
            if not generator.get("options", {}).get("disableNameSuffixHash"):
                problems.append(f"{where}: Secret {generator['name']} gets a hashed name")
            problems += [
                f"{where}: {name} is not a git-ignored file"
                for name in generator["files"]
                if not any(fnmatch.fnmatch(name, pattern) for pattern in ignored)
            ]
    problems += [
        f"{p.relative_to(root)} is not listed" for p in root.rglob("*.y*ml") if p.resolve() not in named
    ]
    return problems


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def containers(docs: list[dict]) -> Iterator[tuple[dict, dict]]:
    for w in workloads(docs):
        for c in w["spec"]["template"]["spec"]["containers"]:
            yield w, c


def pod_names(w: dict) -> list[str]:
    """A StatefulSet's ordinal pod names; one stand-in for a Deployment's pods."""
    if w["kind"] == "StatefulSet":
        return [f"{w['metadata']['name']}-{i}" for i in range(w["spec"].get("replicas", 1))]
    return [f"{w['metadata']['name']}-pod"]


def parse_container_args(c: dict, pod: str | None = None):
    """(the argparse namespace or None, problems), $(VAR)s expanded as the kubelet would ($(POD_NAME) to
    ``pod``, any other to VAR-value)."""
    if (c.get("command") or [None])[0] not in PARSERS:
        return None, [f"{c['name']}: command {c.get('command')} is not one of {sorted(PARSERS)}"]
    env = {e["name"] for e in c.get("env", [])}
    found = [re.findall(r"\$\((\w+)\)", a) for a in c.get("args", [])]
    problems = [f"{c['name']}: $({v}) names no env var" for names in found for v in names if v not in env]
    value = lambda m: pod if pod is not None and m[1] == "POD_NAME" else f"{m[1]}-value"  # noqa: E731
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = [re.sub(r"\$\((\w+)\)", value, a) for a in c.get("args", [])]
            return PARSERS[c["command"][0]]().parse_args(args), problems
    except SystemExit:
        return None, [*problems, f"{c['name']}: {c['command'][0]} refuses its args: {err.getvalue().strip()}"]


def workload(docs: list[dict], name: str) -> tuple[dict, dict, object]:
    """(workload ``name``, its container, its parsed args as pod 0 sees them)."""
    w, c = next((w, c) for w, c in containers(docs) if w["metadata"]["name"] == name)
    return w, c, parse_container_args(c, f"{name}-0")[0]


def arg(c: dict, flag: str, default: str = "") -> str:
    return c["args"][c["args"].index(flag) + 1] if flag in c["args"] else default


UNITS = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def quantity(text: str | int) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|k|M|G|T|Ki|Mi|Gi)?", str(text))
    if not m:
        raise ValueError(f"not a quantity: {text!r}")
    return float(m[1]) * UNITS[m[2]]


Edit = Callable[[dict, dict], None]


def mutate(docs: list[dict], name: str, edit: Edit) -> list[dict]:
    """A copy of ``docs`` with ``edit(workload, its first container)`` applied to workload ``name``."""
    docs = copy.deepcopy(docs)
    w = next(d for d in workloads(docs) if d["metadata"]["name"] == name)
    edit(w, w["spec"]["template"]["spec"]["containers"][0])
    return docs


def set_arg(flag: str, value: str) -> Edit:
    return lambda w, c: c["args"].__setitem__(c["args"].index(flag) + 1, value)
