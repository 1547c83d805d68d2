"""Conversion between the four on-disk layouts of a DFlash (or DFlash2) drafter, both ways, without loss.

Every layout holds the same drafter tensors (fc, hidden_norm, layers.*, norm); they differ in names and config:
- `ours`: model_type "dflash", the DFlash fields at the top level, the remote-code bundle beside the weights;
- `zlab`: model_type "qwen3" (the decoder family), `dflash_config: {mask_token_id, target_layer_ids}`, block_size at
  the top, `rope_theta` / `rope_scaling` as transformers 4.57 (z-lab's remote code) reads them, and
  `use_sliding_window: true` when a layer slides (z-lab's Qwen3Config drops the window without it); no `auto_map`,
  since z-lab's `dflash.py` is not ours to ship (SGLang and vLLM read this layout without remote code);
- `native`: transformers' Muse Glimmer assistant (model_type "muse_glimmer_assistant"), `encoder.fc` and
  `encoder.output_norm_enc` for fc and hidden_norm;
- `speculators`: vLLM speculators. Decoder fields nest in `transformer_layer_config`; captured layers are counted
  in `hidden_states` indices (ours + 1); the checkpoint also holds copies of the target's embedding and lm_head,
  the lm_head cut to a reduced draft vocabulary when there is one, with `d2t` (target id = draft id + d2t[draft id])
  and `t2d` (which target ids the draft vocabulary keeps).
A DFlash2 drafter converts the same way between `ours`, `zlab` (`architectures: ["DFlash2DraftModel"]`, its fields
in `dflash_config`, `is_causal: false`) and `speculators` (`speculators_model_type: "dflash2"`, its fields at the top
level, `sliding_window_non_causal: true`); `native` has no DFlash2 form and refuses it.
Our drafter borrows the target's embedding and lm_head, so writing `speculators` needs the target's weights
(`target=`). A reduced draft vocabulary's maps are kept in our layout as `draft_vocab.safetensors` (the config records
`draft_vocab_size`): our runtime drafts over those tokens only, as vLLM does, and a conversion back to speculators is
exact. A field a file leaves out takes the default of that layout's own reader.

Sliding-window layers are causal as we run them (a block row sees the window up to its own position, earlier block
rows included), full layers bidirectional: speculators' `sliding_window_non_causal` is written false, and a zlab config
that declares one causality for all its layers (`is_causal`, `dflash_config.causal`) is read only where that agrees.
A zlab file that sets `sliding_window` and sliding `layer_types` is read windowed, with or without
`use_sliding_window`, as vLLM and SGLang run the published Qwen3.5/3.6 drafters.

What a layout cannot represent is refused before anything is written, with the reason: the target's last layer, a
sliding window that can cut context (speculators measure it from the block's anchor, we from each row), sliding layers
bidirectional inside a block (speculators' `sliding_window_non_causal: true`; transformers' Muse Glimmer assistant runs
every sliding layer so), a captured embedding output (speculators' aux layer 0; we capture decoder-layer outputs), a
reduced draft vocabulary in `zlab` or `native`. Files are written to a temporary folder that becomes the output folder
only once complete. Each layout's reading and writing lives in hf_dflash.modeling.dflash_layouts; this module reads
and writes the files.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .modeling import DFlashConfig
from .modeling.dflash_draft_vocabulary import DRAFT_VOCAB_FILE
from .modeling.dflash_layouts import (
    DECODER_FIELDS,
    DFLASH2_DEFAULTS,
    LAYOUT_NAMES,
    Drafter,
    DrafterLayout,
    OursLayout,
    TargetVocabulary,
    detect_layout,
    layout_named,
    read_config_file,
)

FORMATS = LAYOUT_NAMES
# The config fields that define a drafter; two configs are equivalent when these agree.
CORE_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "attention_bias", "layer_types",
    "sliding_window", "vocab_size", "target_hidden_size", "num_target_layers", "target_layer_ids", "block_size",
    "mask_token_id", *DFLASH2_DEFAULTS,  # None in a DFlash drafter's config
)


def core_fields(config: DFlashConfig) -> dict[str, Any]:
    """The fields that define the drafter (for comparing configs across layouts). A window without sliding layers
    changes nothing (and the native layout always has one), so it is left out then."""
    fields = {name: getattr(config, name) for name in CORE_FIELDS}
    if "sliding_attention" not in config.layer_types:
        fields["sliding_window"] = None
    return fields


def detect_format(config: dict[str, Any]) -> str:
    """Which layout a config.json dict is in (its name, as `--to` takes it)."""
    return detect_layout(config).name


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    raise FileNotFoundError(
        f"{folder} has no model.safetensors (or sharded index); only safetensors checkpoints are converted"
    )


@contextmanager
def _safetensors_file(path: Path) -> Iterator[Any]:
    """`safe_open` of one weights file; a truncated or corrupted one (an interrupted download leaves such a file) is
    refused naming the fix instead of safetensors' bare error."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            yield handle
    except SafetensorError as error:
        raise ValueError(
            f"{path} is truncated or corrupted ({error}); download it again, or save the checkpoint again"
        ) from None


