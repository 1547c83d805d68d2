"""The fast path's step on a hybrid target at Qwen3.5-4B's text shape (random weights, bf16, batch 1), against the
target's own 1-token decode step, at 512 and 2048 tokens of context; with and without flash-linear-attention.

Shape: `hf-dflash bench`'s `qwen3.5-4b` (the published target's text config and z-lab's drafter for it, built by
`random_pair`); `hf-dflash bench --random-weights qwen3.5-4b` times the same step with whatever kernels are installed,
this script times it with and without flash-linear-attention, after checking output on tiny targets.

First, per variant, the fast path's output on tiny float32 hybrid targets (qwen3_5 text and multimodal, qwen3_next
with batched experts) against plain greedy, batch 1 and 3, with the step recorded as a graph. Then per context length:
- ours: the step's parts as CUDA graphs (`step_parts_ms`: propose, verify = target forward over 16 rows + acceptance
  + the linear layers' rollback, whole step), every sequence frozen so replays repeat the same work.
- the target's own 1-token step on the fast path's cache (`HybridStaticCache`), as a CUDA graph: bench's
  `target_1_token_graph_ms`, the floor every bench row is compared against. GPU only (absent on a CPU smoke run).
- with `--transformers-cache`, also the target's own 1-token step with transformers' StaticCache (a graph, else
  eager). Off by default: on the H200 with transformers 5.17 (2026-12-03) recording it hit a CUDA device-side assert,
  which leaves the process unable to go on, so it took every other figure of the run with it.

transformers picks the gated-delta-rule and conv kernels when its modeling module is imported: flash-linear-attention
(`fla`) and `causal_conv1d` if installed, else its PyTorch code. Each variant runs in its own process; "without fla"
hides the package from that process. The run prints progress and writes JSON (about 2-3 minutes on an H200).

    python benchmarks/gpu/hybrid_step.py --out hybrid_step.json
    python benchmarks/gpu/hybrid_step.py --device cpu --tiny --out /tmp/smoke.json   # a smoke run of the script
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time

import torch

CONTEXTS = (512, 2048)
TINY = dict(
    hidden_size=64, num_hidden_layers=4, intermediate_size=96, vocab_size=256, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16,
)


def timed_ms(fn, device: str, graph: bool, replays: int = 30) -> float:
    """Median ms of `fn`: a CUDA graph replay when `graph`, else eager calls."""
    from hf_dflash.bench import _graph_ms

    if graph:
        return _graph_ms(fn, replays)
    fn()  # warm-up
    times = []
    for _ in range(replays if device == "cuda" else 3):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def own_cache_step_ms(target, context: int, device: str) -> dict:
    """The target's 1-token decode step with transformers' StaticCache (graph if it can be recorded, else eager)."""
    from transformers import StaticCache

    from hf_dflash.modeling.dflash_decoding import _cache_argument

    cache = StaticCache(config=target.config, max_cache_len=context + 8)
    argument = _cache_argument(target)
    prompt = torch.randint(0, target.config.vocab_size - 1, (1, context), device=device)
    target(input_ids=prompt, use_cache=True, **{argument: cache})
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    position = torch.tensor([[context]], device=device)

    def step() -> None:
        target(input_ids=token, position_ids=position, cache_position=position[0], use_cache=True, logits_to_keep=1,
               **{argument: cache})

    if device == "cuda":
        try:
            return {"ms": timed_ms(step, device, graph=True), "graph": True}
        except Exception as error:  # noqa: BLE001 (recorded: the reason the floor is eager)
            reason = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            print(f"  transformers' StaticCache 1-token step did not record as a CUDA graph ({reason}); timing it "
                  "eagerly")
            return {"ms": timed_ms(step, device, graph=False), "graph": False, "graph_error": reason}
    return {"ms": timed_ms(step, device, graph=False), "graph": False}


def graph_output_check(device: str) -> dict:
    """Before timing: on tiny float32 hybrid targets (the CI tests' builders), the fast path's output equals plain
    greedy generate, batch 1 and a left-padded batch of 3, and on CUDA the step ran as a recorded graph."""
    sys.path.insert(0, ".")
    from hf_dflash.modeling.dflash_fast_path import release_fast_path
    from tests.conftest import random_prompt, tiny_drafter
    from tests.test_batched import PAD, left_pad
    from tests.test_families import family_target

    results = {}
    for family in ("qwen3_5_text", "qwen3_5", "qwen3_next"):
        target = family_target(family, seed=3, initializer_range=0.2).to(device)
        if getattr(target.config.get_text_config(), "num_experts", 0):
            target.set_experts_implementation("batched_mm")  # graph-safe experts
        drafter = tiny_drafter(target, block_size=5).to(device)
        for name, batch in (("batch 1", {"input_ids": random_prompt(6, seed=1)}),
                            ("batch 3", left_pad([random_prompt(n, seed=n) for n in (4, 9, 2)]))):
            batch = {key: value.to(device) for key, value in batch.items()}
            common = dict(max_new_tokens=24, do_sample=False, pad_token_id=PAD)
            plain = target.generate(**batch, **common)
            fast = target.generate(**batch, assistant_model=drafter, dflash_fast_path=True, **common)
            graphed = bool(drafter._dflash_static_step[1].graphs) or device != "cuda"
            results[f"{family} {name}"] = bool(torch.equal(plain, fast)) and graphed
            print(f"  check {family} {name}: fast == plain {torch.equal(plain, fast)}, graph {graphed}", flush=True)
        release_fast_path(drafter)
    return results


@torch.no_grad()
def measure(args) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_dflash import DFlashConfig, DFlashDraftModel
    from hf_dflash.bench import random_pair, step_parts_ms, target_1_token_graph_ms
    from hf_dflash.modeling.dflash_acceptance import DecodingRule
    from hf_dflash.modeling.dflash_decoding import _cache_argument
    from hf_dflash.modeling.dflash_fast_path import release_fast_path, static_step_for
    from hf_dflash.modeling.dflash_processors import StepProcessors

    device, dtype = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    started = time.perf_counter()
    if args.tiny:
        config = AutoConfig.for_model("qwen3_5_text", **TINY)
        with torch.device(device):
            target = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
            drafter_config = DFlashConfig.for_target(config, num_hidden_layers=2, block_size=16,
                                                     mask_token_id=TINY["vocab_size"] - 1)
            drafter = DFlashDraftModel._from_config(drafter_config, dtype=dtype).eval()
    else:
        target, drafter = random_pair("qwen3.5-4b", dtype, device)
    vocab = drafter.config.mask_token_id  # random prompt ids below the mask token
    linear = type(next(layer.linear_attn for layer in target.model.layers if hasattr(layer, "linear_attn")))
    kernels = chunk_rule_kernels(sys.modules[linear.__module__])
    print(f"[{args.variant}] built in {time.perf_counter() - started:.0f} s; chunked gated delta rule from {kernels}",
          flush=True)
    checks = graph_output_check(device)
    rows = []
    for context in (64, 128) if args.tiny else CONTEXTS:
        step = static_step_for(target, drafter, 1, context + 64, _cache_argument(target))
        step.bind(StepProcessors([]), DecodingRule(do_sample=False, rejection=False), keep_scores=False, keep_logits=False)
        prompt = torch.randint(0, vocab, (1, context), device=device)
        step.prefill(prompt, torch.ones_like(prompt), context + 64, StepProcessors([]))
        step.active.zero_()  # frozen: every replay repeats the same work
        if device == "cuda":
            row = {"context": context, **step_parts_ms(step), "target_1_token_graph_ms": target_1_token_graph_ms(step)}
        else:
            rows_ = step.rows(1)
            with step.generator.capture:
                row = {"context": context, "step_ms_eager": timed_ms(lambda: step.step(rows_), device, graph=False)}
        print(f"[{args.variant}] context {context}: {json.dumps(row)}", flush=True)  # before anything that may fail
        if args.transformers_cache:
            row["target_1token_transformers_static_cache"] = own_cache_step_ms(target, context, device)
        rows.append(row)
        release_fast_path(drafter)
        if device == "cuda":
            torch.cuda.empty_cache()
    return {
        "variant": args.variant, "output_checks": checks, "chunk_rule_kernels": kernels,
        "shape": {key: getattr(target.config, key) for key in ("hidden_size", "num_hidden_layers", "vocab_size")},
        "dtype": str(dtype), "rows": rows,
    }


def chunk_rule_kernels(module) -> list[str]:
    """The modules of the functions transformers' kernel dispatcher for the chunked rule holds (its closure): the
    modeling module's own PyTorch code, or flash-linear-attention's kernel when it picked that one."""
    dispatcher = module.torch_chunk_gated_delta_rule
    held = [cell.cell_contents for cell in dispatcher.__closure__ or ()]
    return sorted({f"{f.__module__}.{f.__name__}" for f in held if callable(f) and hasattr(f, "__module__")})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke run of the script)")
    parser.add_argument("--transformers-cache", action="store_true",
                        help="also time the target's 1-token step on transformers' StaticCache (see above)")
    parser.add_argument("--variant", choices=("with-fla", "without-fla"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # a child process: measure one variant, print its JSON last
        if args.variant == "without-fla":
            sys.modules["fla"] = None  # importing fla now fails: transformers falls back to its PyTorch code
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return 0
    from hf_dflash.bench import run_environment

    fla = importlib.util.find_spec("fla") is not None
    print(f"flash-linear-attention installed: {fla}", flush=True)
    variants = ["with-fla", "without-fla"] if fla else ["without-fla"]
    results = []
    for variant in variants:
        command = [sys.executable, __file__, "--out", args.out, "--device", args.device, "--variant", variant]
        command += ["--tiny"] if args.tiny else []
        command += ["--transformers-cache"] if args.transformers_cache else []
        child = subprocess.run(command, capture_output=True, text=True)
        for line in child.stdout.splitlines():
            if line.startswith("RESULT "):
                results.append(json.loads(line[len("RESULT "):]))
            else:
                print(line, flush=True)
        if child.returncode:
            print(child.stderr[-3000:], flush=True)
            results.append({"variant": variant, "error": child.stderr[-3000:]})
    fla_version = None
    if fla:
        from importlib.metadata import PackageNotFoundError, version

        try:
            fla_version = version("flash-linear-attention")
        except PackageNotFoundError:
            fla_version = "installed (version unknown)"
    report = {**run_environment(args.device, **({"flash-linear-attention": fla_version} if fla else {})),
              "fla_installed": fla, "variants": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    checked = all(all(r.get("output_checks", {}).values()) for r in results)
    print("output checks: " + ("all equal to plain greedy" if checked else "SOME FAILED (see above)"))
    return 0 if checked and all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
