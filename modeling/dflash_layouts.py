"""The on-disk layouts of a DFlash drafter: how each is recognised, read into our terms and written, in one place.

Every layout holds the same drafter (fc, hidden_norm, layers.*, norm and the config fields that shape them); they
differ in the names of some tensors and in the config:
- `OursLayout` ("ours"): model_type "dflash", the DFlash fields at the top level, the remote-code bundle beside the
  weights (what `DFlashDraftModel.save_pretrained` writes);
- `ZLabLayout` ("zlab"): z-lab's published drafters: the model_type of the decoder family ("qwen3", "llama", ...), the
  DFlash fields in `dflash_config` (block_size at the top level or inside it), `rope_theta` / `rope_scaling` or
  `rope_parameters`. Written without `auto_map`: z-lab's `dflash.py` is not ours to ship, and SGLang and vLLM read
  this layout without remote code;
- `NativeLayout` ("native"): transformers' Muse Glimmer assistant (model_type "muse_glimmer_assistant"), the DFlash
  fields at the top level, `encoder.fc` and `encoder.output_norm_enc` for fc and hidden_norm;
- `SpeculatorsLayout` ("speculators"): vLLM speculators. Decoder fields nest in `transformer_layer_config`; captured
  layers are counted in `hidden_states` indices (ours + 1); beside the drafter the checkpoint holds copies of the
  target's embedding and lm_head, the lm_head cut to a reduced draft vocabulary when there is one, with `d2t` (target
  id = draft id + d2t[draft id]) and `t2d` (which target ids the draft vocabulary keeps).

Reading. A field a file leaves out takes the default of the class its layout's own reader builds, so a drafter
computes here what it computes there: z-lab's DFlashDraftModel and speculators' `transformer_layer_config` build the
transformers config of the file's model_type (Qwen3Config: rope_theta 10000, head_dim 128, ...), transformers its
`MuseGlimmerAssistantConfig`; our own files, and configs built in code, take `DFLASH_DEFAULTS`. `DFlashConfig(**fields)`
reads the three flat layouts itself (transformers' from_pretrained calls it with a file's dict), through
`config_fields_layout`, `FlatLayout.gather` and `resolve`; a whole file is read by `detect_layout(config).read_config`,
after the checks of its layout's `check_file` (which `DFlashConfig.from_dict`, and so from_pretrained, applies too).

Attention pattern. hf-dflash runs a sliding layer causal, a block row seeing the `sliding_window` positions up to its
own (earlier block rows included), and a full layer bidirectional, as z-lab's newest reference, vLLM and SGLang do.
A file that sets `sliding_window` and sliding `layer_types` is read windowed whether or not it sets
`use_sliding_window` (see `ZLabLayout`). Writing, each layout writes what its own reader needs to compute what we
compute, and refuses before anything is written what it cannot represent (`check_writable`, `check_target`).

Architectures. A layout class holds one drafter architecture: `architecture` (our config's model_type, "dflash"),
`drafter_class` (the class its files name in `architectures`), `config_class` / `model_class` (ours for it). A second
architecture joins as further classes, subclasses of these that name theirs and read and write the fields and tensors
it adds, placed ahead of them in `LAYOUTS` (where detection goes in order) so that each claims only its own files.

This file is part of the remote-code bundle: it imports only torch, transformers, safetensors and its sibling files.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers import CONFIG_MAPPING, AutoConfig, PreTrainedConfig
from transformers.utils import logging

from .dflash_draft_vocabulary import draft_vocabulary_from_maps

if TYPE_CHECKING:
    from .configuration_dflash import DFlashConfig
    from .modeling_dflash import DFlashDraftModel

CONFIG_FILE = "config.json"
# Defaults of a drafter config of our own layout (model_type "dflash", or built in code).
DFLASH_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": None,  # hidden_size // num_attention_heads
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "rope_parameters": None,  # rope_theta DFlashConfig.default_theta
    "attention_bias": False,
    "attention_dropout": 0.0,
    "vocab_size": 151936,
}
# What a DFlash2 drafter adds (modeling_dflash2.py), with the values of every published DFlash2 drafter (z-lab's
# Qwen3.8-27B-DFlash2, speculators' and SpecForge's training defaults): two-tap convolutions over groups of 16 channels,
# a selector of rank 256 choosing among 16 candidates per row, and no logit scaling. A DFlash2 config that leaves one
# out takes this value.
DFLASH2_DEFAULTS: dict[str, Any] = {
    "conv_kernel_size": 2,
    "conv_group_size": 16,
    "selector_rank": 256,
    "selector_top_k": 16,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
    "input_embedding_scale": 1.0,
}
# Our names of the two drafter architectures, and the class a DFlash2 drafter's files list in `architectures`.
DFLASH, DFLASH2 = "dflash", "dflash2"
DFLASH2_CLASS = "DFlash2DraftModel"
# What z-lab's DFlash2 files keep in `dflash_config`; any other key there is refused, naming it (it would change
# the drafter in a way this reader does not know).
DFLASH2_NESTED_FIELDS = ("block_size", "mask_token_id", "target_layer_ids", "causal", *DFLASH2_DEFAULTS)
# The DFlash fields: the drafter's block, its mask token and the target layers it reads.
DFLASH_FIELDS = ("block_size", "mask_token_id", "target_layer_ids")
# Every field of our config that a layout holds (DFlashConfig's own, target_model and draft_vocab_size, stay ours).
LAYOUT_READ_FIELDS = (
    *DFLASH_DEFAULTS, "layer_types", "sliding_window", "target_hidden_size", "num_target_layers", *DFLASH_FIELDS,
)
# What the reference config class of another layout receives from a file, to resolve its defaults the way that
# layout's reader does (rope_theta and rope_scaling into rope_parameters, with its own default theta). The attention
# pattern stays out: only transformers' assistant takes its default from its class (NativeLayout).
REFERENCE_INPUTS = (*DFLASH_DEFAULTS, "rope_theta", "rope_scaling")
# Decoder fields a layout's config carries besides the DFlash ones (zlab and native write them flat, speculators
# inside transformer_layer_config).
DECODER_FIELDS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "attention_bias", "attention_dropout", "layer_types",
    "sliding_window", "vocab_size",
)
# The keys of a zlab or native config.json that DFlashConfig takes: our fields, the layout's spellings of some, and
# target_model (token ids, dtype and versions are transformers' bookkeeping, not the drafter's).
PUBLISHED_FILE_FIELDS = (
    *LAYOUT_READ_FIELDS, "model_type", "rope_theta", "rope_scaling", "dflash_config", "is_causal", "target_model",
)
SLIDING, FULL = "sliding_attention", "full_attention"


def reference_config(model_type: str, fields: Mapping[str, Any]) -> PreTrainedConfig:
    """The transformers config that the reader of a `model_type` layout builds from `fields` (a config.json dict):
    z-lab's DFlashDraftModel uses the config class of the file's model_type (Qwen3Config for "qwen3"), transformers'
    assistant `MuseGlimmerAssistantConfig`. Its attributes are that reader's values, defaults included."""
    return reader_config(model_type, {k: v for k, v in fields.items() if k in REFERENCE_INPUTS and v is not None})


