"""A drafter to train: a fresh one shaped for a target (weights from scratch or from the target's layers), or a
trained one grown deeper without changing what it computes."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..modeling import DFlashConfig, DFlashDraftModel
from ..modeling.dflash_capture import decoder_layers
from ..modeling.modeling_dflash import DFlashDecoderLayer


def new_drafter(
    target: PreTrainedModel,
    num_layers: int = 1,
    block_size: int = 16,
    mask_token_id: int | None = None,
    tokenizer_size: int | None = None,
    target_layer_ids: list[int] | None = None,
    init_from_target: bool = False,
) -> DFlashDraftModel:
    """A randomly initialised drafter shaped for `target` (float32, on CPU; call `torch.manual_seed` first).

    `init_from_target` copies decoder layer i of the target into drafter layer i wherever a tensor of the same name
    and shape exists (attention, MLP, norms), and the target's final norm into the drafter's; `fc` stays random.
    """
    config = DFlashConfig.for_target(
        target.config,
        num_hidden_layers=num_layers,
        block_size=block_size,
        mask_token_id=mask_token_id,
        tokenizer_size=tokenizer_size,
        target_layer_ids=target_layer_ids,
    )
    drafter = DFlashDraftModel(config)
    if init_from_target:
        copy_target_layers(target, drafter)
    return drafter


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
    are no longer zero. A new layer has the last layer's attention type.
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
        layer = DFlashDecoderLayer(config, index).to(last.mlp.down_proj.weight)
        layer.load_state_dict(last.state_dict())
        for branch_out in (layer.self_attn.o_proj, layer.mlp.down_proj):
            branch_out.weight.zero_()
            if branch_out.bias is not None:
                branch_out.bias.zero_()
        drafter.layers.append(layer)
    return drafter


__all__ = ["copy_target_layers", "grow_drafter", "new_drafter"]
