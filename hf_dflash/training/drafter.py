"""A drafter to train: a fresh one shaped for a target (weights from scratch or from the target's layers), or a
trained one grown deeper without changing what it computes."""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig, PreTrainedModel

from ..modeling import DFlashConfig, DFlashDraftModel
from ..modeling.dflash_capture import decoder_layers
from ..modeling.dflash_layouts import DFLASH2_DEFAULTS
from ..modeling.modeling_dflash2 import DFlash2DraftModel, DFlash2Settings

# The drafter architectures `train` builds (`--arch`): the model class and the config fields it adds.
ARCHITECTURES: dict[str, tuple[type[DFlashDraftModel], dict]] = {
    "dflash": (DFlashDraftModel, {}),
    "dflash2": (DFlash2DraftModel, DFLASH2_DEFAULTS),
}
# The block size of a new drafter of each architecture, as published: DFlash's drafters draft 15 tokens a step,
# DFlash2's 7 (z-lab's Qwen3.8-27B-DFlash2, and speculators' and SpecForge's DFlash2 training default).
DEFAULT_BLOCK_SIZES = {"dflash": 16, "dflash2": 8}


def new_drafter(
    target: PreTrainedModel,
    num_layers: int = 1,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    tokenizer_size: int | None = None,
    target_layer_ids: list[int] | None = None,
    init_from_target: bool = False,
    arch: str = "dflash",
) -> DFlashDraftModel:
    """A randomly initialised drafter shaped for `target` (float32, on CPU; call `torch.manual_seed` first).

    arch: "dflash", or "dflash2" for a `DFlash2DraftModel` with the published DFlash2 fields (`DFLASH2_DEFAULTS`),
    which starts out computing what its DFlash backbone computes (identity convolutions, a silent selector).
    block_size: default `DEFAULT_BLOCK_SIZES[arch]`.
    `init_from_target` copies decoder layer i of the target into drafter layer i wherever a tensor of the same name
    and shape exists (attention, MLP, norms), and the target's final norm into the drafter's; `fc` stays random.
    """
    config = new_drafter_config(target.config, arch, num_layers, block_size, mask_token_id, tokenizer_size,
                                target_layer_ids)
    drafter = ARCHITECTURES[arch][0](config)
    if init_from_target:
        copy_target_layers(target, drafter)
    return drafter


def new_drafter_config(
    target_config: PreTrainedConfig,
    arch: str = "dflash",
    num_layers: int = 1,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    tokenizer_size: int | None = None,
    target_layer_ids: list[int] | None = None,
) -> DFlashConfig:
    """The config of `new_drafter` (see there), checked as the drafter's class will check it."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown drafter architecture {arch!r}; pick one of {', '.join(ARCHITECTURES)}")
    model_class, fields = ARCHITECTURES[arch]
    config = DFlashConfig.for_target(
        target_config,
        num_hidden_layers=num_layers,
        block_size=block_size or DEFAULT_BLOCK_SIZES[arch],
        mask_token_id=mask_token_id,
        tokenizer_size=tokenizer_size,
        target_layer_ids=target_layer_ids,
        **fields,
    )
    if model_class is DFlash2DraftModel:
        DFlash2Settings.from_config(config)  # a group size that does not divide the target's width, say
    return config


@torch.no_grad()
def copy_target_layers(target: PreTrainedModel, drafter: DFlashDraftModel) -> list[str]:
    """Copy target layer i's tensors into drafter layer i where names and shapes match; returns what was copied."""
    copied = []
    # The final norm feeds the same lm_head in both models: the target's norm weight is the natural start.
    final_norm = getattr(target.get_decoder(), "norm", None)
    if final_norm is not None and final_norm.weight.shape == drafter.norm.weight.shape:
        drafter.norm.weight.copy_(final_norm.weight)
        copied.append("norm.weight")
    for i, (source, layer) in enumerate(zip(decoder_layers(target), drafter.layers)):
        source_tensors = source.state_dict()
        for name, tensor in layer.state_dict().items():
            if name in source_tensors and source_tensors[name].shape == tensor.shape:
                tensor.copy_(source_tensors[name])
                copied.append(f"layers.{i}.{name}")
    return copied


@torch.no_grad()
def grow_drafter(drafter: DFlashDraftModel, num_layers: int) -> DFlashDraftModel:
    """Append decoder layers to `drafter` (in place) until it has `num_layers`; returns it.

    Each new layer starts as a copy of the last layer with its attention output projection and MLP down projection
    set to zero, so both its residual branches add exactly zero and the grown drafter computes what the old one did,
    bit for bit (x + 0 is x; the final norm still reads the same residual stream). The branches still learn: the
    zeroed matrices get a gradient at the first step (their inputs are not zero), the rest of the layer once they
    are no longer zero. A new layer has the last layer's attention type. A DFlash2 layer's convolution after each
    branch maps its zero output to zero, so the same holds there.
    """
    config = drafter.config
    depth = config.num_hidden_layers
    if num_layers < depth:
        raise ValueError(
            f"the drafter has {depth} layers; it can grow to {depth} or more, not shrink to {num_layers}"
        )
    last = drafter.layers[-1]
    config.layer_types = [*config.layer_types, *[config.layer_types[-1]] * (num_layers - depth)]
    config.num_hidden_layers = num_layers
    for index in range(depth, num_layers):
        # Built from the shared config (not deep-copied from `last`), so the attention implementation stays the
        # model's and `layer_idx` addresses this layer's own cache slot.
        layer = drafter.decoder_layer_class(config, index).to(last.mlp.down_proj.weight)
        layer.load_state_dict(last.state_dict())
        for branch_out in (layer.self_attn.o_proj, layer.mlp.down_proj):
            branch_out.weight.zero_()
            if branch_out.bias is not None:
                branch_out.bias.zero_()
        drafter.layers.append(layer)
    return drafter


def upgrade_to_dflash2(drafter: DFlashDraftModel) -> DFlash2DraftModel:
    """A DFlash2 drafter (the published DFlash2 fields, `drafter`'s block and layers) that starts out drafting exactly
    what the DFlash `drafter` drafts: its weights copied, each convolution the identity and the candidate selector
    silent (a new DFlash2 drafter's initialisation), so training it adds DFlash2's parts to a trained backbone."""
    if drafter.config.is_dflash2:
        raise ValueError("the drafter is a DFlash2 drafter already")
    fields = drafter.config.to_dict()
    fields.update(DFLASH2_DEFAULTS)
    config = DFlashConfig(**{**fields, "architectures": [DFlash2DraftModel.__name__]})
    upgraded = DFlash2DraftModel(config).to(drafter.fc.weight)
    missing, unexpected = upgraded.load_state_dict(drafter.state_dict(), strict=False)
    new_parts = ("_conv.", "candidate_selector.")
    if unexpected or any(not any(part in name for part in new_parts) for name in missing):
        raise RuntimeError(f"upgrading to DFlash2 left weights unmatched: {unexpected or missing}; please report it")
    return upgraded


__all__ = [
    "ARCHITECTURES",
    "DEFAULT_BLOCK_SIZES",
    "copy_target_layers",
    "grow_drafter",
    "new_drafter",
    "new_drafter_config",
    "upgrade_to_dflash2",
]
