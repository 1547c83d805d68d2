"""The training loop: one code path for CPU, one GPU, or many GPUs/nodes under `accelerate launch` (data parallel).

The target is frozen and replicated on every process (not wrapped: it has no gradients to synchronize); only the
drafter goes through `accelerator.prepare`. Checkpoints (`accelerator.save_state`: drafter, optimizer, scheduler,
RNG states, plus the step counter) go to `<out_dir>/checkpoints/step_<n>` and resume exactly where they left off.
Every checkpoint also writes the drafter itself (weights, config, training_args.json) to `<out_dir>`, so a job
stopped from outside still leaves a usable drafter; `<out_dir>/train_log.jsonl` holds the curve (loss, simulated
tau, anchor blocks and training seconds so far).
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from tqdm.auto import tqdm
from transformers import PreTrainedModel, get_cosine_schedule_with_warmup

from ..modeling.dflash_compat import attention_implementation
from ..run_record import device_name, portable_command, portable_path
from .data import LengthGroupedSampler, RegeneratedData, TrainingSequences, collate_right_padded
from .objective import DFlashObjective
from .objective_dflash2 import DFlash2Objective


@dataclass
class TrainingArguments:
    """The recipe. Defaults are the published ones (lr 6e-4, cosine, 4% warmup, 6 epochs, length 3072, 512 anchors)."""

    out_dir: str
    steps: int | None = None  # overrides epochs when set
    epochs: float = 6.0
    batch_size: int = 1  # sequences per process per step
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_length: int = 3072
    max_anchors: int = 512
    gamma: float | None = None  # None: the published value for the block size
    seed: int = 0
    attention: str = "auto"  # "flex" (BlockMask), "dense" (boolean mask), or "auto": flex on GPU, dense on CPU
    mixed_precision: str = "auto"  # "auto": bf16 autocast on GPU, none on CPU
    save_every: int = 0  # checkpoint every N steps (0: only the final one)
    time_limit_s: float | None = None  # stop after this much wall time, checkpointed: `resume` carries on from there
    keep_checkpoints: int = 2  # older ones are deleted (a checkpoint holds the optimizer: 3x the drafter's size)
    resume: str | None = None  # a checkpoint directory, or "latest" under out_dir/checkpoints
    save_bf16: bool = False  # write the final drafter weights in bfloat16
    max_shard_size: str | None = None  # e.g. "15MB": drafter weights in shards (files that must stay small)
    group_by_length: bool = False  # batches of similar answer lengths (less padding), in a random order
    distill_topk: int = 0  # > 0: also learn the target's top-k distribution (see DFlashObjective)
    distill_weight: float = 0.5  # its weight against the hard label
    compile_loss: bool | None = None  # the loss's element-wise work through torch.compile; None: on GPU only
    log_every: int = 50  # steps per line of train_log.jsonl (means over those steps)
    progress: bool = True
    # Recorded as-is in training_args.json (command, data, ...); "history": the runs this one continues.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainingResult:
    steps: int  # optimizer steps done so far (fewer than planned when the time limit stopped the run)
    final_loss: float  # mean over the last (up to) 50 steps
    final_tau: float
    wall_time_s: float  # this run's and those it resumed from
    out_dir: Path
    anchor_blocks: int = 0  # blocks with a label trained on, over all processes (this run's and those it resumed)


def _checkpoints(out_dir: Path) -> list[Path]:
    return sorted((out_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))


def _latest_checkpoint(out_dir: Path) -> Path:
    found = [p for p in _checkpoints(out_dir) if (p / "trainer_state.json").is_file()]
    if not found:
        raise FileNotFoundError(f"no checkpoint to resume from under {out_dir / 'checkpoints'}")
    return found[-1]


def _save_checkpoint(
    accelerator: Accelerator, out_dir: Path, state: dict[str, float], anchor_rng: torch.Generator, keep: int
) -> None:
    """`state`: {"step": n, "wall_time_s": training time of all runs so far, "anchor_blocks": blocks so far}."""
    step = state["step"]
    path = out_dir / "checkpoints" / f"step_{step}"
    accelerator.save_state(str(path))
    torch.save(anchor_rng.get_state(), path / f"anchor_rng_{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (path / "trainer_state.json").write_text(json.dumps(state))  # written last: marks it complete
        for old in _checkpoints(out_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()


def _device_description(accelerator: Accelerator) -> str:
    return f"{accelerator.num_processes} x {device_name(accelerator.device)} ({accelerator.device.type})"


def train(
    target: PreTrainedModel,
    drafter: PreTrainedModel,
    data: RegeneratedData,
    args: TrainingArguments,
    accelerator: Accelerator | None = None,
) -> TrainingResult:
    """Train `drafter` against the frozen `target` on regenerated `data`; save it to `args.out_dir`. A DFlash2 drafter
    trains with `DFlash2Objective` (the block loss plus its selector's), a DFlash one with `DFlashObjective`."""
    if drafter.config.is_dflash2 and args.distill_topk:
        raise ValueError("distillation (distill_topk) trains DFlash drafters only; a DFlash2 drafter learns from the "
                         "hard labels, as published: leave distill_topk at 0")
    start_time = time.perf_counter()
    out_dir = Path(args.out_dir)
    on_gpu = torch.cuda.is_available()
    if accelerator is None:
        mixed = args.mixed_precision if args.mixed_precision != "auto" else ("bf16" if on_gpu else "no")
        accelerator = Accelerator(
            cpu=not on_gpu,
            mixed_precision=mixed,
            # The scheduler below counts optimizer steps of this process; don't let accelerate step it per process.
            step_scheduler_with_optimizer=False,
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        )
    set_seed(args.seed)
    # Anchors draw from their own generator (one stream per process), saved with each checkpoint: the global RNG is
    # also drawn by every new DataLoader iterator, so after a resume it would be at a different point.
    anchor_rng = torch.Generator(device=accelerator.device).manual_seed(args.seed + accelerator.process_index)

    attention = args.attention
    if attention == "auto":
        # FlexAttention has no CPU backward, and its GPU kernels need a head dim of at least 16 (stories260K has 8).
        use_flex = accelerator.device.type == "cuda" and drafter.config.head_dim >= 16
        attention = "flex" if use_flex else "dense"
    original_attention = attention_implementation(drafter.config)
    if attention == "flex":
        drafter.set_attn_implementation("flex_attention")
    target.to(accelerator.device)
    compile_loss = args.compile_loss if args.compile_loss is not None else accelerator.device.type == "cuda"
    if drafter.config.is_dflash2:
        objective = DFlash2Objective(target, drafter.config, args.max_anchors, args.gamma, attention)
    else:
        objective = DFlashObjective(target, drafter.config, args.max_anchors, args.gamma, attention,
                                    args.distill_topk, args.distill_weight, compile_loss)
    dataset = TrainingSequences(data, args.max_length)
    if len(dataset) == 0:  # else the run "trains" for 0 steps and saves the drafter as it started
        raise ValueError(
            f"none of the {len(data)} sequences has two answer tokens within max_length {args.max_length}: nothing to "
            "train on; raise max_length (--max-length) or regenerate longer answers (--max-new-tokens)"
        )
    if len(dataset) < len(data) and accelerator.is_main_process:
        print(f"train: left out {len(data) - len(dataset)} of {len(data)} sequences with fewer than two answer tokens "
              f"within max_length {args.max_length}")
    order = dict(shuffle=True)
    if args.group_by_length:
        order = dict(sampler=LengthGroupedSampler(dataset.answer_lengths(), args.batch_size, args.seed))
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=args.batch_size, collate_fn=collate_right_padded, **order
    )
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    drafter.train()
    drafter, optimizer, loader = accelerator.prepare(drafter, optimizer, loader)
    steps_per_epoch = len(loader)
    total_steps = args.steps if args.steps is not None else math.ceil(args.epochs * steps_per_epoch)
    scheduler = get_cosine_schedule_with_warmup(optimizer, round(args.warmup_ratio * total_steps), total_steps)
    scheduler = accelerator.prepare(scheduler)

    step, earlier_runs_s, anchor_blocks = 0, 0.0, 0
    if args.resume:
        checkpoint = _latest_checkpoint(out_dir) if args.resume == "latest" else Path(args.resume)
        accelerator.load_state(str(checkpoint))
        anchor_rng.set_state(torch.load(checkpoint / f"anchor_rng_{accelerator.process_index}.pt"))
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        step, earlier_runs_s = state["step"], state.get("wall_time_s", 0.0)
        anchor_blocks = state.get("anchor_blocks", 0)

    def progress_state() -> dict[str, float]:
        return {"step": step, "wall_time_s": earlier_runs_s + time.perf_counter() - start_time,
                "anchor_blocks": anchor_blocks}

    def export(stopped: bool) -> None:
        """The drafter as it is now, with its record, in out_dir (main process)."""
        if not accelerator.is_main_process:
            return
        model = accelerator.unwrap_model(drafter)
        saved = copy.deepcopy(model).to(torch.bfloat16) if args.save_bf16 else copy.deepcopy(model)
        if attention == "flex":
            saved.set_attn_implementation(original_attention)  # decoding builds no BlockMask
        shards = {"max_shard_size": args.max_shard_size} if args.max_shard_size else {}
        saved.save_pretrained(out_dir, **shards)
        final_loss, final_tau = _means(recent)
        wall = progress_state()["wall_time_s"]
        command = args.extra.get("command", portable_command(sys.argv))
        run = {
            "steps": step,
            "anchor_blocks": anchor_blocks,
            # Milliseconds kept: a short run (a test's few steps) would otherwise record 0 s.
            "wall_time_s": round(wall, 3),
            "device": _device_description(accelerator),
            "device_seconds": round(wall * accelerator.num_processes, 3),
            "data": {"sequences": len(dataset), "response_tokens": data.num_response_tokens,
                     **args.extra.get("data", {})},
            "final_loss": final_loss,
            "final_tau": final_tau,
            # A run that deepened the drafter says so in its own entry: {"from_layers": L, "to_layers": N}.
            **({"grown": args.extra["grown"]} if "grown" in args.extra else {}),
        }
        record = {
            "command": command,
            **{k: v for k, v in asdict(args).items() if k != "extra"},
            "out_dir": portable_path(str(args.out_dir)),
            "resume": args.resume and portable_path(str(args.resume)),
            # The decay the loss used: a run left at the default records the published value, not null.
            "gamma": objective.gamma,
            "attention": attention,
            "mixed_precision": accelerator.mixed_precision,
            "planned_steps": total_steps,
            "stopped_at_time_limit": stopped,
            "steps_per_epoch": steps_per_epoch,
            **{k: v for k, v in args.extra.items() if k not in ("command", "data", "history")},
            **run,
            # One entry per run that shaped these weights, this one last (a resumed run is the same run).
            "history": [*args.extra.get("history", []), {"command": command, **run}],
        }
        (out_dir / "training_args.json").write_text(json.dumps(record, indent=2))

    log_path = out_dir / "train_log.jsonl"
    out_dir.mkdir(parents=True, exist_ok=True)
    logged: list[tuple[float, float, float]] = []  # (loss, tau, lr) since the last log line

    def log_line() -> None:
        if accelerator.is_main_process and logged:
            loss, tau = _means([(l, t) for l, t, _ in logged])
            row = {"step": step, "loss": round(loss, 4), "tau": round(tau, 4), "lr": logged[-1][2],
                   "anchor_blocks": anchor_blocks, "wall_time_s": round(progress_state()["wall_time_s"], 2)}
            with log_path.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
        logged.clear()

    def out_of_time() -> bool:
        # Every process must stop at the same step, or the others would wait forever in the next all-reduce.
        late = torch.tensor(float(time.perf_counter() - start_time > args.time_limit_s), device=accelerator.device)
        return bool(accelerator.reduce(late, "max"))

    bar = tqdm(total=total_steps, initial=step, desc="train", disable=not (args.progress and accelerator.is_main_process))
    recent: deque[tuple[float, float]] = deque(maxlen=50)
    stopped_early = False
    while step < total_steps and not stopped_early:
        epoch, skip = divmod(step, steps_per_epoch)
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in batches:
            out = objective(drafter, batch, anchor_rng)
            accelerator.backward(out.loss)
            accelerator.clip_grad_norm_(drafter.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            blocks = torch.tensor(float(out.num_blocks), device=accelerator.device)
            loss, tau, blocks = accelerator.reduce(
                torch.stack([out.loss.detach().float(), out.tau.float(), blocks]), "sum"
            ).tolist()
            loss, tau = loss / accelerator.num_processes, tau / accelerator.num_processes
            anchor_blocks += round(blocks)
            recent.append((loss, tau))
            logged.append((loss, tau, scheduler.get_last_lr()[0]))
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tau=f"{tau:.2f}", lr=f"{scheduler.get_last_lr()[0]:.1e}")
            if step % args.log_every == 0:
                log_line()
            if args.save_every and step % args.save_every == 0 and step < total_steps:
                _save_checkpoint(accelerator, out_dir, progress_state(), anchor_rng, args.keep_checkpoints)
                export(stopped=False)
            if step >= total_steps:
                break
            if args.time_limit_s is not None and out_of_time():
                stopped_early = True
                break
    bar.close()
    log_line()
    _save_checkpoint(accelerator, out_dir, progress_state(), anchor_rng, args.keep_checkpoints)

    final_loss, final_tau = _means(recent)
    result = TrainingResult(step, final_loss, final_tau, progress_state()["wall_time_s"], out_dir, anchor_blocks)
    export(stopped=stopped_early)
    model = accelerator.unwrap_model(drafter)
    model.eval()
    if attention == "flex":
        model.set_attn_implementation(original_attention)  # decoding builds no BlockMask
    accelerator.wait_for_everyone()
    return result


def _means(rows) -> tuple[float, float]:
    """Means of (loss, tau) pairs; (nan, nan) when there are none yet."""
    rows = list(rows)
    if not rows:
        return math.nan, math.nan
    return sum(r[0] for r in rows) / len(rows), sum(r[1] for r in rows) / len(rows)


__all__ = ["TrainingArguments", "TrainingResult", "train"]
