"""Conversion between the four on-disk layouts of a DFlash drafter, both ways, without loss.

Every layout holds the same drafter tensors (fc, hidden_norm, layers.*, norm); they differ in names and config:
- `ours`: model_type "dflash", the DFlash fields at the top level, the remote-code bundle beside the weights;
- `zlab`: model_type "qwen3" (the decoder family), `dflash_config: {mask_token_id, target_layer_ids}`, block_size at
  the top, `rope_theta` / `rope_scaling` as transformers 4.57 (z-lab's remote code) reads them; no `auto_map`, since
  z-lab's `dflash.py` is not ours to ship (SGLang and vLLM read this layout without remote code);
- `native`: transformers' Muse Glimmer assistant (model_type "muse_glimmer_assistant"), `encoder.fc` and
  `encoder.output_norm_enc` for fc and hidden_norm;
- `speculators`: vLLM speculators. Decoder fields nest in `transformer_layer_config`; captured layers are counted
  in `hidden_states` indices (ours + 1); the checkpoint also holds copies of the target's embedding and lm_head,
  the lm_head cut to a reduced draft vocabulary when there is one, with `d2t` (target id = draft id + d2t[draft id])
  and `t2d` (which target ids the draft vocabulary keeps).
Our drafter borrows the target's embedding and lm_head, so writing `speculators` needs the target's weights
(`target=`). A reduced draft vocabulary's maps are kept in our layout as `draft_vocab.safetensors` (the config records
`draft_vocab_size`): our runtime drafts over those tokens only, as vLLM does, and a conversion back to speculators is
exact. A field a file leaves out takes the default of that layout's own reader (DFlashConfig
resolves zlab and native; here speculators' DFlashSpeculatorConfig and the transformers config of its decoder's
model_type).

Sliding-window layers are causal as we run them (a block row sees the window up to its own position, earlier block
rows included), full layers bidirectional: speculators' `sliding_window_non_causal` is written false, and a zlab config
that declares one causality for all its layers (`is_causal`, `dflash_config.causal`) is read only where that agrees.

What a layout cannot represent is refused before anything is written, with the reason: the target's last layer, a
sliding window that can cut context (speculators measure it from the block's anchor, we from each row), sliding layers
bidirectional inside a block (speculators' `sliding_window_non_causal: true`), a captured embedding output
(speculators' aux layer 0; we capture decoder-layer outputs), a reduced draft vocabulary in `zlab` or `native`. Files are written to a temporary folder that becomes the
output folder only once complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoConfig

from .modeling import DFlashConfig, DFlashDraftModel
from .modeling.dflash_draft_vocabulary import DRAFT_VOCAB_FILE, draft_vocabulary_from_maps

FORMATS = ("ours", "zlab", "native", "speculators")
# The config fields that define a drafter; two configs are equivalent when these agree.
CORE_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "attention_bias", "layer_types",
    "sliding_window", "vocab_size", "target_hidden_size", "num_target_layers", "target_layer_ids", "block_size",
    "mask_token_id",
)
# Decoder fields a layout's config carries besides the DFlash ones (zlab and native write them flat, speculators
# inside transformer_layer_config).
DECODER_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "attention_bias", "attention_dropout", "layer_types",
    "sliding_window", "vocab_size",
)
# Why a sliding window that can cut context does not convert between our layout and speculators, either way.
WINDOW_MISMATCH = (
    "speculators window the context from the block's anchor (every block row sees the sliding_window context rows "
    "before the anchor, then the block rows up to its own) while hf-dflash, as vLLM and z-lab's reference do, windows "
    "each row from its own position (block row k sees positions anchor + k - sliding_window + 1 to anchor + k), so "
    "they see different context rows once the context outgrows the window. Only a window of at least "
    "max_position_embeddings, which never cuts anything, converts"
)
# Fields of a zlab or native config besides the decoder ones: its layout (model_type), RoPE as written, DFlash fields.
LAYOUT_FIELDS = (
    "model_type", "rope_parameters", "rope_theta", "rope_scaling", "num_target_layers", "target_model", "dflash_config",
    "block_size", "mask_token_id", "target_layer_ids", "is_causal",
)
# Defaults of vLLM speculators' DFlashSpeculatorConfig (speculators 0.9.0) for the fields read here.
SPECULATORS_DEFAULTS = {"block_size": 8, "draft_vocab_size": 32000, "sliding_window_non_causal": False,
                        "sample_from_anchor": False}
NATIVE_NAMES = {"fc.": "encoder.fc.", "hidden_norm.": "encoder.output_norm_enc."}
SPECULATORS_TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight")
SPECULATORS_VOCAB_TENSORS = ("d2t", "t2d")


@dataclass
class Drafter:
    """A drafter in our terms: its config, its own tensors under our names, and a reduced draft vocabulary's maps
    ({"d2t": (draft_vocab,) int64, "t2d": (vocab,) bool}) when a speculators checkpoint had one."""

    config: DFlashConfig
    tensors: dict[str, torch.Tensor]
    draft_vocab: dict[str, torch.Tensor] | None = None


def core_fields(config: DFlashConfig) -> dict[str, Any]:
    """The fields that define the drafter (for comparing configs across layouts). A window without sliding layers
    changes nothing (and the native layout always has one), so it is left out then."""
    fields = {name: getattr(config, name) for name in CORE_FIELDS}
    if "sliding_attention" not in config.layer_types:
        fields["sliding_window"] = None
    return fields


def detect_format(config: dict[str, Any]) -> str:
    """Which layout a config.json dict is in."""
    if "speculators_model_type" in config or "transformer_layer_config" in config:
        return "speculators"
    if config.get("model_type") == "muse_glimmer_assistant":
        return "native"
    if config.get("model_type") == "dflash":
        return "ours"
    if "dflash_config" in config or "DFlashDraftModel" in config.get("architectures", []):
        return "zlab"
    raise ValueError(
        f"config.json (model_type {config.get('model_type')!r}) is not a DFlash drafter in any known layout "
        f"({', '.join(FORMATS)}); check the path"
    )


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    raise FileNotFoundError(
        f"{folder} has no model.safetensors (or sharded index); only safetensors checkpoints are converted"
    )


def _read_tensors(files: list[Path], progress: bool, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of safetensors `files` (only `names` when given), with a progress bar over tensors."""
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            keys = [k for k in handle.keys() if names is None or k in names]
            for key in tqdm(keys, desc=f"reading {path.name}", unit="tensor", disable=not progress, leave=False):
                tensors[key] = handle.get_tensor(key)
    return tensors


