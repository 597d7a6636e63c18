"""Rolling updates by the numbers: each timing in the manifests follows from
deploy/sizing.json's measurements and stated cluster figures by docs/DEPLOY.md's formulas
(tests/deploy/sizing.py): the engines' --grace covers the longest admissible generation at the measured
rate, preStop outlasts endpoint removal + DNS TTL + re-resolve, the termination grace covers preStop +
grace + closing, the prefix services wait for engines as long as an engine may take to start (and their
startup probe waits longer), --stuck_after exceeds the longest forward; the prefix tier keeps its snapshot
folder on a volume it preloads from, runs two or more replicas with a PDB keeping one up, and its
owners are persistent on the engines by prefix. Negative controls: broken copies are caught."""

from __future__ import annotations

import copy

import pytest

from tests.deploy.manifests import load, mutate, quantity, set_arg, workload
from tests.deploy.sizing import Sizing

SIZING = Sizing.load()


@pytest.fixture(scope="module", params=["base", "overlays/auth"])
def docs(request) -> list[dict]:
    return load(request.param).docs


def pre_stop_s(c: dict) -> float:
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return float(command[1])


def probe_budget_s(probe: dict) -> float:
    return probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)


def rollout_problems(docs: list[dict]) -> list[str]:
    problems = []
    ew, ec, engine = workload(docs, "forkline-engine")
    pw, pc, prefix = workload(docs, "forkline-prefix")
    grace = SIZING.engine_grace_s(engine.max_session_tokens)
    if engine.grace < grace:
        problems.append(
            f"engine --grace {engine.grace} < the longest generation at the measured rate {grace}"
        )
    if prefix.grace < engine.grace:
        problems.append(
            f"prefix --grace {prefix.grace} < the engines' {engine.grace}: its streams are theirs"
        )
    for w, c, parsed in ((ew, ec, engine), (pw, pc, prefix)):
        name = w["metadata"]["name"]
        floor = SIZING.pre_stop_s(prefix.resolve_every)
        if pre_stop_s(c) <= floor:
            problems.append(f"{name}: preStop {pre_stop_s(c)} s <= removal + TTL + re-resolve {floor} s")
        termination = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        if termination < SIZING.termination_s(pre_stop_s(c), parsed.grace):
            problems.append(f"{name}: terminationGracePeriodSeconds {termination} < preStop + grace + close")
    start_allowance = probe_budget_s(ec["startupProbe"])
    if start_allowance < SIZING.stated["start_allowance_s"]:
        problems.append(
            f"engine start allowance {start_allowance} s < the stated {SIZING.stated['start_allowance_s']}"
        )
    if start_allowance < 10 * SIZING.measured["engine_start_s"]:
        problems.append("engine start allowance is under 10x the measured start")
    if prefix.engine_timeout < start_allowance:
        problems.append(
            f"prefix --engine_timeout {prefix.engine_timeout} < the engines' start allowance {start_allowance}"
        )
    if probe_budget_s(pc["startupProbe"]) <= prefix.engine_timeout:
        problems.append("the prefix startup probe gives up before --engine_timeout")
    if engine.stuck_after < SIZING.stuck_after_min_s():
        problems.append(
            f"--stuck_after {engine.stuck_after} < the longest forward x margin {SIZING.stuck_after_min_s()}"
        )
    return problems


