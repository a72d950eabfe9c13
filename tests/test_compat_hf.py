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


def test_training_gradients_match_eager(basic_manager):
    eager, ours = (m.train() for m in models(tiny(transformers.LlamaConfig, attention_dropout=0.0), "eager",
                                               "opdispatch"))
    ids, mask = batch(seed=2, left_pad=(0, 0))
    for model in (eager, ours):
        model(ids, attention_mask=mask, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(eager.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_each_layer_runs_in_its_module_scope(basic_manager, tmp_path):
    seen: list[str | None] = []

    class Spy(opdispatch.AttentionImpl):
        vendor, name = "spy", "layer"
        caps: ClassVar[opdispatch.AttentionCaps] = opdispatch.AttentionCaps(
            dtypes=frozenset({torch.float32}), layouts=frozenset({"bhsd"}), gqa=True, causal=True, attn_mask=True,
            causal_alignments=frozenset({"top_left"}))

        def run(self, call):
            seen.append(call.module)
            ref = opdispatch.get_manager().registry.get("attention", "cpu.flash").impl
            return ref.run(call)

    basic_manager.register_impl(Spy())
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
