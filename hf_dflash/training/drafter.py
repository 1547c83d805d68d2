"""A fresh drafter for a target: config from the target's shape, weights from scratch or from the target's layers."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..modeling import DFlashConfig, DFlashDraftModel
from ..modeling.dflash_capture import decoder_layers


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


__all__ = ["copy_target_layers", "new_drafter"]
