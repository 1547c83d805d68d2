"""hf-dflash: DFlash block-diffusion speculative decoding for Hugging Face transformers.

    drafter = hf_dflash.DFlashDraftModel.from_pretrained(path)
    target.generate(**inputs, assistant_model=drafter)   # lossless, faster

Terms used throughout:
- block size B: tokens per drafted block; the block is [anchor, mask x (B - 1)].
- anchor: the last committed token, block row 0 (its row only echoes it and is discarded).
- mask rows: rows 1..B-1, filled with the embedding of `mask_token_id`; row k predicts the token at anchor + k.
- context rows: the target's hidden states at `target_layer_ids`, one row per committed position before the anchor.
- tau (acceptance length): tokens committed per verify step = accepted drafts + 1 (the bonus token).

The drafter and its runtime live in `hf_dflash.modeling`, which is also the remote-code bundle saved with every
drafter. Importing either makes `generate(assistant_model=<DFlash drafter>)` take the DFlash path.
"""

from .hub import register_published_configs
from .modeling import *  # noqa: F403 (the bundle's public names are the library's)
from .modeling import __all__

# Published drafters' configs answer DFlashConfig.from_pretrained(repo_id) even offline (see hub.py).
register_published_configs()

__version__ = "0.1.0"