def tier_problems(docs: list[dict]) -> list[str]:
    problems = []
    pw, pc, prefix = workload(docs, "forkline-prefix")
    _, _, engine = workload(docs, "forkline-engine")
    if pw["kind"] != "StatefulSet" or pw["spec"].get("replicas", 1) < 2:
        problems.append("the prefix tier is not a StatefulSet of two or more replicas")
    if pw["spec"].get("updateStrategy", {}).get("type") != "RollingUpdate":
        problems.append("the prefix tier does not roll")
    pdbs = [
        d for d in docs if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == "forkline-prefix"
    ]
    if not pdbs or pdbs[0]["spec"].get("minAvailable") != 1:
        problems.append("the prefix PDB does not keep one replica up (minAvailable: 1)")
    if "forkline-prefix-" not in (engine.persistent_owner_prefix or []):
        problems.append("the engines do not accept prefix replicas by --persistent_owner_prefix")
    mounts = {m["mountPath"]: m["name"] for m in pc.get("volumeMounts", [])}
    claims = {t["metadata"]["name"]: t for t in pw["spec"].get("volumeClaimTemplates", [])}
    if prefix.snapshot_dir is None or mounts.get(prefix.snapshot_dir) not in claims:
        problems.append("--snapshot_dir is not on the replica's own volume (volumeClaimTemplates)")
    elif prefix.snapshot_max_mb * 2**20 * SIZING.stated["volume_headroom"] > quantity(
        claims[mounts[prefix.snapshot_dir]]["spec"]["resources"]["requests"]["storage"]
    ):
        problems.append("--snapshot_max_mb (with headroom) does not fit the volume")
    if prefix.snapshot_preload < 1:
        problems.append("no --snapshot_preload: a rejoining engine comes back cold")
    if prefix.snapshot_max_mb * 2**20 < SIZING.snapshot_file_bytes(engine.max_session_tokens) * 32:
        problems.append("--snapshot_max_mb holds fewer than 32 full-length snapshots")
    return problems


def test_the_timings_follow_from_the_measurements(docs) -> None:
    assert rollout_problems(docs) == []


def test_the_prefix_tier_is_available_and_keeps_its_snapshots(docs) -> None:
    assert tier_problems(docs) == []


CONTROLS = [
    (rollout_problems, "forkline-engine", set_arg("--grace", "20"), "longest generation"),
    (rollout_problems, "forkline-prefix", set_arg("--grace", "15"), "its streams are theirs"),
    (
        rollout_problems,
        "forkline-engine",
        lambda w, c: c["lifecycle"]["preStop"]["exec"].update(command=["sleep", "5"]),
        "re-resolve",
    ),
    (
        rollout_problems,
        "forkline-engine",
        lambda w, c: w["spec"]["template"]["spec"].update(terminationGracePeriodSeconds=40),
        "preStop + grace",
    ),
    (rollout_problems, "forkline-prefix", set_arg("--engine_timeout", "90"), "start allowance"),
    (rollout_problems, "forkline-prefix", set_arg("--engine_timeout", "300"), "gives up before"),
    (rollout_problems, "forkline-engine", set_arg("--stuck_after", "0.5"), "longest forward"),
    (tier_problems, "forkline-prefix", lambda w, c: w["spec"].update(replicas=1), "two or more"),
    (tier_problems, "forkline-prefix", lambda w, c: w["spec"].pop("volumeClaimTemplates"), "own volume"),
    (tier_problems, "forkline-prefix", set_arg("--snapshot_preload", "0"), "comes back cold"),
    (tier_problems, "forkline-prefix", set_arg("--snapshot_max_mb", "20000"), "does not fit"),
    (
        tier_problems,
        "forkline-engine",
        set_arg("--persistent_owner_prefix", "prefix-"),
        "persistent_owner_prefix",
    ),
]


@pytest.mark.parametrize("check,name,change,says", CONTROLS, ids=[c[3] for c in CONTROLS])
def test_control_a_broken_copy_is_caught(check, name, change, says) -> None:
    base = load("base").docs
    problems = check(mutate(base, name, change))
    assert any(says in p for p in problems), problems


def test_control_a_pdb_that_lets_every_replica_go_is_caught() -> None:
    base = copy.deepcopy(load("base").docs)
    pdb = next(
        d for d in base if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == "forkline-prefix"
    )
    pdb["spec"] = {"maxUnavailable": 2, "selector": pdb["spec"]["selector"]}
    assert any("minAvailable" in p for p in tier_problems(base))
