"""Fake `torch_npu` (Huawei Ascend Extension for PyTorch): `npu_fusion_attention` with its published signature
and semantics (Ascend/op-plugin docs/context/torch_npu-npu_fusion_attention.md; mindstudio-probe's float64 golden
of the op), computed in float64 and differentiable through autograd as the real op is (its autograd formula is
npu_fusion_attention_grad).

What it enforces, so an adapter's argument mapping is what a test checks:
- layouts BSH, SBH, BSND, BNSD, TND (TND needs actual_seq_qlen/actual_seq_kvlen: cumulative ends, host lists);
  head_num = q's heads; Nq a multiple of Nkv; q/k/v one dtype (fp16/bf16).
- scores = (q·kᵀ + pse) * scale; masked positions get -40000 added (the golden's constant), so a row the mask
  blinds averages the values rather than giving zeros.
- atten_mask None: full computation, sparse_mode/pre_tockens/next_tockens ignored (as documented).
- sparse_mode 0: the mask (SS, 11SS, B1SS or BNSS; True = masked) and the band pre/next (top-left origin, the
  golden's); 1: the mask alone; 2/3: leftUp/rightDown causal per sequence, requiring the compressed 2048x2048
  upper-triangular mask; 4: band between pre_tockens and next_tockens from the bottom-right corner (the
  reference's origin), with that compressed mask. Other modes raise.
- keep_prob < 1: dropout with a mask drawn from a generator seeded by `seed`, kept and recorded (`calls`), scaled
  by 1/keep_prob after the softmax (the golden).
- returns (attention_out, softmax_max, softmax_sum, softmax_out, seed, offset, numels): softmax_max/sum are fp32
  (B, N, Sq, 8) (TND: (T, N, 8)), eight equal copies of the row max of the scaled, masked scores and of
  sum(exp(score - max)); they carry no gradient.
"""

from __future__ import annotations

import types

import torch

COMPRESSED = 2048
MASKED = -40000.0


def _compressed(mask: torch.Tensor | None, mode: int) -> None:
    assert mask is not None, f"sparse_mode {mode} needs the compressed atten_mask"
    want = torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool).triu(1)
    assert mask.dtype == torch.bool and tuple(mask.shape) == (COMPRESSED, COMPRESSED), mask.shape
    assert torch.equal(mask.cpu(), want), f"sparse_mode {mode} needs triu(ones(2048, 2048), 1)"


def _masked(sq: int, sk: int, mode: int, atten_mask, pre: int, nxt: int, b: int, batch: int,
            heads: int) -> torch.Tensor:
    """Bool (heads or 1, sq, sk), True = masked, for sequence `b` of `batch`."""
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    if mode in (0, 1):
        assert atten_mask is not None and atten_mask.dtype in (torch.bool, torch.uint8)
        assert atten_mask.dim() in (2, 4) and tuple(atten_mask.shape[-2:]) == (sq, sk), atten_mask.shape
        m = atten_mask.bool().cpu()
        if m.dim() == 4:
            assert m.shape[0] in (1, batch) and m.shape[1] in (1, heads), m.shape
            if m.shape[1] == heads > 1 and m.shape[0] == 1 < batch:
                raise AssertionError("atten_mask 1NSS is not a documented format (BNSS, B1SS, 11SS, SS)")
            m = m[b if m.shape[0] > 1 else 0]
        if mode == 0:
            m = m | (j - i > nxt) | (i - j > pre)
        return m
    _compressed(atten_mask, mode)
    if mode == 2:
        return j > i
    if mode == 3:
        return j > i + (sk - sq)
    if mode == 4:
        rel = j - i - (sk - sq)
        return (rel > nxt) | (rel < -pre)
    raise NotImplementedError(f"fake torch_npu: sparse_mode {mode}")


def _attend(q, k, v, masked, scale, pse, keep_prob, gen):
    """q (n, sq, d), k/v (nk, sk, d) float64 → out (n, sq, dv), max (n, sq), sum (n, sq), drop mask."""
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = q @ k.transpose(-1, -2)
    if pse is not None:
        s = s + pse
    s = s * scale
    if masked is not None:
        s = s + masked.to(s.dtype) * MASKED
    mx = s.amax(-1, keepdim=True)
    e = torch.exp(s - mx)
    sm = e.sum(-1, keepdim=True)
    p = e / sm
    drop = None
    if keep_prob < 1.0:
        drop = (torch.rand(p.shape, generator=gen, dtype=torch.float64) < keep_prob)
        p = p * drop / keep_prob
    return p @ v, mx.squeeze(-1).detach(), sm.squeeze(-1).detach(), drop


