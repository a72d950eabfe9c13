"""opdispatch.compat.te.DotProductAttention with TransformerEngine's context parallelism (cp_group,
cp_global_ranks, cp_stream, cp_comm_type) on opdispatch.distributed.context_parallel_attention: on a spawned gloo
group of 2 CPU processes (tests/_te_cp_worker.py), each rank's output and q/k/v gradients of its shard against the
float64 oracle of tests/test_compat_te.py on the whole sequence, sharded TE's way; and, in this process (torch's
fake process group), the refusals of what opdispatch's context parallelism cannot honour."""

from __future__ import annotations

import logging

import pytest
import torch

from opdispatch.compat.te import DotProductAttention
from tests import _te_cp_worker as worker
from tests.test_compat_te import DIM, HEADS, _qkv

@pytest.fixture(scope="module")
def cp_ranks(tmp_path_factory):
    """One spawned gloo group of 2 CPU processes running every case of tests/_te_cp_worker.py."""
    import json
    import socket

    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("te_cp")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # spawn, not fork: a forked child hangs in torch's OpenMP pool.
    mp.start_processes(worker.main, args=(worker.WORLD, port, str(out)), nprocs=worker.WORLD, join=True,
                       start_method="spawn")
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(worker.WORLD)]
    for r, result in enumerate(results):
        assert "crashed" not in result, f"rank {r}:\n{result['crashed']}"
    return results


@pytest.mark.slow  # spawns 2 processes
@pytest.mark.parametrize("case", worker.CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2]}-{HEADS}:{c[3]}-{str(c[4])[6:]}")
def test_context_parallel_matches_the_unsharded_float64_oracle(cp_ranks, case):
    """Each rank's output and q/k/v gradients of its shard — TE's DualChunkSwap shard, rank r holding chunks r and
    2·cp_size−1−r — equal the float64 oracle of the module without context parallelism on the whole sequence."""
    tol = 1e-10 if case[4] == torch.float64 else 3e-5
    for rank, result in enumerate(cp_ranks):
        errors = result[worker.case_name(case)]
        assert set(errors) == {"out", "dq", "dk", "dv"}
        assert max(errors.values()) < tol, (rank, errors)


@pytest.mark.slow  # spawns 2 processes
@pytest.mark.parametrize("name", ["set_context_parallel_group", "a2a+p2p with an a2a group of one",
                                  "packed qkv_layer", "cross-attention no_mask", "checkpoint_core_attention",
                                  "eval with attention_dropout", "softmax_scale",
                                  "group of one rank: no context parallelism (window honoured)"])
def test_context_parallel_extras_match_the_float64_oracle(cp_ranks, name):
    for rank, result in enumerate(cp_ranks):
        errors = result["extras"][name]
        assert set(errors) == {"out", "dq", "dk", "dv"}
        assert max(errors.values()) < 3e-5, (rank, name, errors)