def reader_config(model_type: str, fields: Mapping[str, Any]) -> PreTrainedConfig:
    """transformers' config class of `model_type` built from `fields`, as a layout's reader builds it. A model_type
    this transformers does not know, or fields the class's own validation refuses, are a ValueError saying so."""
    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"this drafter config has model_type {model_type!r}, which this transformers does not know; its layout's "
            "reader builds that model's config, so upgrade transformers or correct model_type"
        )
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its own checks (token ids past a scaled-down vocabulary) would only be noise here
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as error:  # the class's own validation: a strict dataclass error, which is no ValueError
        raise ValueError(
            f"this drafter config's fields are not a valid {model_type} config, which its layout's reader builds: "
            f"{' '.join(str(error).split())}; correct them in config.json"
        ) from error
    finally:
        logging.set_verbosity(verbosity)


def read_config_file(folder: str | os.PathLike) -> dict[str, Any]:
    """The config.json of a checkpoint folder as a dict; a file that is missing, not JSON or not a JSON object is
    refused naming the file."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{folder} has no {CONFIG_FILE}; pass a drafter checkpoint folder")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path} is not valid JSON ({error}); download the drafter again, or repair the file"
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a JSON {type(config).__name__}, not an object of config fields; repair it")
    return config


def layers_of_hidden_states(indices: Any) -> list[int]:
    """speculators' `aux_hidden_state_layer_ids` -> our target_layer_ids. They count `hidden_states` entries, where 0
    is the embedding output and k the output of decoder layer k - 1, so their id is ours + 1."""
    if not isinstance(indices, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
        raise ValueError(
            f"aux_hidden_state_layer_ids must be a list of integers (hidden_states indices), got {indices!r}; fix it "
            "in the drafter's config.json"
        )
    if 0 in indices:
        raise ValueError(
            "aux_hidden_state_layer_ids contains 0, the target's embedding output (speculators count hidden_states: 0 "
            "is the embedding output, k the output of decoder layer k - 1). hf-dflash captures decoder-layer outputs "
            "only, so this drafter has no hf-dflash equivalent"
        )
    return [i - 1 for i in indices]


def _renamed(tensors: Mapping[str, torch.Tensor], prefixes: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """`tensors` with each name that starts with a key of `prefixes` starting with its value instead."""
    out = {}
    for name, tensor in tensors.items():
        old = next((p for p in prefixes if name.startswith(p)), None)
        out[name if old is None else prefixes[old] + name[len(old):]] = tensor
    return out


@dataclass
class GatheredFields:
    """A flat layout's config dict in our field names, before defaults.

    model_type: the dict's model_type, which names the layout's reader (None: ours);
    given: every field of the layout's `read_fields`, as the dict sets it (None where it leaves it out), the DFlash
        fields taken from `dflash_config` and captured layers from `aux_hidden_state_layer_ids` where those hold them;
    other: the rest (PreTrainedConfig's own fields, and `rope_theta` / `rope_scaling` as written);
    declared_causal: one causality the dict declares for every layer (`is_causal`, or `dflash_config.causal`), or None;
    dflash2: the DFlash2 fields (`DFLASH2_DEFAULTS`' names) that `dflash_config` holds, where z-lab's files keep them
        (None where it leaves one out; the same name at the top level, a keyword of DFlashConfig, wins).
    """

    model_type: str | None
    given: dict[str, Any]
    other: dict[str, Any]
    declared_causal: bool | None
    dflash2: dict[str, Any]


@dataclass
class Drafter:
    """A drafter in our terms: its config, its own tensors under our names, and a reduced draft vocabulary's maps
    ({"d2t": (draft_vocab,) int64, "t2d": (vocab,) bool}) when it has one."""

    config: DFlashConfig
    tensors: dict[str, torch.Tensor]
    draft_vocab: dict[str, torch.Tensor] | None = None

    def draft_vocabulary(self) -> torch.LongTensor:
        """The sorted target ids of the draft vocabulary, after checking its d2t/t2d maps describe one."""
        config = self.config
        return draft_vocabulary_from_maps(self.draft_vocab, config.vocab_size, config.draft_vocab_size, "d2t/t2d")


@dataclass
class TargetVocabulary:
    """What the speculators layout copies from the drafter's target: where it was read (a path or Hub id), its
    config.json, its input embedding (vocab, H) and lm_head (vocab, H)."""

    source: str
    config: dict[str, Any]
    embedding: torch.Tensor
    lm_head: torch.Tensor


class DrafterLayout:
    """One on-disk layout of one drafter architecture. A layout has no state: its classes are namespaces of
    classmethods, compared and looked up as classes (`LAYOUTS`)."""

    name: ClassVar[str]  # what `hf-dflash convert --to` calls it
    architecture: ClassVar[str] = "dflash"  # the drafter it holds, as our config names it (`DFlashConfig.architecture`)
    drafter_class: ClassVar[str] = "DFlashDraftModel"  # the class its files name in `architectures`
    # Our tensor name prefixes that this layout spells otherwise, ours -> theirs.
    renamed_tensors: ClassVar[dict[str, str]] = {}
    # Whether writing it needs the drafter's target (its embedding and lm_head).
    needs_target: ClassVar[bool] = False

    @classmethod
    def config_class(cls) -> type[DFlashConfig]:
        from .configuration_dflash import DFlashConfig  # imported here: configuration_dflash imports this file

        return DFlashConfig

    @classmethod
    def model_class(cls) -> type[DFlashDraftModel]:
        # imported here: both modeling files import this one
        if cls.architecture == DFLASH2:
            from .modeling_dflash2 import DFlash2DraftModel

            return DFlash2DraftModel
        from .modeling_dflash import DFlashDraftModel

        return DFlashDraftModel

    @classmethod
    def detects(cls, config: Mapping[str, Any]) -> bool:
        """Whether a config.json dict is in this layout."""
        raise NotImplementedError

    @classmethod
    def declares_drafter(cls, config: Mapping[str, Any]) -> bool:
        """Whether the dict's `architectures`, when it lists any, names this layout's drafter class."""
        names = config.get("architectures") or []
        return not names or cls.drafter_class in names

    @classmethod
    def check_file(cls, config: Mapping[str, Any]) -> None:
        """Refuse a config.json of this layout that its reader would run differently from us (or that lacks a field
        a check needs); everything DFlashConfig itself checks is checked there."""

    @classmethod
    def read_config(cls, config: Mapping[str, Any]) -> DFlashConfig:
        """Our config for a config.json dict of this layout."""
        raise NotImplementedError

    @classmethod
    def read_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A checkpoint's tensors under our names, without what the layout holds besides the drafter's own."""
        return _renamed(tensors, {theirs: ours for ours, theirs in cls.renamed_tensors.items()})

    @classmethod
    def read(
        cls, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
        draft_vocab: dict[str, torch.Tensor] | None = None,
    ) -> Drafter:
        """A checkpoint of this layout (config.json dict + tensors; a draft-vocabulary file's maps) in our terms."""
        return Drafter(cls.read_config(config), cls.read_tensors(tensors), draft_vocab)

    @classmethod
    def key_mapping(cls) -> dict[str, str]:
        """The renames as transformers' `from_pretrained(key_mapping=...)` takes them (regex on their name -> ours)."""
        return {rf"^{re.escape(theirs)}": ours for ours, theirs in cls.renamed_tensors.items()}

    @classmethod
    def check_writable(cls, drafter: Drafter) -> None:
        """Refuse, before anything is written, a drafter this layout cannot hold as we run it."""
        if drafter.draft_vocab is not None:
            raise ValueError(
                f"this drafter drafts over a reduced draft vocabulary of {drafter.config.draft_vocab_size} tokens, "
                f"which the {cls.name} layout cannot hold (its readers draft over the full vocabulary); to convert it "
                "anyway, load it, call drafter.set_draft_vocabulary(None), save it, and convert that copy"
            )

    @classmethod
    def check_target(cls, config: DFlashConfig, target: TargetVocabulary) -> None:
        """Refuse a target whose embedding and lm_head this layout cannot hold for the drafter (needs_target only)."""

    @classmethod
    def write_config(cls, drafter: Drafter, target: TargetVocabulary | None = None) -> dict[str, Any]:
        """The layout's config.json dict for the drafter."""
        raise NotImplementedError

    @classmethod
    def write_tensors(cls, drafter: Drafter, target: TargetVocabulary | None = None) -> dict[str, torch.Tensor]:
        """The layout's model.safetensors tensors for the drafter."""
        return _renamed(drafter.tensors, cls.renamed_tensors)


class FlatLayout(DrafterLayout):
    """A layout whose config keeps the decoder fields at the top level: ours, z-lab's, transformers' assistant.
    `DFlashConfig(**fields)` reads these itself, through `gather` and `resolve`."""

    # Our fields such a config holds, and those of them `dflash_config` may hold instead (an architecture with more
    # fields extends both).
    read_fields: ClassVar[tuple[str, ...]] = LAYOUT_READ_FIELDS
    nested_fields: ClassVar[tuple[str, ...]] = DFLASH_FIELDS

    @classmethod
    def gather(cls, fields: Mapping[str, Any]) -> GatheredFields:
        """Our field names for the dict's spellings (shared by the flat layouts): `dflash_config`'s DFlash fields
        (a top-level value wins), `aux_hidden_state_layer_ids` (speculators' spelling of the captured layers),
        `is_causal` / `dflash_config.causal` (z-lab's newest reference, vLLM and SGLang read a top-level `is_causal`,
        vLLM also `dflash_config.causal`; the top-level one wins)."""
        other = dict(fields)
        model_type = other.pop("model_type", None)  # read here; the config built is ours, of our model_type
        nested = other.pop("dflash_config", None)
        nested = {} if nested is None else nested
        if not isinstance(nested, Mapping):
            raise ValueError(
                f"dflash_config must be an object of DFlash fields ({{\"mask_token_id\": ..., \"target_layer_ids\": "
                f"[...]}}), got {nested!r}; fix it in the drafter's config.json"
            )
        for name in cls.nested_fields:
            if other.get(name) is None and nested.get(name) is not None:
                other[name] = nested[name]
        aux_ids = other.pop("aux_hidden_state_layer_ids", None)
        if other.get("target_layer_ids") is None and aux_ids is not None:
            other["target_layer_ids"] = layers_of_hidden_states(aux_ids)
        declared_causal = other.pop("is_causal", None)
        if declared_causal is None:
            declared_causal = nested.get("causal")
        if declared_causal is not None and not isinstance(declared_causal, bool):
            raise ValueError(
                f"is_causal (or dflash_config.causal) must be true or false, got {declared_causal!r}; fix it in the "
                "drafter's config.json"
            )
        given = {name: other.pop(name, None) for name in cls.read_fields}
        dflash2 = {name: nested.get(name) for name in DFLASH2_DEFAULTS}
        return GatheredFields(model_type, given, other, declared_causal, dflash2)

    @classmethod
    def resolve(cls, gathered: GatheredFields) -> tuple[dict[str, Any], dict[str, Any]]:
        """(every field of `read_fields`, with this layout's reader's default where the dict left it out; the other
        fields that remain for PreTrainedConfig)."""
        raise NotImplementedError

    @classmethod
    def file_fields(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """The fields of a config.json dict that DFlashConfig takes (token ids, dtype, versions are not ours)."""
        return {k: v for k, v in config.items() if k in cls.read_fields or k in PUBLISHED_FILE_FIELDS}

    @classmethod
    def read_config(cls, config: Mapping[str, Any]) -> DFlashConfig:
        cls.check_file(config)
        return cls.config_class()(**cls.file_fields(config))


class OursLayout(FlatLayout):
    """hf-dflash's own layout: `DFlashDraftModel.save_pretrained`'s folder (weights, config with `auto_map`, the
    remote-code bundle, model card, generation config); fields left out take DFLASH_DEFAULTS."""

    name = "ours"

    @classmethod
    def detects(cls, config: Mapping[str, Any]) -> bool:
        return config.get("model_type") == DFLASH and not names_dflash2(config)

    @classmethod
    def resolve(cls, gathered: GatheredFields) -> tuple[dict[str, Any], dict[str, Any]]:
        fields = dict(gathered.given)
        for name, default in DFLASH_DEFAULTS.items():
            if fields[name] is None:
                fields[name] = default
        return fields, gathered.other

    @classmethod
    def file_fields(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """Every key but those that name the file's kind and code (our own fields, and PreTrainedConfig's, pass)."""
        return {k: v for k, v in config.items() if k not in ("architectures", "auto_map", "model_type")}

    @classmethod
    def check_writable(cls, drafter: Drafter) -> None:
        """Every drafter we run is ours to write."""

    @classmethod
    def write(cls, folder: str | os.PathLike, drafter: Drafter) -> None:
        """Our files are what `save_pretrained` writes: the weights, config.json with `auto_map`, the remote-code
        bundle, model card, generation config, and the draft vocabulary's maps when there is one."""
        with torch.device("meta"):
            model = cls.model_class()(drafter.config)
        # assign: the model takes the tensors themselves rather than copies; it is only saved, so its non-persistent
        # buffers (the RoPE table), which stay on the meta device, are never needed.
        model.load_state_dict(drafter.tensors, strict=True, assign=True)
        if drafter.draft_vocab is not None:
            model.set_draft_vocabulary(drafter.draft_vocabulary())
        model.save_pretrained(folder)


class ReferenceLayout(FlatLayout):
    """A flat layout published for another reader (z-lab's, transformers'): a field the file leaves out takes the
    default of the transformers config class that reader builds (`reference_config`)."""

    # Fields besides the decoder's that the reader's class gives a default when the file leaves them out.
    reader_defaults: ClassVar[tuple[str, ...]] = DFLASH_FIELDS

    @classmethod
    def resolve(cls, gathered: GatheredFields) -> tuple[dict[str, Any], dict[str, Any]]:
        given, other, model_type = gathered.given, dict(gathered.other), gathered.model_type
        reference = reference_config(model_type, {**other, **given})
        # rope_theta / rope_scaling are resolved into the reference's rope_parameters, with its default theta.
        other.pop("rope_theta", None)
        other.pop("rope_scaling", None)
        fields = dict(given)
        fields.update({name: getattr(reference, name, DFLASH_DEFAULTS[name]) for name in DFLASH_DEFAULTS})
        for name in cls.reader_defaults:
            # A file that gives num_target_layers gets our default spread of captured layers (DFlashConfig), not
            # the reader's ids, which are for its own target.
            if name == "target_layer_ids" and fields["num_target_layers"] is not None:
                continue
            if fields[name] is None:
                fields[name] = getattr(reference, name, None)
        if fields["block_size"] is None:
            raise ValueError(
                f"this {model_type} drafter config has no block_size (top level or in dflash_config), and its reader "
                "has no default; add the drafter's block size to its config.json"
            )
        return fields, other

    @classmethod
    def check_file(cls, config: Mapping[str, Any]) -> None:
        if "vocab_size" not in config:
            # Muse Glimmer configs omit it; a silent default would make every fit check against the target wrong.
            raise ValueError("this config has no vocab_size; add the target's vocab_size to its config.json and retry")

    @classmethod
    def decoder_fields(cls, config: DFlashConfig) -> dict[str, Any]:
        return {name: getattr(config, name) for name in DECODER_FIELDS}


class ZLabLayout(ReferenceLayout):
    """z-lab's layout. Its reader builds the transformers config of the file's model_type (Qwen3Config for "qwen3").

    The window rule. Qwen2/Qwen3 configs keep `sliding_window` only when `use_sliding_window` is true, so z-lab's
    class reads a file without it as "no window", and its sliding layers then attend causally to everything before
    them. The published Qwen3.5/3.6 drafters set `sliding_window` and sliding `layer_types` but not
    `use_sliding_window`; the engines they are published for, vLLM and SGLang, window those layers. We read them
    windowed too: the file names the window and the layers it applies to, which is what a per-layer `layer_types`
    exists to say, and reading it so computes what those engines compute (the two readings differ only once the
    context outgrows the window). Writing, we set `use_sliding_window: true` whenever a layer slides, so that z-lab's
    class keeps the window as well.
    """

    name = "zlab"

    @classmethod
    def detects(cls, config: Mapping[str, Any]) -> bool:
        names = config.get("architectures") or []
        return (
            cls.declares_drafter(config) and ("dflash_config" in config or cls.drafter_class in names)
            and not names_dflash2(config)
        )

    @classmethod
    def write_config(cls, drafter: Drafter, target: TargetVocabulary | None = None) -> dict[str, Any]:
        config = drafter.config
        rope = dict(config.rope_parameters or {"rope_type": "default", "rope_theta": config.default_theta})
        theta = rope.pop("rope_theta")
        sliding = SLIDING in config.layer_types
        return {
            "architectures": [cls.drafter_class],
            "model_type": "qwen3",
            **cls.decoder_fields(config),
            **({"use_sliding_window": True} if sliding else {}),
            # As transformers 4.57 (z-lab's remote code) reads RoPE: rope_theta + rope_scaling.
            "rope_theta": theta,
            "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
            "num_target_layers": config.num_target_layers,
            "block_size": config.block_size,
            "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": config.target_layer_ids},
            **({"target_model": config.target_model} if config.target_model else {}),
        }


class NativeLayout(ReferenceLayout):
    """transformers' Muse Glimmer assistant. Its reader is `MuseGlimmerAssistantConfig`, which also gives the attention
    pattern a default (every layer sliding, window 2048). Its sliding layers are bidirectional: a block row sees the
    positions within `sliding_window` on both sides, the later block rows included, where ours see the window up to
    their own row; so a drafter with sliding layers (the class default when `layer_types` is left out) has no
    equivalent between the two, and is refused both ways."""

    name = "native"
    drafter_class = "MuseGlimmerAssistantModel"
    renamed_tensors = {"fc.": "encoder.fc.", "hidden_norm.": "encoder.output_norm_enc."}
    reader_defaults = (*DFLASH_FIELDS, "layer_types", "sliding_window")
    model_type = "muse_glimmer_assistant"

    @classmethod
    def detects(cls, config: Mapping[str, Any]) -> bool:
        return config.get("model_type") == cls.model_type

    @classmethod
    def check_file(cls, config: Mapping[str, Any]) -> None:
        super().check_file(config)
        layer_types = config.get("layer_types")
        if layer_types is None or SLIDING in layer_types:
            which = "every layer sliding (the class default when layer_types is left out)" if layer_types is None else (
                f"sliding layers {[i for i, kind in enumerate(layer_types) if kind == SLIDING]}"
            )
            raise ValueError(
                f"this Muse Glimmer assistant config has {which}; transformers runs its sliding layers bidirectional "
                "(a block row sees the later block rows too) while hf-dflash runs sliding layers causal, so it would "
                "draft differently here: this drafter has no hf-dflash equivalent"
            )

    @classmethod
    def check_writable(cls, drafter: Drafter) -> None:
        config = drafter.config
        if config.attention_bias:
            raise ValueError("transformers' Muse Glimmer assistant has no attention biases; this drafter has them")
        sliding = [i for i, kind in enumerate(config.layer_types) if kind == SLIDING]
        if sliding:
            raise ValueError(
                f"this drafter has sliding layers {sliding}, which hf-dflash runs causal; transformers' Muse Glimmer "
                "assistant runs sliding layers bidirectional (a block row sees the later block rows too), so it has no "
                "native equivalent"
            )
        super().check_writable(drafter)

    @classmethod
    def write_config(cls, drafter: Drafter, target: TargetVocabulary | None = None) -> dict[str, Any]:
        config = drafter.config
        # Muse Glimmer's config requires an int window; without sliding layers ours may be None, and then is left out.
        decoder = {k: v for k, v in cls.decoder_fields(config).items() if not (k == "sliding_window" and v is None)}
        return {
            "architectures": [cls.drafter_class],
            "model_type": cls.model_type,
            **decoder,
            "rope_parameters": config.rope_parameters,
            "num_target_layers": config.num_target_layers,
            "block_size": config.block_size,
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": config.target_layer_ids,
            **({"target_model": config.target_model} if config.target_model else {}),
        }


# Why a sliding window that can cut context does not convert between our layout and speculators, either way.
WINDOW_MISMATCH = (
    "speculators window the context from the block's anchor (every block row sees the sliding_window context rows "
    "before the anchor, then the block rows up to its own) while hf-dflash, as vLLM and z-lab's reference do, windows "
    "each row from its own position (block row k sees positions anchor + k - sliding_window + 1 to anchor + k), so "
    "they see different context rows once the context outgrows the window. Only a window of at least "
    "max_position_embeddings, which never cuts anything, converts"
)


class SpeculatorsLayout(DrafterLayout):
    """vLLM speculators' DFlash checkpoint. Our drafter borrows the target's embedding and lm_head; this layout holds
    copies of both, so writing it needs the target. A field the file leaves out takes the default of speculators'
    DFlashSpeculatorConfig (`DEFAULTS`, speculators 0.9.0) or of the transformers config of its decoder's model_type."""

    name = "speculators"
    drafter_class = "DFlashSpeculator"
    speculators_model_type = "dflash"
    needs_target = True
    DEFAULTS: ClassVar[dict[str, Any]] = {
        "block_size": 8, "draft_vocab_size": 32000, "sliding_window_non_causal": False, "sample_from_anchor": False,
    }
    TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight")
    VOCAB_TENSORS = ("d2t", "t2d")
    # How we run the block rows of a sliding layer, in speculators' words: causal (a row sees the rows up to its own)
    # for DFlash, as speculators' default, vLLM and z-lab's reference do.
    sliding_non_causal: ClassVar[bool] = False
    SLIDING_MISMATCH: ClassVar[str] = (
        "this speculators drafter's sliding-window layers let every block row see the whole block "
        "(sliding_window_non_causal: true); hf-dflash runs a DFlash drafter's sliding layers causally (a block row "
        "sees the rows up to its own), as speculators' default, vLLM and z-lab's reference do, so it has no hf-dflash "
        "equivalent"
    )

    @classmethod
    def detects(cls, config: Mapping[str, Any]) -> bool:
        return cls.is_speculators_config(config) and config.get("speculators_model_type") in (
            None, cls.speculators_model_type,
        )

    @staticmethod
    def is_speculators_config(config: Mapping[str, Any]) -> bool:
        """Whether a config dict is a speculators checkpoint's (of any algorithm)."""
        return "speculators_model_type" in config or "transformer_layer_config" in config

    @classmethod
    def detects_tensors(cls, names: set[str]) -> bool:
        """Whether tensor names (those a drafter of ours does not have) are this layout's: a copy of the target's
        embedding, or the reduced draft vocabulary's maps."""
        return bool(names & {"embed_tokens.weight", *cls.VOCAB_TENSORS})

    @classmethod
    def layer_config(cls, config: Mapping[str, Any]) -> PreTrainedConfig:
        """The decoder config speculators builds from `transformer_layer_config`: the transformers config class of its
        model_type (Qwen3Config without one), from every field written there, so its defaults apply as there."""
        layer = config["transformer_layer_config"]
        if not isinstance(layer, Mapping):
            raise ValueError(
                f"transformer_layer_config must be an object of decoder fields, got {layer!r}; fix the config.json"
            )
        layer = dict(layer)
        cls.config_class().check_field_types(layer)  # before the transformers class, whose errors name no fix
        return reader_config(layer.pop("model_type", "qwen3"), layer)

    @classmethod
    def read_config(cls, config: Mapping[str, Any]) -> DFlashConfig:
        config = {**cls.DEFAULTS, **config}
        if config["sample_from_anchor"]:
            raise ValueError(
                "this speculators checkpoint predicts from the anchor row too (sample_from_anchor: true, as DSpark "
                "does); a DFlash drafter discards that row, so it cannot be converted"
            )
        aux_ids = config.get("aux_hidden_state_layer_ids")
        if not aux_ids:
            raise ValueError("this speculators config names no aux_hidden_state_layer_ids (the captured target layers)")
        target_layer_ids = layers_of_hidden_states(aux_ids)
        layer = cls.layer_config(config)
        fields = {k: getattr(layer, k) for k in DECODER_FIELDS if hasattr(layer, k)}
        fields["rope_parameters"] = dict(layer.rope_parameters)
        # speculators gives a layer a window when its config keeps one: Qwen3Config drops `sliding_window` unless
        # `use_sliding_window` is set, and then its "sliding" layers attend to everything, as full layers do.
        sliding = [t == SLIDING for t in (getattr(layer, "layer_types", None) or [])]
        if any(sliding) and layer.sliding_window is None:
            fields.update(layer_types=[FULL] * layer.num_hidden_layers, sliding_window=None)
        elif any(sliding) and config["sliding_window_non_causal"] != cls.sliding_non_causal:
            raise ValueError(cls.SLIDING_MISMATCH)
        elif any(sliding) and layer.sliding_window < layer.max_position_embeddings:
            raise ValueError(f"this speculators drafter has sliding-window layers; {WINDOW_MISMATCH}")
        if config.get("target_hidden_size") not in (None, layer.hidden_size):
            raise ValueError(
                f"target_hidden_size is {config['target_hidden_size']} but speculators sizes fc and the embedding by "
                f"the drafter's hidden_size ({layer.hidden_size}); this checkpoint is inconsistent"
            )
        verifier = (config.get("speculators_config") or {}).get("verifier") or {}
        fields.update(
            block_size=config["block_size"],
            mask_token_id=config.get("mask_token_id"),
            target_layer_ids=target_layer_ids,
            target_model=verifier.get("name_or_path"),
        )
        if config.get("num_target_layers") is not None:
            fields["num_target_layers"] = config["num_target_layers"]
        if config["draft_vocab_size"] != layer.vocab_size:
            fields["draft_vocab_size"] = config["draft_vocab_size"]
        return cls.config_class()(**fields, **cls.architecture_fields(config))

    @classmethod
    def architecture_fields(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """The fields of our config that the drafter's architecture adds, from a config dict with `DEFAULTS`."""
        return {}

    @classmethod
    def read(
        cls, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
        draft_vocab: dict[str, torch.Tensor] | None = None,
    ) -> Drafter:
        ours = cls.read_config(config)
        if ours.draft_vocab_size is not None:
            missing = [k for k in cls.VOCAB_TENSORS if k not in tensors]
            if missing:
                raise ValueError(f"draft_vocab_size is {ours.draft_vocab_size} but the checkpoint lacks {missing}")
            draft_vocab = {k: tensors[k] for k in cls.VOCAB_TENSORS}
        return Drafter(ours, cls.read_tensors(tensors), draft_vocab)

    @classmethod
    def read_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dropped = set(cls.TARGET_TENSORS + cls.VOCAB_TENSORS)
        return {k: v for k, v in tensors.items() if k not in dropped and not k.startswith("verifier_")}

    @classmethod
    def check_writable(cls, drafter: Drafter) -> None:
        config = drafter.config
        if SLIDING in config.layer_types and config.sliding_window < config.max_position_embeddings:
            raise ValueError(
                f"the drafter has sliding-window layers (window {config.sliding_window}, positions up to "
                f"{config.max_position_embeddings}); {WINDOW_MISMATCH}"
            )

    @classmethod
    def check_target(cls, config: DFlashConfig, target: TargetVocabulary) -> None:
        if tuple(target.embedding.shape) != (config.vocab_size, config.target_hidden_size):
            raise ValueError(
                f"the target's embedding is {tuple(target.embedding.shape)}, the drafter expects "
                f"({config.vocab_size}, {config.target_hidden_size}): this target is not the drafter's"
            )
        last = (target.config.get("text_config") or target.config)["num_hidden_layers"] - 1
        if last in config.target_layer_ids:
            raise ValueError(
                f"the drafter captures the target's last layer ({last}); speculators always feed that layer separately "
                "(as the verifier's last hidden state), so this drafter has no speculators equivalent"
            )

    @classmethod
    def write_tensors(cls, drafter: Drafter, target: TargetVocabulary | None = None) -> dict[str, torch.Tensor]:
        tensors = {**drafter.tensors, "embed_tokens.weight": target.embedding}
        if drafter.draft_vocab is None:
            tensors["lm_head.weight"] = target.lm_head
        else:
            tensors.update(drafter.draft_vocab)
            tensors["lm_head.weight"] = target.lm_head[drafter.draft_vocab["t2d"].bool()]
        return tensors

    @classmethod
    def write_config(cls, drafter: Drafter, target: TargetVocabulary | None = None) -> dict[str, Any]:
        config = drafter.config
        draft_vocab_size = config.vocab_size if drafter.draft_vocab is None else drafter.draft_vocab["d2t"].shape[0]
        layer = {"model_type": "qwen3", **ReferenceLayout.decoder_fields(config),
                 "rope_parameters": config.rope_parameters}
        if SLIDING in config.layer_types:
            # Qwen3Config, which speculators builds from this dict, drops the window otherwise.
            layer["use_sliding_window"] = True
        return {
            "architectures": [cls.drafter_class],
            "speculators_model_type": cls.speculators_model_type,
            "transformer_layer_config": layer,
            "draft_vocab_size": draft_vocab_size,
            "block_size": config.block_size,
            "target_hidden_size": config.target_hidden_size,
            "num_target_layers": config.num_target_layers,  # not speculators': kept so a conversion back is exact
            "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
            "mask_token_id": config.mask_token_id,
            # How we run a sliding layer's block rows (DFlash: causal, as speculators' default; full layers are
            # bidirectional either way).
            "sliding_window_non_causal": cls.sliding_non_causal,
            "sample_from_anchor": False,
            "speculators_config": {
                "algorithm": cls.speculators_model_type,
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size - 1}],
                "default_proposal_method": "greedy",
                # The target the drafter records (a Hub id) over the path its embedding was read from, which may be a
                # folder of this machine's.
                "verifier": {"name_or_path": config.target_model or target.source,
                             "architectures": target.config.get("architectures", [])},
            },
        }


# --------------------------------------------------------------------------------------------------
# DFlash2 (modeling_dflash2.py): the same layouts, with the fields and tensors it adds. Its tensors (layers.{i}.
# attention_conv.*, layers.{i}.mlp_conv.*, candidate_selector.*) carry the same names in every layout; its sliding
# layers let the block rows see each other both ways (a symmetric window), as z-lab's files say with
# `is_causal: false` and speculators' with `sliding_window_non_causal: true`. transformers' assistant has no DFlash2
# form.
# --------------------------------------------------------------------------------------------------


def names_dflash2(config: Mapping[str, Any]) -> bool:
    """Whether a config.json dict (of a flat layout) is a DFlash2 drafter's: `architectures` lists DFlash2DraftModel,
    or a DFlash2 field is set, at the top level or in `dflash_config`. One that sets DFlash2 fields while naming
    another drafter class is refused."""
    names = config.get("architectures") or []
    nested = config.get("dflash_config")
    nested = nested if isinstance(nested, Mapping) else {}
    fields = [name for name in DFLASH2_DEFAULTS if config.get(name) is not None or nested.get(name) is not None]
    if fields and names and DFLASH2_CLASS not in names:
        raise ValueError(
            f"this drafter config sets the DFlash2 fields {fields} but its architectures {names} name no "
            f"{DFLASH2_CLASS}; correct the architectures, or remove those fields, in its config.json"
        )
    return bool(fields) or DFLASH2_CLASS in names


class Ours2Layout(OursLayout):
    """Our layout of a DFlash2 drafter: `DFlash2DraftModel.save_pretrained`'s folder, the DFlash2 fields at the top
    level beside the DFlash ones, `architectures: ["DFlash2DraftModel"]` and `auto_map` to modeling_dflash2."""

    architecture = DFLASH2
    drafter_class = DFLASH2_CLASS

    @classmethod
    def detects(cls, config: Mapping[str, Any]) -> bool:
        return config.get("model_type") == DFLASH and names_dflash2(config)


class ZLab2Layout(ZLabLayout):
    """z-lab's DFlash2 layout (z-lab/dflash tests/fixtures/dflash2-config.json, and the published DFlash2 drafters):
    `architectures: ["DFlash2DraftModel"]`, the decoder family's model_type, the DFlash and DFlash2 fields in
    `dflash_config` (block_size included), `is_causal: false`. A key of `dflash_config` this reader does not know is
    refused, naming it."""

    architecture = DFLASH2
    drafter_class = DFLASH2_CLASS

    @classmethod
    def detects(cls, config: Mapping[str, Any]) -> bool:
        if config.get("model_type") in (DFLASH, NativeLayout.model_type) or SpeculatorsLayout.is_speculators_config(
            config
        ):
            return False
        return names_dflash2(config)

    @classmethod
    def check_file(cls, config: Mapping[str, Any]) -> None:
        super().check_file(config)
        nested = config.get("dflash_config") or {}
        unknown = sorted(set(nested) - set(DFLASH2_NESTED_FIELDS)) if isinstance(nested, Mapping) else []
        if unknown:
            raise ValueError(
                f"this DFlash2 config's dflash_config holds {unknown}, which hf-dflash does not know (it reads "
                f"{', '.join(DFLASH2_NESTED_FIELDS)}); a newer DFlash2 variant, or a typo: this drafter is not "
                "supported as written"
            )

    @classmethod
    def write_config(cls, drafter: Drafter, target: TargetVocabulary | None = None) -> dict[str, Any]:
        config = drafter.config
        out = super().write_config(drafter, target)
        out["architectures"] = [cls.drafter_class]
        out["is_causal"] = False  # every layer lets the block rows see each other (sliding ones within the window)
        nested = {"block_size": out.pop("block_size"), **out["dflash_config"]}
        nested.update({name: getattr(config, name) for name in DFLASH2_DEFAULTS if getattr(config, name) is not None})
        out["dflash_config"] = nested
        return out


class Speculators2Layout(SpeculatorsLayout):
    """speculators' DFlash2 checkpoint (`speculators_model_type: "dflash2"`, speculators' DFlash2SpeculatorConfig):
    DFlash's speculators layout plus the DFlash2 fields at the top level (its defaults are the published ones), and
    `sliding_window_non_causal` true by default, which is how we run DFlash2's sliding layers. speculators trains
    DFlash2 over the full vocabulary only, so a reduced draft vocabulary is refused both ways."""

    architecture = DFLASH2
    drafter_class = DFLASH2_CLASS
    speculators_model_type = DFLASH2
    DEFAULTS: ClassVar[dict[str, Any]] = {
        **SpeculatorsLayout.DEFAULTS,
        "sliding_window_non_causal": True,
        **{name: DFLASH2_DEFAULTS[name] for name in ("conv_kernel_size", "conv_group_size", "selector_rank",
                                                      "selector_top_k")},
    }
    sliding_non_causal = True
    SLIDING_MISMATCH = (
        "this speculators DFlash2 drafter runs its sliding layers causally inside the block "
        "(sliding_window_non_causal: false); hf-dflash, as z-lab's reference and speculators' DFlash2 default do, lets "
        "a DFlash2 drafter's block rows see each other both ways there, so it has no hf-dflash equivalent"
    )

    @classmethod
    def read_config(cls, config: Mapping[str, Any]) -> DFlashConfig:
        ours = super().read_config(config)
        if ours.draft_vocab_size is not None:
            raise ValueError(
                f"this speculators DFlash2 checkpoint drafts over {ours.draft_vocab_size} of the target's "
                f"{ours.vocab_size} tokens; DFlash2's selector scores the full vocabulary (speculators trains it so "
                "only), so this checkpoint is inconsistent"
            )
        return ours

    @classmethod
    def architecture_fields(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        return {name: config.get(name, cls.DEFAULTS.get(name)) for name in DFLASH2_DEFAULTS}

    @classmethod
    def check_writable(cls, drafter: Drafter) -> None:
        super().check_writable(drafter)
        if drafter.draft_vocab is not None:
            raise ValueError(
                "speculators' DFlash2 drafters draft over the full vocabulary; this one has a reduced draft "
                "vocabulary: load it, call drafter.set_draft_vocabulary(None), save it, and convert that copy"
            )

    @classmethod
    def write_config(cls, drafter: Drafter, target: TargetVocabulary | None = None) -> dict[str, Any]:
        config = drafter.config
        out = super().write_config(drafter, target)
        out.update({name: getattr(config, name) for name in DFLASH2_DEFAULTS if getattr(config, name) is not None})
        return out


# Every layout, in the order detection tries them (a layout of a further architecture goes ahead of the one it
# extends, so that each claims only its own files).
LAYOUTS: tuple[type[DrafterLayout], ...] = (
    Speculators2Layout, SpeculatorsLayout, NativeLayout, Ours2Layout, OursLayout, ZLab2Layout, ZLabLayout,
)
LAYOUT_NAMES = tuple(dict.fromkeys(layout.name for layout in LAYOUTS))


def detect_layout(config: Mapping[str, Any]) -> type[DrafterLayout]:
    """The layout of a config.json dict; a config in none (a target's, say) is refused."""
    for layout in LAYOUTS:
        if layout.detects(config):
            return layout
    architectures = f", architectures {config['architectures']}" if config.get("architectures") else ""
    raise ValueError(
        f"config.json (model_type {config.get('model_type')!r}{architectures}) is not a DFlash drafter in any known "
        f"layout ({', '.join(LAYOUT_NAMES)}); check the path"
    )


def layout_named(name: str, architecture: str = "dflash") -> type[DrafterLayout]:
    """The layout `hf-dflash convert --to name` writes for a drafter of `architecture` (`DFlashConfig.architecture`:
    dflash or dflash2)."""
    for layout in LAYOUTS:
        if layout.name == name and layout.architecture == architecture:
            return layout
    if name not in LAYOUT_NAMES:
        raise ValueError(f"unknown layout {name!r}; pick one of {', '.join(LAYOUT_NAMES)}")
    raise ValueError(f"the {name} layout cannot hold a {architecture} drafter")


def config_fields_layout(fields: Mapping[str, Any], architecture: str = "dflash") -> type[FlatLayout]:
    """The flat layout whose reader the config class of `architecture` applies to its keyword `fields`, by their
    model_type: none, or the architecture's own, is ours; the assistant's is transformers'; any other is z-lab's
    (whose reader builds that model_type's config). A speculators dict is refused: its decoder fields need reading
    as a whole file."""
    if SpeculatorsLayout.is_speculators_config(fields):
        raise ValueError(
            "this is a vLLM speculators checkpoint config (its decoder fields sit in transformer_layer_config); "
            "convert it first: `hf-dflash convert SRC OUT --to ours`"
        )
    model_type = fields.get("model_type") or architecture
    if model_type == architecture:
        return layout_named(OursLayout.name, architecture)
    return layout_named(NativeLayout.name if model_type == NativeLayout.model_type else ZLabLayout.name, architecture)


def loading_key_mapping() -> dict[str, str]:
    """Every layout's tensor renames, for `from_pretrained(key_mapping=...)` (z-lab's files use our names)."""
    return {pattern: ours for layout in LAYOUTS for pattern, ours in layout.key_mapping().items()}


__all__ = [
    "CONFIG_FILE",
    "DFLASH",
    "DFLASH2",
    "DFLASH2_CLASS",
    "DFLASH2_NESTED_FIELDS",
    "DECODER_FIELDS",
    "DFLASH2_DEFAULTS",
    "DFLASH_DEFAULTS",
    "DFLASH_FIELDS",
    "Drafter",
    "DrafterLayout",
    "FlatLayout",
    "GatheredFields",
    "LAYOUTS",
    "LAYOUT_NAMES",
    "NativeLayout",
    "OursLayout",
    "ReferenceLayout",
    "Ours2Layout",
    "Speculators2Layout",
    "SpeculatorsLayout",
    "TargetVocabulary",
    "ZLab2Layout",
    "ZLabLayout",
    "names_dflash2",
    "config_fields_layout",
    "detect_layout",
    "layers_of_hidden_states",
    "layout_named",
    "loading_key_mapping",
    "read_config_file",
    "reader_config",
    "reference_config",
]
