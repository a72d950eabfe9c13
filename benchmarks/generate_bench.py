"""transformers' generate(): tokens per second with attn_implementation="opdispatch" against "sdpa".

The same Llama-shaped model (built from a config, random weights, eval mode) generates greedily with each attention
implementation, batch 1 and a padded batch (left padding, prompts of unequal lengths), with the model's dynamic KV
cache; the generated tokens are compared, and the time of each generate() call is measured after a warm-up generate of
the same shape. Tokens that differ are explained or the run fails: sdpa's sequence is fed back through each model in
one forward (no cache), against the same model in float32 with eager attention, and the report gives where the
sequences part, sdpa's top-two logit gap there, and each implementation's largest logit error against float32 — a part
at a near tie (sdpa's top-two gap at most twice its own largest logit error), with opdispatch no further from float32
than sdpa (at most 1.25x its error), is two roundings of the same computation. Reps alternate between the two
implementations so both see the same machine state, in alternating order. Each implementation runs on two copies of
the model, one built before and one after the other implementation's (with --copies 4, also the mirror order): the
model built first ran ~1-2% faster on CPU whatever its attention (two sdpa models: 0.99x; the opdispatch model built
second: 0.98x, built first: 1.00-1.01x), so one build order would bias the ratio; --control runs sdpa in both columns,
to read what the harness reports for equal models. tokens/s counts the new tokens of every sequence in the batch. The
report gives the ratio of the median calls and of the fastest calls (on a shared host, noise only adds time).

    python benchmarks/generate_bench.py --size tiny --out benchmarks/results/generate-cpu.md          # CPU
    python benchmarks/generate_bench.py --size 100m --batches 1,8,32 --out generate-h100.md           # GPU, bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_loop import _path_counts, environment  # noqa: E402  (one environment block for every benchmark)
from generate_runs import paired_ratios  # noqa: E402

SIZES = {
    # hidden, layers, heads, kv heads, intermediate, vocab
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=688, vocab_size=4096),
    # ~100M parameters, Llama-shaped (GQA 4:1, head dim 64)
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000),
}


def build(size: str, attn: str, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], max_position_embeddings=4096, pad_token_id=0)
    model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
    model.set_attn_implementation(attn)
    return model


def prompts(batch: int, prompt_len: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts: in a batch of more than one, every other prompt is a quarter shorter."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (batch, prompt_len), generator=gen)
    mask = torch.ones(batch, prompt_len, dtype=torch.long)
    if batch > 1:
        mask[1::2, : prompt_len // 4] = 0
        ids[mask == 0] = 0
    return ids.to(device), mask.to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def divergence(ids: torch.Tensor, outputs: dict[str, list[torch.Tensor]], copies: dict[str, list[Any]], size: str,
               device: torch.device) -> dict[str, Any]:
    """Where sdpa's and opdispatch's greedy tokens part, and whether that is rounding (see the module docstring)."""
    want = outputs["sdpa"][0]
    other = next(out for out in (*outputs["sdpa"][1:], *outputs["opdispatch"]) if not torch.equal(out, want))
    row, first = (want != other).nonzero()[0].tolist() if want.shape == other.shape else (0, ids.shape[1])
    reference = build(size, "eager", device, torch.float32)
    with torch.no_grad():
        seq = want[row:row + 1]
        exact = reference(seq).logits.float()
        logits = {attn: models[0](seq).logits.float() for attn, models in copies.items()}
    top2 = logits["sdpa"][0, first - 1].topk(2).values
    errors = {attn: float((lg - exact).abs().max()) for attn, lg in logits.items()}
    gap = float(top2[0] - top2[1])
    return {"first_difference": first - ids.shape[1], "sequence": row, "sdpa_top2_gap": gap,
            "max_logit_error_vs_float32": errors,
            "rounding": gap <= 2 * errors["sdpa"] and errors["opdispatch"] <= 1.25 * errors["sdpa"]}


def attention_host_time(copies: dict[str, list[Any]], ids: torch.Tensor, kwargs: dict[str, Any],
                        device: torch.device) -> tuple[dict[str, float], dict[str, int], int]:
    """µs of host time per call of each implementation's attention function (transformers' registered one, timed
    around the call without a sync: in a host-bound generate() this is what a call costs the loop), over one
    generate() of each model copy; and which of opdispatch's slow-path branches its calls took there (counts; a
    call in none of them was served by the compiled door's exact or size-generic entries), of how many calls."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    spent: dict[str, list[float]] = {attn: [] for attn in copies}

    def timed(attn: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            result = fn(*args, **kw)
            spent[attn].append(time.perf_counter() - start)
            return result
        return wrapper

    originals = {attn: ALL_ATTENTION_FUNCTIONS[attn] for attn in copies}
    try:
        for attn, fn in originals.items():
            ALL_ATTENTION_FUNCTIONS[attn] = timed(attn, fn)
        with torch.no_grad(), _path_counts() as paths:
            for attn, models in copies.items():
                for model in models:
                    if attn == "opdispatch":
                        before = dict(paths)
                    model.generate(ids, **kwargs)
                    sync(device)
                    if attn == "opdispatch":
                        paths_in_opdispatch = {k: v - before[k] for k, v in paths.items()}
    finally:
        for attn in originals:
            del ALL_ATTENTION_FUNCTIONS[attn]  # the local override; the registered function shows through again
    calls = len(spent["opdispatch"]) // len(copies["opdispatch"])
    return ({attn: 1e6 * statistics.median(times) for attn, times in spent.items() if times}, paths_in_opdispatch,
            calls)


def attention_kernels(copies: dict[str, list[Any]], ids: torch.Tensor, kwargs: dict[str, Any]) -> dict[str, list[str]]:
    """The attention kernels (CUDA kernel names with flash, fmha, attention, sdpa or cudnn in them, and their counts)
    that one generate() of each implementation's first copy launched: whether both ran the same kernel."""
    from torch.profiler import ProfilerActivity, profile

    found: dict[str, list[str]] = {}
    for attn, models in copies.items():
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            models[0].generate(ids, **kwargs)
            torch.cuda.synchronize()
        found[attn] = sorted(f"{e.key[:90]} x{e.count}" for e in prof.key_averages()
                             if any(word in e.key.lower() for word in ("flash", "fmha", "attention", "sdpa", "cudnn")))
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--batches", default="1,4", help="comma-separated batch sizes (default 1,4)")
    p.add_argument("--prompt", type=int, default=64, help="prompt length (default 64)")
    p.add_argument("--new", type=int, default=64, help="new tokens per sequence (default 64)")
    p.add_argument("--reps", type=int, default=5, help="timed generate() calls per implementation (default 5)")
    p.add_argument("--out", type=Path, help="markdown here, JSON beside it")
    p.add_argument("--copies", type=int, choices=(2, 4), default=2,
                   help="model copies per implementation (2: built sdpa, opdispatch, opdispatch, sdpa; 4: and the "
                        "mirror of that)")
    p.add_argument("--control", action="store_true",
                   help="an A/A check: opdispatch's copies run sdpa (the ratio the harness reads for equal models)")
    p.add_argument("--host-time", action="store_true",
                   help="after the timed calls, one generate() per copy timing each attention call's host time")
    args = p.parse_args(argv)
    import opdispatch.compat.hf  # noqa: F401  (registers attn_implementation="opdispatch")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    env = environment(device)
    import transformers

    env["transformers"] = transformers.__version__
    # Builds of each in both orders (see the module docstring): sdpa, opdispatch, opdispatch, sdpa, and with
    # --copies 4 the mirror after it (opdispatch, sdpa, sdpa, opdispatch), so no implementation holds the first
    # or the last build. --control builds sdpa in opdispatch's place: what the harness reads for two equal models.
    copies: dict[str, list[Any]] = {"sdpa": [], "opdispatch": []}
    builds = ("sdpa", "opdispatch", "opdispatch", "sdpa", "opdispatch", "sdpa", "sdpa", "opdispatch")[:2 * args.copies]
    for attn in builds:
        copies[attn].append(build(args.size, "sdpa" if args.control else attn, device, dtype))
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        ids, mask = prompts(batch, args.prompt, SIZES[args.size]["vocab_size"], device)
        kwargs = dict(attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
        outputs: dict[str, Any] = {}
        times: dict[str, list[float]] = {attn: [] for attn in copies}
        with torch.no_grad():
            for attn, models in copies.items():  # warm-up: the first generate of a shape (plans, kernels)
                outputs[attn] = [model.generate(ids, **kwargs) for model in models]
            for rep in range(args.reps):
                for attn in ("sdpa", "opdispatch") if rep % 2 == 0 else ("opdispatch", "sdpa"):
                    for model in copies[attn]:
                        sync(device)
                        start = time.perf_counter()
                        model.generate(ids, **kwargs)
                        sync(device)
                        times[attn].append(time.perf_counter() - start)
        same = all(torch.equal(outputs["sdpa"][0], out) for out in (*outputs["sdpa"][1:], *outputs["opdispatch"]))
        row: dict[str, Any] = {"batch": batch, "prompt": args.prompt, "new_tokens": args.new, "same_tokens": same,
                               "copies": args.copies, "reps": args.reps}
        if not same:
            row["divergence"] = divergence(ids, outputs, copies, args.size, device)
        for attn in copies:
            median = statistics.median(times[attn])
            row[f"{attn}_s"] = median
            row[f"{attn}_times_s"] = times[attn]
            row[f"{attn}_tokens_per_s"] = batch * args.new / median
        row["ratio"] = row["opdispatch_tokens_per_s"] / row["sdpa_tokens_per_s"]
        row["ratio_of_fastest"] = min(times["sdpa"]) / min(times["opdispatch"])  # host noise only adds time
        # per rep, the two implementations' back-to-back sums: immune to the host's speed drifting across the run
        row["paired_ratio"] = statistics.median(paired_ratios(times["sdpa"], times["opdispatch"], args.copies))
        if args.host_time:
            row["attention_host_us"], row["slow_path_counts"], row["attention_calls"] = attention_host_time(
                copies, ids, kwargs, device)
            if device.type == "cuda":
                row["attention_kernels"] = attention_kernels(copies, ids, kwargs)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    title = "sdpa vs sdpa (the A/A control: sdpa in opdispatch's column)" if args.control else "opdispatch vs sdpa"
    lines = [f"# generate(): {title} ({args.size} Llama-shaped model, greedy, {str(dtype)[6:]})", "",
             f"{env['device']}; torch {env['torch']}" + (f", CUDA {env.get('cuda')}, cuDNN {env.get('cudnn')}"
                                                         if "cuda" in env else "")
             + f"; transformers {env['transformers']}; commit {env.get('commit')}", "",
             f"Prompt {args.prompt} tokens (in a batch, every other prompt left-padded by a quarter), {args.new} new "
             f"tokens per sequence, median of {args.reps} generate() calls on each of {args.copies} copies of each "
             f"model (built {', '.join(builds)}) after a warm-up one, reps alternating in alternating "
             "order.",
             "", "| batch | sdpa tokens/s | opdispatch tokens/s | opdispatch / sdpa | fastest call / fastest call | "
             "paired (median of the reps' ratios) | same tokens |", "|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        same_text = "yes" if r["same_tokens"] else (
            "no: rounding (below)" if r["divergence"]["rounding"] else "**no: NOT explained by rounding**")
        lines.append(f"| {r['batch']} | {r['sdpa_tokens_per_s']:.1f} | {r['opdispatch_tokens_per_s']:.1f} | "
                     f"{r['ratio']:.2f}x | {r['ratio_of_fastest']:.2f}x | {r['paired_ratio']:.3f}x | {same_text} |")
    for r in rows:
        if "attention_host_us" in r:
            host = r["attention_host_us"]
            lines += ["", f"Batch {r['batch']}: host time of one attention call (median over one generate() of each "
                      f"copy, the registered function timed around the call): sdpa {host['sdpa']:.1f} µs, "
                      f"opdispatch {host['opdispatch']:.1f} µs. opdispatch's slow path in one generate() of "
                      f"{r['attention_calls']} attention calls: " + ", ".join(
                          f"{k} {v}" for k, v in r["slow_path_counts"].items()) + "."]
            for attn, names in r.get("attention_kernels", {}).items():
                lines += ["", f"Attention kernels of one generate() with {attn}: " + "; ".join(
                    f"`{n}`" for n in names) + "."]
    for r in rows:
        if not r["same_tokens"]:
            d = r["divergence"]
            err = d["max_logit_error_vs_float32"]
            lines += ["", f"Batch {r['batch']}: sequence {d['sequence']} parts at new token {d['first_difference']}, "
                      f"where sdpa's top two logits are {d['sdpa_top2_gap']:.4f} apart; fed back in one forward, "
                      f"the largest logit error against the float32 model (eager attention) is "
                      f"{err['sdpa']:.4f} for sdpa and {err['opdispatch']:.4f} for opdispatch "
                      f"({'a near tie, rounded differently' if d['rounding'] else 'NOT a rounding difference'})."]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    return 0 if all(r["same_tokens"] or r["divergence"]["rounding"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
