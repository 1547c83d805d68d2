"""Configuration of a DFlash drafter, and the checks every field passes where a config is built.

`DFlashConfig(**fields)` reads the three flat layouts of a drafter config (ours, z-lab's, transformers' Muse Glimmer
assistant: transformers' from_pretrained calls it with a file's dict); dflash_layouts.py knows them, and says which
defaults a field each leaves out takes. Every field is then checked for its type and range (`FIELD_RULES`) and against
the others, so a bad config is refused with a ValueError that names the field and the fix before anything is built from
it, by `from_pretrained`, `hf-dflash info` and `hf-dflash convert` alike.

This file is part of the remote-code bundle: it imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.utils import logging

from .dflash_layouts import (
    DFLASH,
    DFLASH2,
    DFLASH2_CLASS,
    DFLASH2_DEFAULTS,
    DFLASH_DEFAULTS,
    LAYOUT_READ_FIELDS,
    config_fields_layout,
    detect_layout,
)

logger = logging.get_logger(__name__)

# The largest block a drafter may draft. A block of B rows is drafted in one drafter forward and verified in one
# target forward of B rows; published drafters use 8 to 16, and a step commits at most its accepted drafts plus one,
# so past a few dozen rows a larger block only makes every step slower. 1024 leaves room for any experiment and
# refuses the nonsense (a block of 100000 rows sizes every per-step buffer for 100000 rows). A block must also fit
# the drafter's positions (max_position_embeddings).
MAX_BLOCK_SIZE = 1024


@dataclass(frozen=True)
class FieldRule:
    """What a config field must hold when it is set (None always passes: the field then takes its default).

    kind: "integer", "number" (an integer or a float), "boolean", "string" or "object" (a dict); with `items`, a
    non-empty list of those. low / high bound a number inclusively, above / below exclusively (each item of a list);
    even: an even integer. meaning: what the field is, for the message.
    """

    kind: str
    meaning: str
    low: float | None = None
    high: float | None = None
    above: float | None = None
    below: float | None = None
    items: bool = False
    even: bool = False

    def describe(self) -> str:
        article = {"integer": "an even integer" if self.even else "an integer", "number": "a number",
                   "boolean": "true or false", "string": "a string", "object": "an object ({...})"}[self.kind]
        if self.items:
            article = "a non-empty list of " + {"integer": "integers", "string": "strings"}[self.kind]
        bounds = []
        if self.low is not None and self.high is not None:
            bounds.append(f"from {self.low:g} to {self.high:g}")
        elif self.low is not None:
            bounds.append(f">= {self.low:g}")
        elif self.high is not None:
            bounds.append(f"<= {self.high:g}")
        if self.above is not None:
            bounds.append(f"> {self.above:g}")
        if self.below is not None:
            bounds.append(f"< {self.below:g}")
        return " ".join([article, *bounds]) + (" each" if self.items and bounds else "")

    def admits(self, value: Any) -> bool:
        if self.items:
            return isinstance(value, list) and bool(value) and all(self._admits_one(v) for v in value)
        return self._admits_one(value)

    def _admits_one(self, value: Any) -> bool:
        if self.kind == "boolean":
            return isinstance(value, bool)
        if self.kind == "string":
            return isinstance(value, str)
        if self.kind == "object":
            return isinstance(value, Mapping)
        numeric = (int,) if self.kind == "integer" else (int, float)
        if isinstance(value, bool) or not isinstance(value, numeric) or not math.isfinite(value):
            return False
        return (
            (self.low is None or value >= self.low) and (self.high is None or value <= self.high)
            and (self.above is None or value > self.above) and (self.below is None or value < self.below)
            and not (self.even and value % 2)
        )


FIELD_RULES: dict[str, FieldRule] = {
    "hidden_size": FieldRule("integer", "the drafter's width, which is the target's hidden size", low=1),
    "intermediate_size": FieldRule("integer", "the width of the drafter's MLP", low=1),
    "num_hidden_layers": FieldRule("integer", "the number of drafter layers", low=1),
    "num_attention_heads": FieldRule("integer", "the number of query heads", low=1),
    "num_key_value_heads": FieldRule("integer", "the number of key/value heads", low=1),
    "head_dim": FieldRule("integer", "the width of one attention head; RoPE rotates pairs of dimensions", low=2,
                          even=True),
    "hidden_act": FieldRule("string", "the MLP's activation, e.g. silu"),
    "rms_norm_eps": FieldRule("number", "the RMSNorm epsilon", above=0),
    "max_position_embeddings": FieldRule("integer", "the number of positions the drafter serves", low=1),
    "rope_parameters": FieldRule("object", 'the RoPE settings ({"rope_type": ..., "rope_theta": ...})'),
    "rope_theta": FieldRule("number", "the RoPE base", above=0),
    "rope_scaling": FieldRule("object", "the RoPE scaling settings"),
    "attention_bias": FieldRule("boolean", "whether the attention projections carry a bias"),
    "attention_dropout": FieldRule("number", "the attention dropout probability", low=0, below=1),
    "layer_types": FieldRule("string", "each layer's attention, full_attention or sliding_attention", items=True),
    "sliding_window": FieldRule("integer", "the window of sliding layers, in tokens", low=1),
    "vocab_size": FieldRule("integer", "the target's vocabulary size", low=1),
    "target_hidden_size": FieldRule("integer", "the width of the target's hidden states", low=1),
    "num_target_layers": FieldRule("integer", "the number of the target's decoder layers", low=1),
    "target_layer_ids": FieldRule("integer", "the 0-based target layers whose outputs the drafter reads", low=0,
                                  items=True),
    "block_size": FieldRule(
        "integer", "tokens per drafted block, the anchor included, verified in one target forward", low=2,
        high=MAX_BLOCK_SIZE,
    ),
    "mask_token_id": FieldRule("integer", "the target's token id whose embedding fills the block's mask rows", low=0),
    "initializer_range": FieldRule("number", "the standard deviation of fresh weights", low=0),
    "tie_word_embeddings": FieldRule("boolean", "whether the model ties embeddings (a drafter has none)"),
    "target_model": FieldRule("string", "the target's Hub id or name"),
    "draft_vocab_size": FieldRule("integer", "the number of target ids the drafter drafts over", low=1),
    # DFlash2 (modeling_dflash2.py)
    "conv_kernel_size": FieldRule("integer", "the taps of each DFlash2 convolution along the block", low=1),
    "conv_group_size": FieldRule("integer", "the channels sharing one dynamic convolution weight", low=1),
    "selector_rank": FieldRule("integer", "the width of the candidate selector's codebooks", low=1),
    "selector_top_k": FieldRule("integer", "the candidates per block row the selector chooses among", low=1),
    "output_multiplier": FieldRule("number", "the scale of the drafter's logits before the soft cap", above=0),
    "final_logit_softcapping": FieldRule("number", "c of c * tanh(logits / c) (0 or null: no cap)", low=0),
    "input_embedding_scale": FieldRule("number", "the scale of the block rows' embeddings", above=0),
}



def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The published default choice of target layers to capture (one per drafter layer).

    One drafter layer reads the middle layer; otherwise the ids are spread evenly from layer 1 to layer L - 3.
    """
    if num_target_layers < 1 or num_draft_layers < 1:
        raise ValueError(f"need at least one target and one drafter layer, got {num_target_layers}, {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"a target with {num_target_layers} layers is too shallow for the default spread of {num_draft_layers} "
            "captured layers; pass target_layer_ids explicitly"
        )
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class DFlashConfig(PreTrainedConfig):
    r"""Configuration of a [`DFlashDraftModel`].

    The drafter is a stack of Qwen3-style decoder layers without embedding or lm_head: block tokens are embedded
    with the target's input embedding, and draft logits come from the target's lm_head.

    Args (a decoder field left None takes the default of the layout named by `model_type`: `DFLASH_DEFAULTS` for ours,
    the reference class's for a published layout; see dflash_layouts.py. Each is checked: `FIELD_RULES`):
        hidden_size: width of the drafter's residual stream.
        intermediate_size: width of the SwiGLU MLP.
        num_hidden_layers: number of drafter decoder layers.
        num_attention_heads / num_key_value_heads / head_dim: attention shape (GQA).
        target_hidden_size: width of the target's hidden states; `fc` maps `len(target_layer_ids) *
            target_hidden_size` features to `hidden_size`. It must equal `hidden_size` (its default): block tokens
            are embedded with the target's embedding and drafts read through the target's lm_head, both that wide.
        num_target_layers: number of decoder layers of the target the drafter was built for.
        target_layer_ids: 0-based target decoder layers whose OUTPUTS are captured as context.
        block_size: tokens per drafted block, the anchor included (B).
        mask_token_id: target-vocabulary id whose embedding fills the B - 1 mask rows of a block.
        vocab_size: the target's vocabulary size (the drafter has no embedding; kept for fit checks).
        rope_parameters: RoPE settings (`rope_theta` alone is accepted and converted).
        layer_types: per layer `"full_attention"` or `"sliding_attention"`.
        sliding_window: window of sliding layers, in tokens.
        attention_bias: whether q/k/v/o projections carry a bias.
        target_model: Hub id or name of the target the drafter was trained for (model cards, `hf-dflash info`).
        draft_vocab_size: number of target ids the drafter drafts over when it has a reduced draft vocabulary (their
            ids are in `draft_vocab.safetensors` beside the weights; `DFlashDraftModel.set_draft_vocabulary`); None
            drafts over the full vocabulary.
        conv_kernel_size, conv_group_size, selector_rank, selector_top_k, output_multiplier, final_logit_softcapping,
            input_embedding_scale: the fields of a DFlash2 drafter (modeling_dflash2.py). A config is a DFlash2 one
            when it sets any of them or its `architectures` lists DFlash2DraftModel; those it leaves out then take
            the published values (`DFLASH2_DEFAULTS`). A DFlash config holds None in each and does not write them.
    """

    model_type = "dflash"
    default_theta = 1_000_000.0
    # Configs of published drafters by Hub id, for when the Hub is out of reach and nothing is cached. Empty in a
    # remote-code environment; the hf_dflash library fills it from its hub_configs/ folder.
    published_configs: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(
        self,
        hidden_size: int | None = None,
        intermediate_size: int | None = None,
        num_hidden_layers: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        hidden_act: str | None = None,
        rms_norm_eps: float | None = None,
        max_position_embeddings: int | None = None,
        rope_parameters: dict[str, Any] | None = None,
        attention_bias: bool | None = None,
        attention_dropout: float | None = None,
        layer_types: list[str] | None = None,
        sliding_window: int | None = None,
        vocab_size: int | None = None,
        target_hidden_size: int | None = None,
        num_target_layers: int | None = None,
        target_layer_ids: list[int] | None = None,
        block_size: int | None = None,
        mask_token_id: int | None = None,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        target_model: str | None = None,
        draft_vocab_size: int | None = None,
        conv_kernel_size: int | None = None,
        conv_group_size: int | None = None,
        selector_rank: int | None = None,
        selector_top_k: int | None = None,
        output_multiplier: float | None = None,
        final_logit_softcapping: float | None = None,
        input_embedding_scale: float | None = None,
        **kwargs: Any,
    ):
        layout = config_fields_layout(kwargs, self.model_type)
        gathered = layout.gather(dict(
            hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, head_dim=head_dim,
            hidden_act=hidden_act, rms_norm_eps=rms_norm_eps, max_position_embeddings=max_position_embeddings,
            rope_parameters=rope_parameters, attention_bias=attention_bias, attention_dropout=attention_dropout,
            layer_types=layer_types, sliding_window=sliding_window, vocab_size=vocab_size,
            target_hidden_size=target_hidden_size, num_target_layers=num_target_layers,
            target_layer_ids=target_layer_ids, block_size=block_size, mask_token_id=mask_token_id, **kwargs,
        ))
        # Types first: the reference class of another layout (a transformers config) would refuse a mistyped value
        # with its own message, which names no fix.
        own = dict(initializer_range=initializer_range, tie_word_embeddings=tie_word_embeddings,
                   target_model=target_model, draft_vocab_size=draft_vocab_size)
        dflash2 = dict(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size, selector_rank=selector_rank,
                       selector_top_k=selector_top_k, output_multiplier=output_multiplier,
                       final_logit_softcapping=final_logit_softcapping, input_embedding_scale=input_embedding_scale)
        dflash2.update({k: v for k, v in gathered.dflash2.items() if dflash2[k] is None})
        self.check_field_types({**gathered.other, **gathered.given, **own, **dflash2})
        # Fields the file left out take the defaults of its layout's reader (dflash_layouts.py).
        fields, kwargs = layout.resolve(gathered)
        self.hidden_size = fields["hidden_size"]
        self.intermediate_size = fields["intermediate_size"]
        self.num_hidden_layers = fields["num_hidden_layers"]
        self.num_attention_heads = fields["num_attention_heads"]
        self.num_key_value_heads = fields["num_key_value_heads"] or self.num_attention_heads
        self.head_dim = fields["head_dim"] or self._default_head_dim()
        self.hidden_act = fields["hidden_act"]
        self.rms_norm_eps = fields["rms_norm_eps"]
        self.max_position_embeddings = fields["max_position_embeddings"]
        self.rope_parameters = dict(fields["rope_parameters"]) if fields["rope_parameters"] else None
        self.attention_bias = fields["attention_bias"]
        self.attention_dropout = fields["attention_dropout"]
        layer_types = fields["layer_types"]
        self.layer_types = list(layer_types) if layer_types is not None else ["full_attention"] * self.num_hidden_layers
        self.sliding_window = fields["sliding_window"]
        self.vocab_size = fields["vocab_size"]
        target_hidden_size = fields["target_hidden_size"]
        self.target_hidden_size = target_hidden_size if target_hidden_size is not None else self.hidden_size
        target_layer_ids, num_target_layers = fields["target_layer_ids"], fields["num_target_layers"]
        self.target_layer_ids = list(target_layer_ids) if target_layer_ids is not None else None
        if num_target_layers is None and self.target_layer_ids:
            num_target_layers = max(self.target_layer_ids) + 1
        self.num_target_layers = num_target_layers
        if self.target_layer_ids is None and num_target_layers is not None:
            self.target_layer_ids = default_target_layer_ids(num_target_layers, self.num_hidden_layers)
        self.block_size = fields["block_size"] if fields["block_size"] is not None else 16
        self.mask_token_id = fields["mask_token_id"]
        self.initializer_range = initializer_range
        self.target_model = target_model
        self.draft_vocab_size = draft_vocab_size
        is_dflash2 = any(v is not None for v in dflash2.values()) or DFLASH2_CLASS in (
            kwargs.get("architectures") or []
        )
        for name, value in dflash2.items():
            setattr(self, name, value if value is not None or not is_dflash2 else DFLASH2_DEFAULTS[name])
        if is_dflash2 and self.final_logit_softcapping == 0:  # z-lab's and vLLM's readers take 0 as "no cap"
            self.final_logit_softcapping = None
        # Resolved defaults pass the same checks (a reader's default can be wrong for this drafter).
        self.check_field_types({name: getattr(self, name) for name in LAYOUT_READ_FIELDS})
        self._validate_dflash_fields()  # before the base class, whose own checks give vaguer messages
        if self.is_dflash2:
            self._validate_dflash2_fields()
        self._check_declared_causality(gathered.declared_causal)
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def is_dflash2(self) -> bool:
        """Whether this is a DFlash2 drafter's config (`DFlash2DraftModel`), which sets every DFlash2 field."""
        return self.conv_kernel_size is not None

    @property
    def architecture(self) -> str:
        """The drafter this config builds, as the layouts name it: "dflash" or "dflash2"."""
        return DFLASH2 if self.is_dflash2 else DFLASH

    def to_dict(self) -> dict[str, Any]:
        """PreTrainedConfig's dict, without the DFlash2 fields of a DFlash config (all None), so that a DFlash
        drafter's config.json stays what it was before DFlash2."""
        output = super().to_dict()
        if not self.is_dflash2:
            for name in DFLASH2_DEFAULTS:
                output.pop(name, None)
        return output

    @staticmethod
    def check_field_types(fields: Mapping[str, Any]) -> None:
        """Refuse a value of the wrong type or out of range for its field (`FIELD_RULES`; keys without a rule and
        None values pass) with a ValueError that names the field and what it must be."""
        for name, value in fields.items():
            rule = FIELD_RULES.get(name)
            if rule is None or value is None or rule.admits(value):
                continue
            raise ValueError(
                f"{name} must be {rule.describe()} ({rule.meaning}), got {value!r}; correct it in the drafter's "
                "config.json, or where the config is built"
            )

    def _default_head_dim(self) -> int:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}, "
                "so the head width is not hidden_size / heads; set head_dim"
            )
        return self.hidden_size // self.num_attention_heads

    def _validate_dflash_fields(self) -> None:
        if self.target_hidden_size != self.hidden_size:
            raise ValueError(
                f"hidden_size {self.hidden_size} differs from the target's {self.target_hidden_size}: a DFlash drafter "
                "embeds its block with the target's embedding and drafts through the target's lm_head, so it is as "
                f"wide as its target; set hidden_size={self.target_hidden_size}"
            )
        if self.block_size > self.max_position_embeddings:
            raise ValueError(
                f"block_size {self.block_size} is more than max_position_embeddings {self.max_position_embeddings}: "
                "every block row takes a position of its own; set the drafter's block size (published drafters use "
                "8 to 16)"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but the drafter has {self.num_hidden_layers} layers; "
                "give one entry per layer"
            )
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"unsupported layer_types {sorted(unknown)}; use full_attention or sliding_attention")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types contains sliding_attention but sliding_window is not set; set the window")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}): each key/value head serves a whole group of query heads"
            )
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not an activation transformers knows; use e.g. silu")
        self._check_rope()
        if self.mask_token_id is not None and self.mask_token_id >= self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target vocabulary (0..{self.vocab_size - 1}): the "
                "mask rows are embedded with the target's embedding; pass the id of a row real text never uses"
            )
        if self.target_layer_ids is not None and self.num_target_layers is not None:
            bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
            if bad:
                raise ValueError(
                    f"target_layer_ids {bad} are outside the target's {self.num_target_layers} layers (0-based)"
                )

    def _validate_dflash2_fields(self) -> None:
        """A DFlash2 config's fields against the rest (each has passed its FIELD_RULES already)."""
        if self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"conv_group_size {self.conv_group_size} must divide hidden_size {self.hidden_size}: each dynamic "
                "convolution weight covers a group of that many channels; set it to a divisor (16 in the published "
                "drafters)"
            )
        if self.conv_kernel_size > self.block_size:
            raise ValueError(
                f"conv_kernel_size {self.conv_kernel_size} must be between 1 and block_size {self.block_size}: a tap "
                "never reaches past the block's first row"
            )
        if self.selector_top_k > self.vocab_size:
            raise ValueError(
                f"selector_top_k {self.selector_top_k} must be between 1 and vocab_size {self.vocab_size}"
            )

    def _check_rope(self) -> None:
        if self.rope_parameters is None:
            return
        rope_type = self.rope_parameters.get("rope_type", self.rope_parameters.get("type", "default"))
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(
                f"rope_parameters has rope_type {rope_type!r}, which transformers does not know; use default or one of "
                f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}"
            )
        theta = self.rope_parameters.get("rope_theta")
        if theta is not None:
            self.check_field_types({"rope_theta": theta})

    def _check_declared_causality(self, declared_causal: bool | None) -> None:
        """What we run: a DFlash drafter's sliding layer is causal (a block row sees the `sliding_window` positions up
        to its own), a full layer bidirectional (block rows see each other); every DFlash2 layer is bidirectional (a
        sliding one within a symmetric window). A config that declares one causality for every layer asks for
        something else as soon as one layer disagrees with it; it is refused rather than run differently from the
        reader it was published for."""
        if declared_causal is None:
            return
        causal = [kind == "sliding_attention" and not self.is_dflash2 for kind in self.layer_types]
        differing = [i for i, layer_causal in enumerate(causal) if layer_causal != bool(declared_causal)]
        if differing:
            kind = "causal" if declared_causal else "bidirectional"
            raise ValueError(
                f"this drafter config makes every layer {kind} (is_causal or dflash_config.causal: {declared_causal}), "
                f"but hf-dflash runs sliding layers causal and full layers bidirectional, so layers {differing} "
                f"({', '.join(sorted({self.layer_types[i] for i in differing}))}) would compute differently here; "
                "this drafter is not supported"
            )

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """`PreTrainedConfig.from_dict`, which from_pretrained calls with a config.json's dict, after the checks of the
        file's layout (dflash_layouts.py): a config of no drafter layout, or one its layout's reader would run
        differently from us, is refused here as `hf-dflash convert` and `hf-dflash info` refuse it."""
        detect_layout(config_dict).check_file(config_dict)
        return super().from_dict(config_dict, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, **kwargs: Any) -> Any:
        """`PreTrainedConfig.from_pretrained`, plus: a published drafter's config is still found when the Hub is out of
        reach and nothing is cached (see `published_configs`). That gives the config only, never the weights."""
        try:
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        except OSError:
            fields = cls.published_configs.get(str(pretrained_model_name_or_path))
            if fields is None:
                raise
        logger.warning(
            f"{pretrained_model_name_or_path} is not reachable or cached here; using its published config from "
            "hf-dflash's hub_configs (config only: its weights are not on this machine)"
        )
        config = cls.from_dict(fields)
        return (config, {}) if kwargs.get("return_unused_kwargs") else config

    @property
    def num_context_features(self) -> int:
        """Width of one context row: the captured target layers concatenated."""
        if not self.target_layer_ids:
            raise ValueError("this DFlash config names no target_layer_ids; pass them or num_target_layers")
        return len(self.target_layer_ids) * self.target_hidden_size

    @classmethod
    def for_target(
        cls,
        target_config: PreTrainedConfig,
        num_hidden_layers: int = 1,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: list[int] | None = None,
        tokenizer_size: int | None = None,
        **overrides: Any,
    ) -> "DFlashConfig":
        """A fresh drafter config shaped for `target_config` (any Hugging Face causal LM).

        The drafter copies the target's attention shape, norms and RoPE. The mask token must be a row of the target's
        embedding that real text never uses: pass `mask_token_id`, or pass `tokenizer_size` (`len(tokenizer)`) when
        the embedding has spare rows past the tokenizer, and the first spare row is taken.
        """
        text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        num_target_layers = text.num_hidden_layers
        vocab_size = text.vocab_size
        if mask_token_id is None:
            if tokenizer_size is not None and tokenizer_size < vocab_size:
                mask_token_id = tokenizer_size
            else:
                raise ValueError(
                    f"pick a mask token: the target's embedding has {vocab_size} rows"
                    + (f" and its tokenizer uses all of them ({tokenizer_size})" if tokenizer_size else "")
                    + "; pass mask_token_id=<an id real text never uses, such as an unused reserved special token>"
                    + ("" if tokenizer_size else ", or tokenizer_size=len(tokenizer) to take the first spare row")
                )
        num_heads = text.num_attention_heads
        fields: dict[str, Any] = dict(
            hidden_size=text.hidden_size,
            intermediate_size=getattr(text, "intermediate_size", 4 * text.hidden_size),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // num_heads,
            hidden_act=getattr(text, "hidden_act", "silu"),
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            max_position_embeddings=getattr(text, "max_position_embeddings", 4096),
            rope_parameters=target_rope(text),
            vocab_size=vocab_size,
            target_hidden_size=text.hidden_size,
            num_target_layers=num_target_layers,
            target_layer_ids=target_layer_ids
            if target_layer_ids is not None
            else default_target_layer_ids(num_target_layers, num_hidden_layers),
            block_size=block_size,
            mask_token_id=mask_token_id,
        )
        fields.update(overrides)
        return cls(**fields)


def rope_per_layer_type(rope: Mapping[str, Any]) -> bool:
    """Whether `rope_parameters` holds one RoPE per layer type (Gemma 3, OLMo 3:
    {"sliding_attention": {...}, "full_attention": {...}}) rather than one for every layer."""
    return bool(rope) and all(isinstance(value, Mapping) for value in rope.values())


def target_rope(text: PreTrainedConfig) -> dict[str, Any] | None:
    """The RoPE a drafter for this target copies: the target's `rope_parameters`, or where it keeps one per layer type
    its full-attention layers' one, as a drafter's layers are full attention unless it names sliding ones, and
    applies one RoPE to all of them."""
    rope = getattr(text, "rope_parameters", None)
    if not rope:
        return None
    return dict(rope["full_attention"]) if rope_per_layer_type(rope) else dict(rope)


# save_pretrained copies this bundle next to the weights and writes `auto_map`, so AutoConfig/AutoModel find it.
DFlashConfig.register_for_auto_class()

__all__ = ["DFLASH_DEFAULTS", "FIELD_RULES", "MAX_BLOCK_SIZE", "DFlashConfig", "FieldRule", "default_target_layer_ids"]
