"""attn_implementation="opdispatch" in Hugging Face transformers: tiny models built from configs (no hub, no
weights) give the logits, generated tokens and gradients of transformers' own eager attention (the independent
math) and of its sdpa path, with padding, KV-cache decoding, sliding windows, training and torch.compile; each
layer's module path reaches opdispatch.scope()."""

from __future__ import annotations

import copy
from typing import ClassVar

import pytest
import torch

import opdispatch

transformers = pytest.importorskip("transformers", minversion="5.0")
import opdispatch.compat.hf  # noqa: E402  (registers attn_implementation="opdispatch")

VOCAB = 96


def tiny(config_cls, **overrides):
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    fields.update(overrides)
    return config_cls(**fields)


def models(config, *implementations):
    """The same weights under each attention implementation (each model with its own copy of the config: a model
    records its attention implementation in the config it is given)."""
    torch.manual_seed(0)
    out = []
    for name in implementations:
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name)
        if out:
            model.load_state_dict(out[0].state_dict())
        assert model.config._attn_implementation == name
        out.append(model)
    assert all(m.config._attn_implementation == n for m, n in zip(out, implementations))
    return out


def batch(seed=0, length=14, left_pad=(0, 5)):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(left_pad), length), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(left_pad):
        mask[row, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "mistral sliding window 4", "qwen2"])
def test_logits_match_eager_and_sdpa_with_padding(basic_manager, family):
    config = {"llama": lambda: tiny(transformers.LlamaConfig),
              "mistral sliding window 4": lambda: tiny(transformers.MistralConfig, sliding_window=4),
              "qwen2": lambda: tiny(transformers.Qwen2Config)}[family]()
    eager, sdpa, ours = (m.eval() for m in models(config, "eager", "sdpa", "opdispatch"))
    ids, mask = batch()
    before = basic_manager.decisions_made
    with torch.no_grad():
        want, also, got = (m(ids, attention_mask=mask).logits for m in (eager, sdpa, ours))
    assert basic_manager.decisions_made > before  # the model's attention went through opdispatch
    real = mask.bool()  # padded positions' logits are garbage in every implementation
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[real], also[real], atol=2e-5, rtol=2e-5)


def test_generation_with_the_kv_cache_gives_the_same_tokens(basic_manager):
    sdpa, ours = (m.eval() for m in models(tiny(transformers.LlamaConfig), "sdpa", "opdispatch"))
    ids, mask = batch(seed=1, length=9, left_pad=(0, 3))
    want = sdpa.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    before = basic_manager.decisions_made
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)
    # One decision per class of call (prefill with a mask, decode steps), not one per step.
    assert 0 < basic_manager.decisions_made - before <= 4


@pytest.mark.parametrize("module_rule", [False, True], ids=["unscoped", "scoped"])
def test_a_static_cache_generates_as_eager_on_both_paths(basic_manager, tmp_path, module_rule):
    """cache_implementation="static": the prefill's keys run past its queries into unwritten cache slots, which are
    dropped as transformers' sdpa path drops them; the same tokens as eager attention, on the unscoped common call
    and on the scoped one (a policy rule on `module:`)."""
    if module_rule:
        policy = tmp_path / "module-rule.yaml"
        policy.write_text("version: 1\nops:\n  attention:\n    rules:\n      - name: layers\n"
                          "        when: {module: 'model.layers.*'}\n        prefer: [cpu.flash]\n")
        basic_manager.set_policy(opdispatch.policies.load_policy(policy))
    eager, ours = (m.eval() for m in models(tiny(transformers.LlamaConfig), "eager", "opdispatch"))
    ids, mask = batch(seed=6, length=9, left_pad=(0, 0))
    kwargs = dict(max_new_tokens=8, do_sample=False, cache_implementation="static")
    want = eager.generate(ids, attention_mask=mask, **kwargs)
    got = ours.generate(ids, attention_mask=mask, **kwargs)
    assert torch.equal(got, want)
    assert basic_manager.policy.reads_module is module_rule