def _read_tensors(files: list[Path], progress: bool, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of safetensors `files` (only `names` when given), with a progress bar over tensors."""
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with _safetensors_file(path) as handle:
            keys = [k for k in handle.keys() if names is None or k in names]
            for key in tqdm(keys, desc=f"reading {path.name}", unit="tensor", disable=not progress, leave=False):
                tensors[key] = handle.get_tensor(key)
    return tensors


def read_folder(path: str | os.PathLike, progress: bool = False) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and every weight tensor of a local checkpoint folder."""
    folder = Path(path)
    return read_config_file(folder), _read_tensors(_weight_files(folder), progress)


def _local_folder(name_or_path: str | os.PathLike) -> Path:
    """A local folder for a path or Hub id (safetensors and json files only, through the Hugging Face cache)."""
    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors"]))


def target_vocab_tensors(target: str | os.PathLike, progress: bool = False) -> TargetVocabulary:
    """The input embedding, lm_head and config.json of a target checkpoint, reading only those two tensors."""
    folder = _local_folder(target)
    files = _weight_files(folder)
    config = read_config_file(folder)
    names: set[str] = set()
    for path in files:
        with _safetensors_file(path) as handle:
            names |= {k for k in handle.keys() if k.endswith(("embed_tokens.weight", "lm_head.weight"))}
    embed = [k for k in names if k.endswith("embed_tokens.weight")]
    if len(embed) != 1:
        raise ValueError(f"expected one *embed_tokens.weight in {target}, found {sorted(embed) or 'none'}")
    tensors = _read_tensors(files, progress, names)
    head = [k for k in names if k.endswith("lm_head.weight")]
    # Tied targets (tie_word_embeddings) store no lm_head: it is the embedding. The speculators layout holds both, as
    # two tensors (safetensors refuses to write tensors that share memory), hence a copy.
    lm_head = tensors[head[0]] if head else tensors[embed[0]].clone()
    return TargetVocabulary(source=str(target), config=config, embedding=tensors[embed[0]], lm_head=lm_head)


def config_from_layout(config: dict[str, Any]) -> DFlashConfig:
    """Our config for a config.json dict of any layout."""
    return detect_layout(config).read_config(config)


def to_drafter(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], draft_vocab: dict[str, torch.Tensor] | None = None
) -> Drafter:
    """A checkpoint of any layout (config.json dict + its tensors) in our terms."""
    return detect_layout(config).read(config, tensors, draft_vocab)


def load(path: str | os.PathLike, progress: bool = False) -> Drafter:
    """A local checkpoint folder of any layout, in our terms."""
    config, tensors = read_folder(path, progress)
    vocab_file = Path(path) / DRAFT_VOCAB_FILE
    draft_vocab = _read_tensors([vocab_file], progress) if vocab_file.is_file() else None
    return to_drafter(config, tensors, draft_vocab)