@pytest.fixture
def fake_pair():
    """A world of 2 in this process (torch's fake backend: no communication): enough for the checks that run
    before any exchange."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.new_group([0, 1])
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:window_size should be")
@pytest.mark.parametrize("module,forward,argument,says", [
    ({"qkv_format": "thd", "attn_mask_type": "padding"}, "thd", "qkv_format", "allowed: 'bshd', 'sbhd'"),
    ({"attn_mask_type": "padding"}, {"attention_mask": torch.zeros(2, 1, 1, 4, dtype=torch.bool)},
     "attn_mask_type", "allowed: no_mask, causal"),
    ({"attn_mask_type": "padding_causal"}, {"attention_mask": torch.zeros(2, 1, 1, 4, dtype=torch.bool)},
     "attn_mask_type", "allowed: no_mask, causal"),
    ({"attn_mask_type": "causal_bottom_right"}, {}, "attn_mask_type", "use 'causal'"),
    ({"attn_mask_type": "arbitrary"}, {"attention_mask": torch.zeros(1, 1, 4, 4, dtype=torch.bool)},
     "attn_mask_type", "allowed: no_mask, causal"),
    ({"window_size": (2, 0)}, {}, "window_size", "no sliding window"),
    ({"attn_mask_type": "no_mask"}, {"window_size": (1, 1)}, "window_size", "no sliding window"),
    ({}, {"core_attention_bias_type": "post_scale_bias", "core_attention_bias": torch.zeros(1, HEADS, 4, 4)},
     "core_attention_bias_type", "allowed: 'no_bias'"),
    ({}, {"core_attention_bias_type": "alibi"}, "core_attention_bias_type", "allowed: 'no_bias'"),
    ({"attention_dropout": 0.1}, {}, "attention_dropout", "eval()"),
    ({"softmax_type": "off-by-one"}, {}, "softmax_type", "cp_comm_type='a2a'"),
    ({"softmax_type": "learnable"}, {}, "softmax_type", "allowed: 'vanilla'"),
    ({"attention_type": "cross", "attn_mask_type": "no_mask"}, "cross", "key_layer", "run without cp_group"),
])
def test_context_parallel_refuses_what_it_cannot_honour(fake_pair, module, forward, argument, says):
    m = DotProductAttention(HEADS, DIM, qkv_format=module.pop("qkv_format", "bshd"), cp_group=fake_pair,
                            cp_global_ranks=[0, 1], **module)
    q, k, v = _qkv()
    if forward == "thd":
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        cu = torch.tensor([0, 4, 8], dtype=torch.int32)
        forward = {"cu_seqlens_q": cu, "cu_seqlens_kv": cu}
    elif forward == "cross":
        k, v, forward = k[:, :2], v[:, :2], {}
    with pytest.raises(ValueError, match=argument) as error:
        m(q, k, v, **forward)
    message = str(error.value)
    assert "with context parallelism (cp_group of 2 ranks, cp_comm_type='p2p')" in message, message
    assert says in message, message


def test_context_parallel_refuses_deterministic(fake_pair, monkeypatch):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    m = DotProductAttention(HEADS, DIM, qkv_format="bshd", cp_group=fake_pair, cp_global_ranks=[0, 1])
    with pytest.raises(ValueError, match="deterministic=True .*NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"):
        m(*_qkv())


@pytest.mark.parametrize("kwargs,argument,says", [
    ({"cp_global_ranks": [1, 0]}, "cp_global_ranks", "must be cp_group's global ranks in group order, [0, 1]"),
    ({"cp_global_ranks": None}, "cp_global_ranks", "is required with cp_comm_type='p2p'"),
    ({"cp_global_ranks": [0, 1], "cp_comm_type": "a2a"}, "cp_comm_type", "allowed: 'p2p' (ring) or 'all_gather'"),
    ({"cp_global_ranks": [0, 1], "cp_comm_type": "a2a+p2p"}, "cp_group", "[a2a_group, p2p_group]"),
    ({"cp_global_ranks": [0, 1], "cp_stream": "stream"}, "cp_stream", "torch.cuda.Stream"),
])
def test_context_parallel_arguments_are_checked_before_they_are_set(fake_pair, kwargs, argument, says):
    with pytest.raises(ValueError, match=argument) as error:
        DotProductAttention(HEADS, DIM, cp_group=fake_pair, **kwargs)
    assert says in str(error.value)
    m = DotProductAttention(HEADS, DIM)
    kwargs = {"cp_global_ranks": None, "cp_stream": None, **kwargs}
    with pytest.raises(ValueError, match=argument):
        m.set_context_parallel_group(fake_pair, **kwargs)
    assert (m.cp_group, m.cp_global_ranks, m.cp_stream, m.cp_comm_type) == (None, None, None, "p2p")  # unchanged


def test_context_parallel_hierarchical_a2a_is_refused_and_all_gather_needs_no_ranks(fake_pair):
    import torch.distributed as dist
    with pytest.raises(ValueError, match="cp_comm_type='a2a\\+p2p' with an a2a group of 2 ranks"):
        DotProductAttention(HEADS, DIM, cp_group=[fake_pair, dist.new_group([0])], cp_comm_type="a2a+p2p")
    # TE's all_gather does not read cp_global_ranks; a group of one rank (TE's cp_size 1) is no parallelism.
    DotProductAttention(HEADS, DIM, cp_group=fake_pair, cp_comm_type="all_gather")
    alone = DotProductAttention(HEADS, DIM, qkv_format="bshd", window_size=(1, 0), cp_group=dist.new_group([0]))
    q, k, v = _qkv()
    torch.testing.assert_close(alone(q, k, v), DotProductAttention(HEADS, DIM, qkv_format="bshd",
                                                                   window_size=(1, 0))(q, k, v))
    m = DotProductAttention(HEADS, DIM, cp_group=fake_pair, cp_global_ranks=[0, 1])
    m.set_context_parallel_group(None, None, None)  # off again: the default sbhd call on the whole sequence
    assert m.cp_group is None and m(*_qkv("sbhd")).shape == (4, 2, HEADS * DIM)


def test_context_parallel_debug_config_names_it_as_te(fake_pair, monkeypatch, caplog):
    """NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2: the config line carries TE's AttentionParams fields context_parallel,
    cp_comm_type and cp_size (a refused call logs nothing: the checks run first)."""
    monkeypatch.setenv("NVTE_DEBUG", "1")
    monkeypatch.setenv("NVTE_DEBUG_LEVEL", "2")
    from opdispatch.compat import te
    monkeypatch.setattr(te, "_SEEN_KEYS", {})
    monkeypatch.setattr(te, "_LOGGED_CHOICE", {})
    m = DotProductAttention(HEADS, DIM, qkv_format="bshd", cp_group=fake_pair, cp_global_ranks=[0, 1],
                            cp_comm_type="all_gather")
    caplog.set_level(logging.DEBUG, logger="DotProductAttention")
    with pytest.raises(ValueError, match="window_size"):
        m(*_qkv(), window_size=(1, 0))
    assert not [r for r in caplog.records if r.name == "DotProductAttention"]
    q, k, v = _qkv()
    assert m.explain(q, k, v).chosen_id is not None  # this rank's diagonal block, planned without an exchange
    from opdispatch.compat.te import _log_selection
    plan = m._plan(q, k, v, None, None, None, None, None, None, None, None, None, None, None, "no_bias", None, None,
                   None, None, False, None, None, None, None, None, None, -3)
    _log_selection(m.logger, plan)
    config = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("Running with config="))
    assert "'context_parallel': True" in config and "'cp_comm_type': 'all_gather'" in config \
        and "'cp_size': 2" in config, config
