"""Rank-consistent decisions and context-parallel attention on a real gloo group of 3 CPU processes (and a
2-rank subgroup). One spawned group runs every scenario (tests/_distributed_worker.py); each test checks one."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests import _distributed_worker as worker

WORLD = 3
pytestmark = pytest.mark.slow  # spawns processes (one group for the module: ~10 s on 2 cores)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("dist")
    # spawn, not fork: a forked child hangs in torch's OpenMP pool.
    mp.start_processes(worker.main, args=(WORLD, _free_port(), str(out)), nprocs=WORLD, join=True,
                       start_method="spawn")
    results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, result in enumerate(results):
        for name, value in result.items():
            assert "crashed" not in value, f"rank {r} {name}:\n{value['crashed']}"
    return results


def test_agreed_once_per_class_never_on_the_fast_path(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        a = r["agreed"]
        assert a["agreements_after_first"] == 1
        assert a["agreements"] == 1  # the fast path and a new length of the same class: no collective
        assert a["chosen"] == "cpu.flash"
        assert "group:   agreed across 3 ranks" in a["explain"]
        assert a["not_yet"].startswith("not agreed yet: the group agrees at this class's first call")


def test_env_var_agrees_over_the_default_group(ranks: list[dict[str, Any]]) -> None:
    assert [r["env_mode"]["agreements"] for r in ranks] == [1, 1, 1]
    assert all(r["env_mode"]["explain"] == "agreed across 3 ranks" for r in ranks)


def test_env_var_in_a_single_process_decides_locally_and_caches(manager: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import opdispatch

    monkeypatch.setenv("OPDISPATCH_DISTRIBUTED", "consistent")
    fresh = opdispatch.OpManager()
    previous = opdispatch.set_manager(fresh)
    try:
        gen = torch.Generator().manual_seed(3)
        q, k = torch.randn(1, 8, 2, 8, generator=gen), torch.randn(1, 8, 2, 8, generator=gen)
        out = opdispatch.attention(q, k, k, causal=True)
        opdispatch.attention(q[:, :5], k[:, :5], k[:, :5], causal=True)  # same class: the cached decision
        assert fresh.decisions_made == 1 and fresh.agreement.agreements == 0
        expected = worker._oracle(q, k, k, True)
        assert (out.double() - expected).abs().max() < 1e-5
        assert opdispatch.explain(q, k, k, causal=True).agreement == (
            "not agreed: torch.distributed was not initialised when it was decided")
    finally:
        opdispatch.set_manager(previous)
    monkeypatch.setenv("OPDISPATCH_DISTRIBUTED", "always")
    with pytest.raises(ValueError) as info:
        opdispatch.OpManager()
    assert str(info.value) == ("OPDISPATCH_DISTRIBUTED='always' is not supported; allowed: consistent, local "
                               "(consistent: agree each new decision across the default torch.distributed group)")


def test_consistent_needs_an_initialised_group(manager: Any) -> None:
    from opdispatch import distributed as od

    with pytest.raises(od.AgreementError, match="torch.distributed is not initialised in this process. Fix: call "
                       r"torch.distributed.init_process_group\(...\) first"):
        od.consistent()
    assert manager.agreement is None


def test_divergent_rank_takes_rank_0s_choice_when_it_can(ranks: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(ranks):
        o = r["override"]
        assert o["ran"] == ["cpu.flash"], rank  # rank 2 preferred reference.math, and runs cpu.flash
        assert o["chosen"] == "cpu.flash"
        assert "rank 2 chose reference.math, overridden by rank 0's cpu.flash (agreed across 3 ranks)" in o["explain"]
        assert o["error"] < 1e-5
    assert "chosen on this rank; the group uses cpu.flash" in ranks[2]["override"]["explain"]


def test_no_common_choice_is_an_error_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    messages = {r["denied"]["message"] for r in ranks}
    assert len(messages) == 1 and all(r["denied"]["type"] == "AgreementError" for r in ranks)
    text = messages.pop()
    assert "rank 0's choice (cpu.flash) cannot run on every rank" in text
    assert "rank 0: cpu.flash" in text and "rank 1: reference.math" in text
    assert "rank 0's cpu.flash here: denied by policy (denied by OPDISPATCH_DENY" in text
    assert "Implementations every rank can run for this call: reference.math." in text
    assert "OPDISPATCH_IMPL_ATTENTION=<id>" in text


def test_a_library_missing_on_one_host_is_an_error_naming_it(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        error = r["unavailable"]
        assert error["type"] == "AgreementError"
        assert "  rank 0: test.hostlib (decided by OPDISPATCH_PREFER" in error["message"]
        assert "  rank 2: cpu.flash" in error["message"]
        assert "rank 0's test.hostlib here: unavailable (hostlib is not installed on this host)" in error["message"]
        assert "Implementations every rank can run for this call: cpu.flash, reference.math." in error["message"]


def test_a_rank_that_cannot_decide_does_not_leave_the_others_waiting(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["pinned"]["type"] == "AgreementError"
        assert "rank 1: no decision — PinnedImplementationError: attention: implementation 'nvidia.flash'" \
            in r["pinned"]["message"]


def test_ranks_deciding_different_calls_is_an_error_not_a_wrong_answer(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["mismatch"]["type"] == "AgreementError"
        assert "decided different calls at the same point" in r["mismatch"]["message"]
        assert "causal" in r["mismatch"]["message"].split("rank 0:")[1].split("\n")[0]


def test_local_decisions_are_decided_again_with_the_group(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        local = r["local_calls"]
        # a decision (and fast path) from before consistent() is agreed at the next call; local() runs no
        # collective; rank 0's local decision joins the group's collective at the class's next call
        assert (local["after_switch"], local["inside"], local["after"]) == (1, 1, 2)
        assert "group:   agreed across 3 ranks" in local["explain"]


def test_a_rank_deciding_alone_times_out_with_a_clear_error(ranks: list[dict[str, Any]]) -> None:
    alone = ranks[0]["timeout"]
    assert alone["type"] == "AgreementError" and "Agreement is collective" in alone["message"]
    assert 1.5 < alone["seconds"] < 30


def test_tuned_table_is_the_slowest_rank_per_implementation(ranks: list[dict[str, Any]]) -> None:
    agreed = ranks[0]["tuned"]["agreed"]
    assert all(r["tuned"]["agreed"] == agreed for r in ranks)  # one table everywhere
    for i, entry in enumerate(agreed):
        expected = {impl: max(r["tuned"]["mine"][i][impl] for r in ranks)
                    for impl in ("a.one", "b.two", "c.three") if all(impl in r["tuned"]["mine"][i] for r in ranks)}
        assert entry["median_us"] == expected
        assert entry["order"] == sorted(expected, key=expected.__getitem__)
    assert agreed[0]["failed"] == {"c.three": "rank 1: RuntimeError: boom"} and "c.three" in agreed[1]["order"]
    assert agreed[1]["failed"] == {"b.two": "timed on rank 0 but not on every rank"}
    assert agreed[1]["order"] == sorted(["a.one", "c.three"], key=agreed[1]["median_us"].__getitem__)
    assert ranks[0]["tuned"]["settings"]["ranks"] == WORLD
    assert ranks[2]["tuned"]["fingerprint_error"]["type"] == "AgreementError"


@pytest.mark.parametrize("world", [3, 2])
@pytest.mark.parametrize("case", worker.CP_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'causal' if c[2] else 'full'}"
                         f"-{c[3][0]}:{c[3][1]}-{c[4]}-{str(c[5])[6:]}")
def test_context_parallel_matches_the_float64_oracle(ranks: list[dict[str, Any]], world: int, case: Any) -> None:
    mode, sharding, causal, heads, layout, dtype = case
    name = f"{world} ranks {mode}-{sharding}-{'causal' if causal else 'full'}-{heads[0]}:{heads[1]}-{layout}-{dtype}"
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for rank in range(world):
        errors = ranks[rank]["context_parallel"][name]
        assert max(errors.values()) < tol, (rank, errors)


@pytest.mark.parametrize("world", [3, 2])
@pytest.mark.parametrize("case", worker.CP_SINK_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'causal' if c[2] else 'full'}"
                         f"-{c[3][0]}:{c[3][1]}-{c[4]}-{str(c[5])[6:]}")
def test_context_parallel_with_sinks_matches_the_float64_oracle(ranks: list[dict[str, Any]], world: int,
                                                                case: Any) -> None:
    """The sink enters each row's merged softmax once: output, dq/dk/dv and the sinks gradient match the
    unsharded float64 oracle with sinks. Each rank's sinks gradient is its own queries' share (the oracle's with
    the output gradient of those rows only), and the shares summed over the group are the oracle's."""
    mode, sharding, causal, heads, layout, dtype = case
    name = f"{world} ranks {mode}-{sharding}-{'causal' if causal else 'full'}-{heads[0]}:{heads[1]}-{layout}-{dtype}"
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for rank in range(world):
        errors = dict(ranks[rank]["context_parallel_sinks"][name])
        assert set(errors) == {"out", "unsharded", "dq", "dk", "dv", "dsinks share", "dsinks summed"}
        # The sinks' gradients are float32 (relative errors): the oracle's and this rank's alike.
        assert max(errors.pop("dsinks share"), errors.pop("dsinks summed")) < 1e-6, (rank, name)
        assert max(errors.values()) < tol, (rank, errors)