def test_training_gradients_match_eager(basic_manager):
    eager, ours = (m.train() for m in models(tiny(transformers.LlamaConfig, attention_dropout=0.0), "eager",
                                               "opdispatch"))
    ids, mask = batch(seed=2, left_pad=(0, 0))
    for model in (eager, ours):
        model(ids, attention_mask=mask, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(eager.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


def _module_spy(name: str, seen: list[str | None]) -> opdispatch.AttentionImpl:
    """An implementation `spy.<name>` that records each call's module (its scope) and computes it as cpu.flash."""

    class Spy(opdispatch.AttentionImpl):
        vendor = "spy"
        caps: ClassVar[opdispatch.AttentionCaps] = opdispatch.AttentionCaps(
            dtypes=frozenset({torch.float32}), layouts=frozenset({"bhsd"}), gqa=True, causal=True, attn_mask=True,
            causal_alignments=frozenset({"top_left"}))

        def run(self, call):
            seen.append(call.module)
            ref = opdispatch.get_manager().registry.get("attention", "cpu.flash").impl
            return ref.run(call)

    Spy.name = name
    return Spy()


def test_each_layer_runs_in_its_module_scope(basic_manager, tmp_path):
    seen: list[str | None] = []
    basic_manager.register_impl(_module_spy("layer", seen))
    policy = tmp_path / "layers.yaml"
    policy.write_text("version: 1\nops:\n  attention:\n    rules:\n      - name: spy-on-layer-1\n"
                      "        when: {module: 'model.layers.1.*'}\n        prefer: [spy.layer]\n")
    basic_manager.set_policy(opdispatch.policies.load_policy(policy))
    (model,) = models(tiny(transformers.LlamaConfig), "opdispatch")
    ids, mask = batch(seed=3, left_pad=(0, 2))
    with torch.no_grad():
        model.eval()(ids, attention_mask=mask)
    assert seen == ["model.layers.1.self_attn"]
    opdispatch.compat.hf.name_modules(model)
    assert model.model.layers[0].self_attn._opdispatch_name == "model.layers.0.self_attn"


def test_without_a_module_rule_no_call_is_scoped(basic_manager):
    """No policy rule reads `module:`, so no scope can change a decision: the layers' calls carry none (and share
    the compiled door's entries instead of one per layer). Under a module rule they are scoped: the test above."""
    seen: list[str | None] = []
    basic_manager.register_impl(_module_spy("noscope", seen))
    (model,) = models(tiny(transformers.LlamaConfig), "opdispatch")
    ids, mask = batch(seed=5, left_pad=(0, 0))
    with torch.no_grad(), opdispatch.policy_override(pin="spy.noscope"):
        model.eval()(ids)
    assert seen and set(seen) == {None}
    assert not basic_manager.policy.reads_module


def test_output_attentions_is_refused_with_a_way_out(basic_manager):
    (model,) = models(tiny(transformers.LlamaConfig), "opdispatch")
    ids, mask = batch()
    with pytest.raises(ValueError, match="use attn_implementation='eager'"):
        model.eval()(ids, attention_mask=mask, output_attentions=True)


@pytest.mark.slow
def test_torch_compile_runs_the_model_without_graph_breaks_in_attention(basic_manager):
    sdpa, ours = (m.eval() for m in models(tiny(transformers.LlamaConfig, num_hidden_layers=1), "sdpa",
                                           "opdispatch"))
    ids, mask = batch(seed=4, left_pad=(0, 0))
    compiled = torch.compile(ours, fullgraph=True)
    with torch.no_grad():
        got = compiled(ids, attention_mask=mask).logits
        want = sdpa(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_from_pretrained_and_set_attn_implementation(basic_manager, tmp_path):
    sdpa, = models(tiny(transformers.LlamaConfig), "sdpa")
    sdpa.save_pretrained(tmp_path / "tiny")  # a local checkpoint: no hub
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", attn_implementation="opdispatch")
    assert loaded.config._attn_implementation == "opdispatch"
    switched, = models(tiny(transformers.LlamaConfig), "sdpa")
    switched.set_attn_implementation("opdispatch")
    ids, mask = batch(seed=5)
    before = basic_manager.decisions_made
    with torch.no_grad():
        want = sdpa.eval()(ids, attention_mask=mask).logits
        for model in (loaded.eval(), switched.eval()):
            torch.testing.assert_close(model(ids, attention_mask=mask).logits[mask.bool()], want[mask.bool()],
                                       atol=2e-5, rtol=2e-5)
    assert basic_manager.decisions_made > before


# -- families whose attention takes more than q/k/v and the mask: sinks (s_aux) and relative position bias --------

def gpt_oss_config():
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128, attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def seq2seq_config(family):
    config_cls = {"t5": transformers.T5Config, "umt5": transformers.UMT5Config}[family]
    return config_cls(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                      num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)


def same_weights(config, auto, *implementations, sink_scale=0.0):
    """`models` for any auto class; GPT-OSS's sinks are set to trained-size values (they start at zero-ish)."""
    torch.manual_seed(0)
    out = []
    for name in implementations:
        model = auto.from_config(copy.deepcopy(config), attn_implementation=name)
        if out:
            model.load_state_dict(out[0].state_dict())
        elif sink_scale:
            with torch.no_grad():
                for module in model.modules():
                    if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                        module.sinks.normal_(0.0, sink_scale)
        out.append(model)
    return out


FAMILIES = {
    "gpt_oss": lambda: (gpt_oss_config(), transformers.AutoModelForCausalLM, False),
    "t5": lambda: (seq2seq_config("t5"), transformers.AutoModelForSeq2SeqLM, True),
    "umt5": lambda: (seq2seq_config("umt5"), transformers.AutoModelForSeq2SeqLM, True),
}


def run(model, seq2seq, ids, mask, **kwargs):
    if seq2seq:
        return model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :7] % 50 + 2, **kwargs)
    return model(ids, attention_mask=mask, **kwargs)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sinks_and_position_bias_families_match_eager(basic_manager, family):
    config, auto, seq2seq = FAMILIES[family]()
    eager, ours = (m.eval() for m in same_weights(config, auto, "eager", "opdispatch", sink_scale=3.0))
    ids, mask = batch(seed=5, length=12, left_pad=(0, 4))
    with torch.no_grad():
        want, got = (run(m, seq2seq, ids, mask).logits for m in (eager, ours))
    rows = slice(None) if seq2seq else mask.bool()  # decoder rows of a seq2seq model see no encoder padding
    torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=1e-5)
    assert (got[rows] - want[rows]).abs().max() < 1e-5


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sinks_and_position_bias_families_generate_as_eager(basic_manager, family):
    config, auto, _ = FAMILIES[family]()
    eager, ours = (m.eval() for m in same_weights(config, auto, "eager", "opdispatch", sink_scale=3.0))
    ids, mask = batch(seed=6, length=9, left_pad=(0, 3))
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert torch.equal(ours.generate(ids, **kwargs), eager.generate(ids, **kwargs))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sinks_and_position_bias_families_train_as_eager(basic_manager, family):
    config, auto, seq2seq = FAMILIES[family]()
    eager, ours = (m.train() for m in same_weights(config, auto, "eager", "opdispatch", sink_scale=3.0))
    ids, mask = batch(seed=7, length=10, left_pad=(0, 0))
    labels = ids[:, :7].contiguous() if seq2seq else ids
    for model in (eager, ours):
        run(model, seq2seq, ids, mask, labels=labels).loss.backward()
    special = 0
    for (name, a), (_, b) in zip(eager.named_parameters(), ours.named_parameters()):
        if a.grad is None:
            assert b.grad is None, name
            continue
        if name.endswith(("sinks", "relative_attention_bias.weight")):
            special += 1
            assert a.grad.abs().sum() > 0, name  # the learned sinks / relative bias do get a gradient
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert special >= 2


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sinks_and_position_bias_families_under_torch_compile(basic_manager, family):
    torch._dynamo.reset()
    config, auto, seq2seq = FAMILIES[family]()
    eager, ours = (m.eval() for m in same_weights(config, auto, "eager", "opdispatch", sink_scale=3.0))
    ids, mask = batch(seed=8, length=8, left_pad=(0, 0))
    compiled = torch.compile(lambda *a: run(ours, seq2seq, *a).logits, fullgraph=True)
    with torch.no_grad():
        got = compiled(ids, mask)
        want = run(eager, seq2seq, ids, mask).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_encoder_decoder_and_cross_attention_have_distinct_module_paths(basic_manager):
    seen: list[str | None] = []
    original = opdispatch.compat.hf.attention

    def spy(*args, **kwargs):
        seen.append(opdispatch.policies._overrides.MODULE.get())
        return original(*args, **kwargs)

    (model,) = same_weights(seq2seq_config("t5"), transformers.AutoModelForSeq2SeqLM, "opdispatch")
    ids, mask = batch(seed=9, length=6, left_pad=(0, 0))
    import unittest.mock

    with unittest.mock.patch.object(opdispatch.compat.hf, "attention", spy), torch.no_grad():
        run(model.eval(), True, ids, mask)
    assert set(seen) == {f"{side}.block.{n}.layer.{i}.{kind}" for n in (0, 1) for side, i, kind in (
        ("encoder", 0, "SelfAttention"), ("decoder", 0, "SelfAttention"), ("decoder", 1, "EncDecAttention"))}


