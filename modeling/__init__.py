"""The DFlash remote-code bundle: the drafter and its runtime, saved next to every drafter's weights.

Every file here imports only torch, transformers and its sibling files, so `AutoModel.from_pretrained(dir,
trust_remote_code=True)` works without hf_dflash installed. The library imports this package as `hf_dflash.modeling`.
"""

from .configuration_dflash import DFlashConfig, default_target_layer_ids
from .dflash_decoding import DFlashGenerateOutput
from .dflash_devices import place_drafter
from .dflash_engine import DflashProposerState
from .dflash_paged_cache import PAGE_SIZE, PagedDrafterCache
from .dflash_proposer import DFlashProposer
from .modeling_dflash import DFlashDraftModel

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashGenerateOutput",
    "DFlashProposer",
    "DflashProposerState",
    "PAGE_SIZE",
    "PagedDrafterCache",
    "default_target_layer_ids",
    "place_drafter",
]