def test_context_parallel_with_sinks_in_a_group_of_one_and_with_only_the_sinks_trained(
        ranks: list[dict[str, Any]]) -> None:
    errors = ranks[0]["context_parallel_sinks"]["1 rank"]
    assert max(errors.pop("dsinks share"), errors.pop("dsinks summed")) < 1e-6, errors
    assert max(errors.values()) < 1e-10, errors
    for rank, r in enumerate(ranks):
        for mode in ("ring", "allgather"):
            errors = r["context_parallel_sinks"][f"sinks only {mode}"]
            # q, k, v get no gradient (0.0: none was made), the sinks theirs, with a backward that exchanges nothing
            assert (errors["dq"], errors["dk"], errors["dv"]) == (0.0, 0.0, 0.0), (rank, mode, errors)
            assert max(errors.pop("dsinks share"), errors.pop("dsinks summed")) < 1e-6, (rank, mode, errors)
            assert max(errors.values()) < 1e-10, (rank, mode, errors)


def test_context_parallel_blocks_are_causal_with_equal_lengths_or_not_causal(ranks: list[dict[str, Any]]) -> None:
    """Both modes compute the kinds of block cuDNN takes: a causal block with seqlen_q != seqlen_k (bottom-right
    over a key prefix) would go to a slower kernel on H100."""
    for rank, r in enumerate(ranks):
        for name, calls in r["context_parallel"]["block calls"].items():
            assert calls, (rank, name)
            for call in calls:
                assert not call["causal"] or (call["q"] == call["k"] and call["alignment"] == "top_left"), \
                    (rank, name, call)
            causal = "-causal-" in name
            assert {c["pass"] for c in calls} == {"forward", "backward"}, (rank, name)
            assert any(c["causal"] for c in calls) == causal, (rank, name)