def read_folder(path: str | os.PathLike, progress: bool = False) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and every weight tensor of a local checkpoint folder."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json; pass a drafter checkpoint folder")
    return json.loads((folder / "config.json").read_text()), _read_tensors(_weight_files(folder), progress)


def _local_folder(name_or_path: str | os.PathLike) -> Path:
    """A local folder for a path or Hub id (safetensors and json files only, through the Hugging Face cache)."""
    if Path(name_or_path).is_dir():
        return Path(name_or_path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(name_or_path), allow_patterns=["*.json", "*.safetensors"]))


def target_vocab_tensors(target: str | os.PathLike, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(input embedding, lm_head, config.json) of a target checkpoint, reading only those two tensors."""
    folder = _local_folder(target)
    files = _weight_files(folder)
    config = json.loads((folder / "config.json").read_text())
    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            names |= {k for k in handle.keys() if k.endswith(("embed_tokens.weight", "lm_head.weight"))}
    embed = [k for k in names if k.endswith("embed_tokens.weight")]
    if len(embed) != 1:
        raise ValueError(f"expected one *embed_tokens.weight in {target}, found {sorted(embed) or 'none'}")
    tensors = _read_tensors(files, progress, names)
    head = [k for k in names if k.endswith("lm_head.weight")]
    # Tied targets (tie_word_embeddings) store no lm_head: it is the embedding. The speculators layout holds both, as
    # two tensors (safetensors refuses to write tensors that share memory), hence a copy.
    lm_head = tensors[head[0]] if head else tensors[embed[0]].clone()
    return tensors[embed[0]], lm_head, config


def _dflash_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The fields of a zlab or native config that DFlashConfig takes, as written: DFlashConfig fills what is missing
    with the defaults of that layout's reader (it names the layout by `model_type`)."""
    return {k: config[k] for k in DECODER_FIELDS + LAYOUT_FIELDS if k in config}


def _speculators_layer_config(config: dict[str, Any]) -> Any:
    """The decoder config speculators builds from `transformer_layer_config`: the transformers config class of its
    model_type (Qwen3Config without one), from every field written there, so its defaults apply as there."""
    layer = dict(config["transformer_layer_config"])
    return AutoConfig.for_model(layer.pop("model_type", "qwen3"), **layer)


def _speculators_fields(config: dict[str, Any]) -> dict[str, Any]:
    config = {**SPECULATORS_DEFAULTS, **config}
    if config["sample_from_anchor"]:
        raise ValueError(
            "this speculators checkpoint predicts from the anchor row too (sample_from_anchor: true, as DSpark does); "
            "a DFlash drafter discards that row, so it cannot be converted"
        )
    aux_ids = config.get("aux_hidden_state_layer_ids")
    if not aux_ids:
        raise ValueError("this speculators config names no aux_hidden_state_layer_ids (the captured target layers)")
    if 0 in aux_ids:
        raise ValueError(
            "aux_hidden_state_layer_ids contains 0, the target's embedding output (speculators count hidden_states: 0 is "
            "the embedding output, k the output of decoder layer k - 1). hf-dflash captures decoder-layer outputs only, "
            "so this drafter has no hf-dflash equivalent"
        )
    layer = _speculators_layer_config(config)
    fields = {k: getattr(layer, k) for k in DECODER_FIELDS if hasattr(layer, k)}
    fields["rope_parameters"] = dict(layer.rope_parameters)
    # speculators gives a layer a window when its config keeps one: Qwen3Config drops `sliding_window` unless
    # `use_sliding_window` is set, and then its "sliding" layers attend to everything, as full layers do.
    sliding = [t == "sliding_attention" for t in (getattr(layer, "layer_types", None) or [])]
    if any(sliding) and layer.sliding_window is None:
        fields.update(layer_types=["full_attention"] * layer.num_hidden_layers, sliding_window=None)
    elif any(sliding) and config["sliding_window_non_causal"]:
        raise ValueError(
            "this speculators drafter's sliding-window layers let every block row see the whole block "
            "(sliding_window_non_causal: true); hf-dflash runs sliding layers causally (a block row sees the rows up "
            "to its own), as speculators' default, vLLM and z-lab's reference do, so it has no hf-dflash equivalent"
        )
    elif any(sliding) and layer.sliding_window < layer.max_position_embeddings:
        raise ValueError(f"this speculators drafter has sliding-window layers; {WINDOW_MISMATCH}")
    if config.get("target_hidden_size") not in (None, layer.hidden_size):
        raise ValueError(
            f"target_hidden_size is {config['target_hidden_size']} but speculators sizes fc and the embedding by the "
            f"drafter's hidden_size ({layer.hidden_size}); this checkpoint is inconsistent"
        )
    fields.update(
        block_size=config["block_size"],
        mask_token_id=config.get("mask_token_id"),
        target_layer_ids=[i - 1 for i in aux_ids],
        target_model=((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path"),
    )
    if config.get("num_target_layers") is not None:
        fields["num_target_layers"] = config["num_target_layers"]
    if config["draft_vocab_size"] != layer.vocab_size:
        fields["draft_vocab_size"] = config["draft_vocab_size"]
    return fields


def config_from_layout(config: dict[str, Any]) -> DFlashConfig:
    """Our config for a config.json dict of any layout."""
    layout = detect_format(config)
    if layout == "speculators":
        return DFlashConfig(**_speculators_fields(config))
    if layout == "ours":
        return DFlashConfig(**{k: v for k, v in config.items() if k not in ("architectures", "auto_map", "model_type")})
    if "vocab_size" not in config:
        # Muse Glimmer configs omit it; a silent default would make every fit check against the target wrong.
        raise ValueError("this config has no vocab_size; add the target's vocab_size to its config.json and retry")
    return DFlashConfig(**_dflash_fields(config))


def to_drafter(
    config: dict[str, Any], tensors: dict[str, torch.Tensor], draft_vocab: dict[str, torch.Tensor] | None = None
) -> Drafter:
    """A checkpoint of any layout (config.json dict + its tensors) in our terms."""
    layout = detect_format(config)
    ours = config_from_layout(config)
    if layout == "speculators":
        if ours.draft_vocab_size is not None:
            missing = [k for k in SPECULATORS_VOCAB_TENSORS if k not in tensors]
            if missing:
                raise ValueError(f"draft_vocab_size is {ours.draft_vocab_size} but the checkpoint lacks {missing}")
            draft_vocab = {k: tensors[k] for k in SPECULATORS_VOCAB_TENSORS}
        dropped = set(SPECULATORS_TARGET_TENSORS + SPECULATORS_VOCAB_TENSORS)
        tensors = {k: v for k, v in tensors.items() if k not in dropped and not k.startswith("verifier_")}
    elif layout == "native":
        for name, theirs in NATIVE_NAMES.items():
            tensors = {(name + k[len(theirs):] if k.startswith(theirs) else k): v for k, v in tensors.items()}
    return Drafter(ours, dict(tensors), draft_vocab)


def load(path: str | os.PathLike, progress: bool = False) -> Drafter:
    """A local checkpoint folder of any layout, in our terms."""
    config, tensors = read_folder(path, progress)
    vocab_file = Path(path) / DRAFT_VOCAB_FILE
    draft_vocab = _read_tensors([vocab_file], progress) if vocab_file.is_file() else None
    return to_drafter(config, tensors, draft_vocab)


def _check_exact(drafter: Drafter) -> None:
    """The tensors must be exactly the drafter its config describes, before anything is written."""
    with torch.device("meta"):
        expected = DFlashDraftModel(drafter.config).state_dict()
    missing = sorted(set(expected) - set(drafter.tensors))
    unexpected = sorted(set(drafter.tensors) - set(expected))
    shapes = sorted(k for k in set(expected) & set(drafter.tensors) if expected[k].shape != drafter.tensors[k].shape)
    if missing or unexpected or shapes:
        raise ValueError(
            f"the tensors do not match the drafter the config describes: missing {missing}, unexpected {unexpected}, "
            f"mis-shaped {shapes}; check that config.json belongs to these weights"
        )


def _decoder_fields(config: DFlashConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in DECODER_FIELDS}


def _zlab_config(config: DFlashConfig) -> dict[str, Any]:
    rope = dict(config.rope_parameters or {"rope_type": "default", "rope_theta": config.default_theta})
    theta = rope.pop("rope_theta")
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        **_decoder_fields(config),
        "rope_theta": theta,
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        "num_target_layers": config.num_target_layers,
        "block_size": config.block_size,
        "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": config.target_layer_ids},
        **({"target_model": config.target_model} if config.target_model else {}),
    }


def _native_config(config: DFlashConfig) -> dict[str, Any]:
    # Muse Glimmer's config requires an int window; without sliding layers ours may be None, and then is left out.
    decoder = {k: v for k, v in _decoder_fields(config).items() if not (k == "sliding_window" and v is None)}
    return {
        "architectures": ["MuseGlimmerAssistantModel"],
        "model_type": "muse_glimmer_assistant",
        **decoder,
        "rope_parameters": config.rope_parameters,
        "num_target_layers": config.num_target_layers,
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": config.target_layer_ids,
        **({"target_model": config.target_model} if config.target_model else {}),
    }


def _speculators_config(
    config: DFlashConfig, target: str | os.PathLike, target_config: dict[str, Any], draft_vocab_size: int
) -> dict[str, Any]:
    layer = {"model_type": "qwen3", **_decoder_fields(config), "rope_parameters": config.rope_parameters}
    if "sliding_attention" in config.layer_types:
        layer["use_sliding_window"] = True  # Qwen3Config, which speculators builds from this dict, drops it otherwise
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab_size,
        "block_size": config.block_size,
        "target_hidden_size": config.target_hidden_size,
        "num_target_layers": config.num_target_layers,  # not a speculators field: kept so a conversion back is exact
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "mask_token_id": config.mask_token_id,
        # Our sliding layers are causal inside the block too (full layers bidirectional), as speculators' default.
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size - 1}],
            "default_proposal_method": "greedy",
            # The target the drafter records (a Hub id) over the path its embedding was read from, which may be a
            # folder of this machine's.
            "verifier": {"name_or_path": config.target_model or str(target),
                         "architectures": target_config.get("architectures", [])},
        },
    }