def make(calls: list, *, old_signature: bool = False) -> dict[str, types.ModuleType]:
    """`old_signature`: a build whose npu_fusion_attention takes none of the keywords past input_layout."""
    def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                             atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=2147483647,
                             next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
                             actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):
        record = dict(query=query, key=key, value=value, head_num=head_num, input_layout=input_layout, pse=pse,
                      atten_mask=atten_mask, scale=scale, keep_prob=keep_prob, pre_tockens=pre_tockens,
                      next_tockens=next_tockens, actual_seq_qlen=actual_seq_qlen,
                      actual_seq_kvlen=actual_seq_kvlen, sparse_mode=sparse_mode, sync=sync, drop=[])
        calls.append(record)
        assert padding_mask is None and prefix is None
        assert query.dtype == key.dtype == value.dtype and query.dtype in (torch.float16, torch.bfloat16)
        assert isinstance(head_num, int) and isinstance(scale, float) and 0.0 < keep_prob <= 1.0
        dtype = query.dtype
        n = head_num
        qf, kf, vf = query.double(), key.double(), value.double()
        if input_layout == "TND":
            assert isinstance(actual_seq_qlen, list) and isinstance(actual_seq_kvlen, list)
            assert qf.dim() == 3 and qf.shape[1] == n
            assert len(actual_seq_qlen) == len(actual_seq_kvlen)
            assert actual_seq_qlen[-1] == qf.shape[0] and actual_seq_kvlen[-1] == kf.shape[0]
            seqs = []
            for e_q, e_k, s_q, s_k in zip(actual_seq_qlen, actual_seq_kvlen, [0] + actual_seq_qlen[:-1],
                                          [0] + actual_seq_kvlen[:-1]):
                seqs.append((qf[s_q:e_q].transpose(0, 1), kf[s_k:e_k].transpose(0, 1),
                             vf[s_k:e_k].transpose(0, 1)))
            assert atten_mask is None or sparse_mode in (2, 3, 4), "TND: compressed-mask modes only in this fake"
        else:
            assert actual_seq_qlen is None and actual_seq_kvlen is None
            if input_layout in ("BSH", "SBH"):
                assert qf.dim() == 3 and qf.shape[-1] % n == 0
                d = qf.shape[-1] // n
                perm = (0, 2, 1, 3) if input_layout == "BSH" else (1, 2, 0, 3)
                qf = qf.unflatten(-1, (n, d)).permute(perm)
                kf = kf.unflatten(-1, (-1, d)).permute(perm)
                vf = vf.unflatten(-1, (kf.shape[1], -1)).permute(perm)
            elif input_layout == "BSND":
                qf, kf, vf = (t.transpose(1, 2) for t in (qf, kf, vf))
            else:
                assert input_layout == "BNSD", input_layout
            assert qf.shape[1] == n, f"head_num {n} but q has {qf.shape[1]} heads"
            seqs = [(qf[b], kf[b], vf[b]) for b in range(qf.shape[0])]
        assert n % seqs[0][1].shape[0] == 0 and n <= 256
        gen = torch.Generator().manual_seed(1234)
        outs, maxes, sums = [], [], []
        for b, (qs, ks, vs) in enumerate(seqs):
            masked = None
            if atten_mask is not None:
                masked = _masked(qs.shape[1], ks.shape[1], sparse_mode, atten_mask, pre_tockens, next_tockens, b,
                                  len(seqs), n)
            ps = None
            if pse is not None:
                ps = pse.double()[b if pse.shape[0] > 1 else 0]
            o, mx, sm, drop = _attend(qs, ks, vs, masked, scale, ps, keep_prob, gen)
            record["drop"].append(drop)
            outs.append(o)
            maxes.append(mx)
            sums.append(sm)
        if input_layout == "TND":
            out = torch.cat([o.transpose(0, 1) for o in outs])
            smax = torch.cat([m.transpose(0, 1) for m in maxes])
            ssum = torch.cat([s.transpose(0, 1) for s in sums])
        else:
            out = torch.stack(outs)  # (B, N, S, Dv)
            smax, ssum = torch.stack(maxes), torch.stack(sums)
            if input_layout == "BSND":
                out = out.transpose(1, 2)
            elif input_layout == "BSH":
                out = out.transpose(1, 2).flatten(2)
            elif input_layout == "SBH":
                out = out.permute(2, 0, 1, 3).flatten(2)
        eight = (*smax.shape, 8)
        return (out.to(dtype), smax.float().unsqueeze(-1).expand(eight).contiguous(),
                ssum.float().unsqueeze(-1).expand(eight).contiguous(), torch.empty(0, dtype=dtype), 1234, 0, 0)

    if old_signature:
        def npu_fusion_attention(query, key, value, head_num, input_layout):  # noqa: F811
            raise AssertionError("not to be called")

    mod = types.ModuleType("torch_npu")
    mod.__path__ = []
    mod.npu_fusion_attention = npu_fusion_attention
    mod.__version__ = "2.5.1"
    return {"torch_npu": mod}