def test_an_unknown_attention_argument_is_refused_at_the_first_forward(basic_manager):
    (model,) = models(tiny(transformers.LlamaConfig), "opdispatch")
    ids, mask = batch()
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn.*keyword argument seq_idx=.*not understood"):
        model.eval()(ids, attention_mask=mask, seq_idx=torch.zeros_like(ids))
    q = k = v = torch.randn(1, 4, 3, 8)
    module = torch.nn.Module()
    module._opdispatch_name = "my.attention"
    with pytest.raises(ValueError, match=r"my\.attention.*keyword argument block_indices="):
        opdispatch.compat.hf.attention_forward(module, q, k, v, None, block_indices=torch.zeros(2))
    # Arguments that cannot change the result given the mask pass; None is no argument.
    out, _ = opdispatch.compat.hf.attention_forward(module, q, k, v, None, sliding_window=4, position_ids=None,
                                                    output_attentions=False, foo=None)
    assert out.shape == (1, 3, 4, 8)


def test_packed_sequences_without_a_mask_run_as_varlen(basic_manager):
    gen = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 4, 9, 8, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 4, 9])
    module = torch.nn.Module()
    module._opdispatch_name = "packed"
    out, _ = opdispatch.compat.hf.attention_forward(module, q, k, v, None, is_causal=True, cu_seq_lens_q=cu,
                                                    cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
    for start, end in ((0, 4), (4, 9)):
        part = torch.nn.functional.scaled_dot_product_attention(q[:, :, start:end], k[:, :, start:end],
                                                                v[:, :, start:end], is_causal=True)
        torch.testing.assert_close(out[:, start:end], part.transpose(1, 2), atol=2e-6, rtol=2e-6)
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        opdispatch.compat.hf.attention_forward(module, q, k, v, None, cu_seq_lens_q=cu)


def test_an_attention_path_name_modules_does_not_recognise_is_named_once(basic_manager, tmp_path):
    """BERT-style `encoder.layer.0.attention.self`: name_modules does not name it, so the stack walk used to run
    (and rename the whole model) on every call; the module now takes its own path on first sight (under a policy
    with a `module:` rule, the only case that scopes a call)."""
    import torch

    from opdispatch.compat import hf

    policy = tmp_path / "module-rule.yaml"
    policy.write_text("version: 1\nops:\n  attention:\n    rules:\n      - name: any-layer\n"
                      "        when: {module: 'layer.*'}\n        prefer: [cpu.flash]\n")
    basic_manager.set_policy(opdispatch.policies.load_policy(policy))

    class SelfAttention(torch.nn.Module):
        def forward(self, x):
            return hf.attention_forward(self, x, x, x, None)[0]

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = torch.nn.Module()
            self.attention.self = SelfAttention()

        def forward(self, x):
            return self.attention.self(x)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.ModuleList([Layer(), Layer()])

        def forward(self, x):
            for layer in self.layer:
                x = layer(x)
            return x

    model = Model()
    x = torch.randn(1, 2, 5, 8)
    model(x)
    assert [layer.attention.self._opdispatch_name for layer in model.layer] == [
        "layer.0.attention.self", "layer.1.attention.self"]