def _check_layout(layout: str, target: str | os.PathLike | None) -> None:
    if layout not in FORMATS:
        raise ValueError(f"unknown layout {layout!r}; pick one of {', '.join(FORMATS)}")
    if layout == "speculators" and target is None:
        raise ValueError("the speculators layout holds the target's embedding and lm_head: pass the target (path/id)")


def _check_speculators_window(config: DFlashConfig) -> None:
    if "sliding_attention" in config.layer_types and config.sliding_window < config.max_position_embeddings:
        raise ValueError(
            f"the drafter has sliding-window layers (window {config.sliding_window}, positions up to "
            f"{config.max_position_embeddings}); {WINDOW_MISMATCH}"
        )


def _check_speculators_target(config: DFlashConfig, embedding: torch.Tensor, target_config: dict[str, Any]) -> None:
    if tuple(embedding.shape) != (config.vocab_size, config.target_hidden_size):
        raise ValueError(
            f"the target's embedding is {tuple(embedding.shape)}, the drafter expects "
            f"({config.vocab_size}, {config.target_hidden_size}): this target is not the drafter's"
        )
    last = (target_config.get("text_config") or target_config)["num_hidden_layers"] - 1
    if last in config.target_layer_ids:
        raise ValueError(
            f"the drafter captures the target's last layer ({last}); speculators always feed that layer separately "
            "(as the verifier's last hidden state), so this drafter has no speculators equivalent"
        )