def test_context_parallel_in_a_group_of_one(ranks: list[dict[str, Any]]) -> None:
    for mode in ("ring", "allgather"):
        errors = ranks[0]["context_parallel"][f"1 rank {mode}"]
        assert max(errors.values()) < 1e-10, errors


def test_context_parallel_under_agreement_and_the_torch_block_backward(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        result = r["context_parallel_agreed"]
        for mode in ("ring", "allgather"):
            assert max(result[mode].values()) < 1e-10, (mode, result[mode])
        assert result["agreements"] > 0


def test_context_parallel_errors(ranks: list[dict[str, Any]]) -> None:
    e = ranks[0]["cp_errors"]
    assert e["odd_shard"]["type"] == "ValueError"
    assert e["odd_shard"]["message"] == (
        "opdispatch.context_parallel_attention(): a sequence of length 15 cannot be split into 2 x world = 6 chunks "
        "(zigzag: rank r holds chunks r and 5-r): the length must be divisible by 6. Fix: pad the sequence to a "
        "multiple of 6 (with keys the padding queries may see masked out by causality, or cut after), or use another "
        "group size (this rank's shard has 5, an odd number)")
    assert "divisible by 6" in e["indivisible"]["message"]
    assert e["mode"]["message"] == ("opdispatch.context_parallel_attention(): mode='tree' is not supported; allowed: "
                                    "'ring', 'allgather'")


CP_WHAT = "opdispatch.context_parallel_attention()"
# The lines each disagreement must produce: the fields that differ, each rank's value.
CP_MISMATCH_LINES = {
    "shard length": ["  q.shape: (2, 4, 4, 8) on ranks 0, 1; (2, 6, 4, 8) on rank 2",
                     "  k.shape: (2, 4, 2, 8) on ranks 0, 1; (2, 6, 2, 8) on rank 2",
                     "  v.shape: (2, 4, 2, 8) on ranks 0, 1; (2, 6, 2, 8) on rank 2"],
    "heads": ["  q.shape: (2, 4, 4, 8) on ranks 0, 2; (2, 4, 2, 8) on rank 1"],
    "head_dim": ["  q.shape: (2, 4, 4, 16) on rank 0; (2, 4, 4, 8) on ranks 1, 2",
                 "  k.shape: (2, 4, 2, 16) on rank 0; (2, 4, 2, 8) on ranks 1, 2",
                 "  v.shape: (2, 4, 2, 16) on rank 0; (2, 4, 2, 8) on ranks 1, 2",
                 f"  scale: {1 / 16 ** 0.5!r} on rank 0; {1 / 8 ** 0.5!r} on ranks 1, 2"],
    "dtype": ["  q.dtype: 'float64' on ranks 0, 1; 'float32' on rank 2",
              "  k.dtype: 'float64' on ranks 0, 1; 'float32' on rank 2",
              "  v.dtype: 'float64' on ranks 0, 1; 'float32' on rank 2"],
    "batch": ["  q.shape: (2, 4, 4, 8) on ranks 0, 2; (1, 4, 4, 8) on rank 1",
              "  k.shape: (2, 4, 2, 8) on ranks 0, 2; (1, 4, 2, 8) on rank 1",
              "  v.shape: (2, 4, 2, 8) on ranks 0, 2; (1, 4, 2, 8) on rank 1"],
    "causal": ["  causal: True on ranks 0, 2; False on rank 1"],
    "scale": [f"  scale: 0.5 on rank 0; {1 / 8 ** 0.5!r} on ranks 1, 2"],
    "sharding": ["  sharding: 'zigzag' on ranks 0, 1; 'contiguous' on rank 2"],
    "mode": ["  mode: 'ring' on ranks 0, 2; 'allgather' on rank 1"],
    "grad": ["  records a backward: True on ranks 0, 1; False on rank 2"],
    "sinks": ["  sinks: False on ranks 0, 1; True on rank 2"],
}


@pytest.mark.parametrize("kind", sorted(CP_MISMATCH_LINES))
def test_context_parallel_ranks_that_disagree_raise_one_clear_error_everywhere(ranks: list[dict[str, Any]],
                                                                               kind: str) -> None:
    """Shards of other shapes used to abort a rank inside gloo, other options to give every rank a wrong answer,
    another mode to time out: each is now the same error on every rank, before any exchange, naming the field and
    each rank's value."""
    errors = [r["cp_mismatch"][kind] for r in ranks]
    assert {e["type"] for e in errors} == {"AgreementError"}, errors
    assert len({e["message"] for e in errors}) == 1, errors  # word for word the same on every rank
    message = errors[0]["message"]
    lines = message.splitlines()
    assert lines[0] == f"{CP_WHAT}: the 3 ranks of the group did not make the same call, so nothing was exchanged:"
    assert lines[1:-1] == CP_MISMATCH_LINES[kind]  # exactly the fields that differ
    assert lines[-1].startswith("Every rank of the group must call it at the same point with the same arguments. "
                                "Fix: ")
    fix = {"shard length": "`shard_sequence`", "heads": "equal batch, shard length, heads and head_dim",
           "dtype": "cast q, k and v to one dtype", "causal": "pass the same causal on every rank",
           "scale": "pass the same scale", "sharding": "pass the same sharding", "mode": "pass the same mode",
           "grad": "enable gradients on every rank or on none", "batch": "equal batch",
           "head_dim": "pass the same scale", "sinks": "pass sinks (the same replicated parameter) on every rank"}[kind]
    assert fix in lines[-1]


def test_context_parallel_a_rank_rejecting_its_call_does_not_leave_the_others_waiting(
        ranks: list[dict[str, Any]]) -> None:
    errors = [r["cp_mismatch"]["rejected"] for r in ranks]
    assert errors[1] == {"type": "ValueError", "message": f"{CP_WHAT}: mode='tree' is not supported; allowed: 'ring', "
                                                          "'allgather'"}
    assert errors[0] == errors[2] and errors[0]["type"] == "AgreementError"
    assert "  rejected by its own checks on rank 1 (each raises its own error there, which says why)" in \
        errors[0]["message"].splitlines()


def test_unshard_sequence_shards_of_other_shapes_raise_one_clear_error_everywhere(
        ranks: list[dict[str, Any]]) -> None:
    """An all-gather of shards of other lengths aborted a rank inside gloo."""
    errors = [r["cp_mismatch"]["unshard"] for r in ranks]
    assert len({e["message"] for e in errors}) == 1 and errors[0]["type"] == "AgreementError"
    assert errors[0]["message"].splitlines()[:2] == [
        "opdispatch.unshard_sequence(): the 3 ranks of the group did not make the same call, so nothing was "
        "exchanged:", "  x.shape: (1, 4, 2, 8) on ranks 0, 1; (1, 6, 2, 8) on rank 2"]


def test_context_parallel_a_rank_running_a_backward_the_others_skip_is_named(ranks: list[dict[str, Any]]) -> None:
    """Rank 0's backward (its ring exchanges) met the others' next forward: now both sides raise, naming the ops."""
    errors = [r["cp_mismatch"]["backward skipped"] for r in ranks]
    assert len({e["message"] for e in errors}) == 1 and errors[0]["type"] == "AgreementError"
    assert errors[0]["message"].startswith(
        "opdispatch: the 3 ranks of the group are at different collective calls: "
        "opdispatch.context_parallel_attention() backward on rank 0; opdispatch.context_parallel_attention() on "
        "ranks 1, 2; nothing was exchanged.")
    assert "run the backward on every rank or on none" in errors[0]["message"]


def test_context_parallel_after_disagreements_agrees_and_matches_the_oracle(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert max(r["cp_mismatch"]["after"].values()) < 1e-10, r["cp_mismatch"]["after"]
    assert len({r["cp_mismatch"]["calls"] for r in ranks}) == 1  # every rank counted the same calls


def test_context_parallel_an_extra_call_on_one_rank_is_named_by_the_others_next_call(
        ranks: list[dict[str, Any]]) -> None:
    """Rank 0 calls once more than the others: its extra call pairs with their next one (collectives pair in
    order), which here has no gradient: every rank raises, naming it."""
    assert all(r["cp_twice"]["first"]["type"] is None for r in ranks)
    errors = [ranks[0]["cp_twice"]["extra"], ranks[1]["cp_twice"]["later"], ranks[2]["cp_twice"]["later"]]
    assert len({e["message"] for e in errors}) == 1 and errors[0]["type"] == "AgreementError"
    assert "  records a backward: True on rank 0; False on ranks 1, 2" in errors[0]["message"].splitlines()


def test_tune_under_torchrun_agrees_one_table(tmp_path: Path) -> None:
    import subprocess
    import sys

    import yaml

    shapes = tmp_path / "shapes.yaml"
    shapes.write_text("shapes:\n  - {dtype: fp32, batch: 1, seqlen_q: 64, heads_q: 2, heads_kv: 1, head_dim: 16, "
                      "causal: true}\n")
    out = tmp_path / "tuned.yaml"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "opdispatch", "tune", "--shapes", str(shapes), "--out", str(out),
                           "--reps", "2", "--warmup", "1", "--impl", "cpu.flash", "--impl", "reference.math", "-q"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("wrote ") == 1  # rank 0 writes the one table
    assert "agreed across 2 ranks" in done.stdout
    table = yaml.safe_load(out.read_text())
    assert table["settings"]["ranks"] == 2
    assert set(table["entries"][0]["median_us"]) == {"cpu.flash", "reference.math"}


def test_ranks_compare_a_calls_class_whatever_gpu_each_holds() -> None:
    """Rank 0 computes on cuda:0, rank 1 on cuda:1: the same call's class must compare equal across them (the
    first NCCL run on two H100s raised 'decided different calls' for that alone)."""
    from opdispatch.engine._agreement import _rank_independent

    key = ("bshd", torch.bfloat16, torch.device("cuda", 1), 128, (torch.device("cuda", 1), True))
    assert _rank_independent(key) == ("bshd", torch.bfloat16, "cuda", 128, ("cuda", True))
    assert _rank_independent(key) == _rank_independent(
        ("bshd", torch.bfloat16, torch.device("cuda", 0), 128, (torch.device("cuda", 0), True)))
    assert _rank_independent(key) != _rank_independent(
        ("bshd", torch.bfloat16, torch.device("cpu"), 128, (torch.device("cpu"), True)))


def test_context_parallel_refuses_a_cuda_graph_capture_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agreement reads its collective's result on the host, which a capture cannot hold: a clear refusal
    before anything runs, not a CUDA error from inside the capture."""
    from opdispatch.distributed import _context_parallel as cp
    from opdispatch import distributed as od
    from opdispatch.engine._agreement import agree_call

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(od.AgreementError) as info:
        agree_call(None, cp._CALL, cp._signature(q, q, q, True, "ring", "zigzag", "bshd", None), device="cuda")
    assert str(info.value) == (
        "opdispatch.context_parallel_attention(): called while a CUDA graph is being captured, but the ranks agree "
        "each call with a collective whose result the host reads, which a capture cannot hold. Fix: call it outside "
        "the captured region")