def _check_exact(drafter: Drafter, layout: type[DrafterLayout]) -> None:
    """The tensors must be exactly the drafter its config describes, before anything is written."""
    with torch.device("meta"):
        expected = layout.model_class()(drafter.config).state_dict()
    missing = sorted(set(expected) - set(drafter.tensors))
    unexpected = sorted(set(drafter.tensors) - set(expected))
    shapes = sorted(k for k in set(expected) & set(drafter.tensors) if expected[k].shape != drafter.tensors[k].shape)
    if missing or unexpected or shapes:
        raise ValueError(
            f"the tensors do not match the drafter the config describes: missing {missing}, unexpected {unexpected}, "
            f"mis-shaped {shapes}; check that config.json belongs to these weights"
        )


def _write(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    save_file(contiguous, str(out / "model.safetensors"), metadata={"format": "pt"})


def _check_new_folder(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not empty; write the converted drafter to a new folder")


@contextmanager
def _staged_folder(out: Path) -> Iterator[Path]:
    """A temporary folder beside `out` that becomes `out` when the block completes and is removed when it raises, so
    a failed conversion leaves no partial folder. It is made as any new folder is, with the umask's permissions
    (tempfile's folders are private to their owner, and would stay so once renamed)."""
    _check_new_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        yield staging
        if out.exists():
            out.rmdir()  # empty (checked above)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_layout(
    drafter: Drafter, folder: Path, layout: type[DrafterLayout], target_vocab: TargetVocabulary | None
) -> None:
    """The files of `layout` in `folder`; `target_vocab` is what target_vocab_tensors read, for speculators."""
    if issubclass(layout, OursLayout):
        layout.write(folder, drafter)
    else:
        _write(folder, layout.write_config(drafter, target_vocab), layout.write_tensors(drafter, target_vocab))


def _check_layout_argument(layout_name: str, target: str | os.PathLike | None) -> None:
    if layout_name not in FORMATS:
        raise ValueError(f"unknown layout {layout_name!r}; pick one of {', '.join(FORMATS)}")
    if layout_named(layout_name).needs_target and target is None:
        raise ValueError("the speculators layout holds the target's embedding and lm_head: pass the target (path/id)")


def save(
    drafter: Drafter, out: str | os.PathLike, layout: str, target: str | os.PathLike | None = None,
    progress: bool = False,
) -> Path:
    """Write `drafter` to the new folder `out` in `layout`. `speculators` needs `target` (path or Hub id) for the copies
    of its embedding and lm_head that layout holds. Everything that can refuse runs before anything is written, and the
    files are written to a temporary folder that becomes `out` only when all are written."""
    _check_layout_argument(layout, target)
    writer = layout_named(layout, drafter.config.architecture)
    out = Path(out)
    _check_new_folder(out)
    writer.check_writable(drafter)
    target_vocab = None
    if writer.needs_target:
        target_vocab = target_vocab_tensors(target, progress)
        writer.check_target(drafter.config, target_vocab)
    _check_exact(drafter, writer)
    if drafter.draft_vocab is not None:
        drafter.draft_vocabulary()  # the maps must describe one vocabulary, before anything is written
    with _staged_folder(out) as folder:
        _write_layout(drafter, folder, writer, target_vocab)
    return out


def convert(
    src: str | os.PathLike, out: str | os.PathLike, to: str, target: str | os.PathLike | None = None,
    progress: bool = False,
) -> Path:
    """Convert the checkpoint folder `src` (any layout) to layout `to` in folder `out`."""
    _check_layout_argument(to, target)
    if Path(out).resolve() == Path(src).resolve():
        raise ValueError("write the converted drafter to a new folder, not over its source")
    return save(load(src, progress), out, to, target, progress)


__all__ = ["CORE_FIELDS", "DECODER_FIELDS", "FORMATS", "Drafter", "config_from_layout", "convert", "core_fields",
           "detect_format", "load", "read_folder", "save", "target_vocab_tensors", "to_drafter"]