def _write(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    save_file(contiguous, str(out / "model.safetensors"), metadata={"format": "pt"})


def _draft_vocabulary(drafter: Drafter) -> torch.LongTensor:
    """The sorted target ids of the drafter's draft vocabulary, after checking its d2t/t2d maps agree."""
    config = drafter.config
    return draft_vocabulary_from_maps(drafter.draft_vocab, config.vocab_size, config.draft_vocab_size, "d2t/t2d")


def _check_new_folder(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not empty; write the converted drafter to a new folder")


@contextmanager
def _staged_folder(out: Path) -> Iterator[Path]:
    """A temporary folder beside `out` that becomes `out` when the block completes and is removed when it raises, so
    a failed conversion leaves no partial folder."""
    _check_new_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield staging
        if out.exists():
            out.rmdir()  # empty (checked above)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _write_layout(
    drafter: Drafter, folder: Path, layout: str, target_vocab: tuple[torch.Tensor, torch.Tensor, dict] | None,
    target: str | os.PathLike | None,
) -> None:
    """The files of `layout` in `folder`; `target_vocab` is what target_vocab_tensors read for speculators."""
    config = drafter.config
    if layout == "ours":
        with torch.device("meta"):
            model = DFlashDraftModel(config)
        model.load_state_dict(drafter.tensors, strict=True, assign=True)
        if drafter.draft_vocab is not None:
            model.set_draft_vocabulary(_draft_vocabulary(drafter))
        model.save_pretrained(folder)  # writes the draft vocabulary's maps beside the weights
    elif layout == "zlab":
        _write(folder, _zlab_config(config), drafter.tensors)
    elif layout == "native":
        renamed = dict(drafter.tensors)
        for ours, theirs in NATIVE_NAMES.items():
            renamed = {(theirs + k[len(ours):] if k.startswith(ours) else k): v for k, v in renamed.items()}
        _write(folder, _native_config(config), renamed)
    else:
        embedding, lm_head, target_config = target_vocab
        tensors = {**drafter.tensors, "embed_tokens.weight": embedding}
        if drafter.draft_vocab is None:
            tensors["lm_head.weight"] = lm_head
            draft_vocab_size = config.vocab_size
        else:
            tensors.update(drafter.draft_vocab)
            tensors["lm_head.weight"] = lm_head[drafter.draft_vocab["t2d"].bool()]
            draft_vocab_size = drafter.draft_vocab["d2t"].shape[0]
        _write(folder, _speculators_config(config, target, target_config, draft_vocab_size), tensors)


def save(
    drafter: Drafter, out: str | os.PathLike, layout: str, target: str | os.PathLike | None = None,
    progress: bool = False,
) -> Path:
    """Write `drafter` to the new folder `out` in `layout`. `speculators` needs `target` (path or Hub id) for the copies
    of its embedding and lm_head that layout holds. Everything that can refuse runs before anything is written, and the
    files are written to a temporary folder that becomes `out` only when all are written."""
    _check_layout(layout, target)
    out = Path(out)
    _check_new_folder(out)
    config = drafter.config
    if layout == "native" and config.attention_bias:
        raise ValueError("transformers' Muse Glimmer assistant has no attention biases; this drafter has them")
    target_vocab = None
    if layout == "speculators":
        _check_speculators_window(config)
        target_vocab = target_vocab_tensors(target, progress)
        _check_speculators_target(config, target_vocab[0], target_vocab[2])
    _check_exact(drafter)
    if drafter.draft_vocab is not None:
        _draft_vocabulary(drafter)  # the maps must describe one vocabulary, before anything is written
        if layout in ("zlab", "native"):
            raise ValueError(
                f"this drafter drafts over a reduced draft vocabulary of {config.draft_vocab_size} tokens, which the "
                f"{layout} layout cannot hold (its readers draft over the full vocabulary); to convert it anyway, "
                "load it, call drafter.set_draft_vocabulary(None), save it, and convert that copy"
            )
    with _staged_folder(out) as folder:
        _write_layout(drafter, folder, layout, target_vocab, target)
    return out


def convert(
    src: str | os.PathLike, out: str | os.PathLike, to: str, target: str | os.PathLike | None = None,
    progress: bool = False,
) -> Path:
    """Convert the checkpoint folder `src` (any layout) to layout `to` in folder `out`."""
    _check_layout(to, target)
    if Path(out).resolve() == Path(src).resolve():
        raise ValueError("write the converted drafter to a new folder, not over its source")
    return save(load(src, progress), out, to, target, progress)


__all__ = ["CORE_FIELDS", "FORMATS", "Drafter", "config_from_layout", "convert", "core_fields", "detect_format", "load",
           "read_folder", "save", "target_vocab_tensors", "to_drafter"]
