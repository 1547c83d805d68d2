"""The DFlash drafter: Qwen3-style decoder layers that denoise a whole block of tokens in one forward.

Shapes: b = batch, q = block rows (B), c = context rows, H = hidden size, h = heads, g = key/value heads, d = head
dim. The context (captured target hidden states) never enters the residual stream: in every layer its rows only
contribute keys and values, next to the block rows' own. Attention is not causal: block rows see all context and
each other. Sliding-window layers (`layer_types`, as in the published Qwen3.5/3.6 drafters) are the exception: a
block row there sees the `sliding_window` positions up to its own, causally, also inside the block, which is how
z-lab's reference and vLLM run those drafters (benchmarks/families.md); the runtime builds that mask.

Two ways in:
- `forward(noise_embeds, context_hidden_states, position_ids, attention_mask, cache)`: transformers' native DFlash
  call (`generate(..., speculation_type="dflash")`), where the new context rows arrive with each call and a
  `DynamicCache` keeps everyone's keys and values.
- `context_key_values(context_hidden_states, position_ids)` + `forward(noise_embeds, position_ids, cache=paged)`: our
  runtime, where context keys/values are computed once per row and kept in a paged cache (dflash_paged_cache.py)
  whose adapter speaks the Cache API the attention below needs.

This file is part of the remote-code bundle: it imports only torch, transformers (and safetensors, which transformers
requires) and its sibling files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import GenerationConfig, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutput
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import cached_file
from transformers.utils.hub import hf_api

from .configuration_dflash import DFlashConfig
from .dflash_acceptance import DecodingRule, Proposal
from .dflash_compat import attention_implementation, upload_folder
from .dflash_dispatch import install_continuous_batching_dispatch, install_generate_dispatch
from .dflash_draft_vocabulary import (
    DRAFT_VOCAB_FILE,
    checked_draft_vocabulary,
    draft_vocabulary_from_maps,
    draft_vocabulary_maps,
)
from .dflash_layouts import SpeculatorsLayout, loading_key_mapping
from .dflash_model_card import model_card


class DFlashRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DFlashRotaryEmbedding(nn.Module):
    """cos/sin tables at arbitrary absolute positions (context rows keep the position they were inserted at)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        rope = config.rope_parameters or {"rope_type": "default", "rope_theta": config.default_theta}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            base = rope["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim))
            self.attention_scaling = 1.0
        else:
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, like: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, t) positions -> the (b, t, d) tables `apply_rotary` takes: cos, and sin with its first half negated.
        Computed in float32 then cast like the activations."""
        freqs = position_ids[..., None].to(torch.float32) * self.inv_freq.to(position_ids.device)  # (b, t, d / 2)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:  # a multiply by 1 would be one more kernel per table for the same values
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return torch.cat((cos, cos), dim=-1).to(like.dtype), torch.cat((-sin, sin), dim=-1).to(like.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] for x = [x1, x2]. With the
    sign on the table (signed_sin = [-sin, sin], from `DFlashRotaryEmbedding`) the rotation is a roll, [x2, x1]:
    one kernel where negating and concatenating halves takes two, and the same values bit for bit (a sign is exact).
    x (b, heads, t, d); cos / signed_sin (b, t, d)."""
    cos, signed_sin = cos.unsqueeze(1), signed_sin.unsqueeze(1)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention; `attention_mask` is boolean (True = may attend), broadcastable to (b, h, q, k)."""
    groups = module.num_key_value_groups
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights.masked_fill(~attention_mask, torch.finfo(weights.dtype).min)
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()  # (b, q, h, d)
    return out, weights


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DFlashAttention(nn.Module):
    """Queries from the block rows; keys and values from [context rows ; block rows]; not causal (sliding layers
    take their causal window from the mask they are given)."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def key_values(
        self, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of `rows` (b, t, H) -> two (b, g, t, d) tensors."""
        shape = (*rows.shape[:-1], -1, self.head_dim)
        key = self.k_norm(self.k_proj(rows).view(shape)).transpose(1, 2)
        value = self.v_proj(rows).view(shape).transpose(1, 2)
        return apply_rotary(key, cos, sin), value

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        context_features: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any | None = None,
    ) -> torch.Tensor:
        # hidden_states (b, q, H) block rows; context_features (b, c, H) or None when the cache already holds them;
        # position_embeddings cover [context rows ; block rows].
        cos, sin = position_embeddings
        num_rows = hidden_states.shape[1]
        query = self.q_proj(hidden_states).view(*hidden_states.shape[:-1], -1, self.head_dim)
        query = apply_rotary(self.q_norm(query).transpose(1, 2), cos[:, -num_rows:], sin[:, -num_rows:])
        kv_rows = hidden_states if context_features is None else torch.cat([context_features, hidden_states], dim=1)
        key, value = self.key_values(kv_rows, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        implementation = attention_implementation(self.config)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        out, _ = attention(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.config.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            is_causal=False,
        )
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        context_features: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any | None = None,
    ) -> torch.Tensor:
        # The input norm applies to the block rows only: context rows were normed once, by `hidden_norm`.
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, context_features, attention_mask, cache
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# from_pretrained options that say where a drafter's files are, passed on to find its draft-vocabulary file.
FILE_LOOKUP_OPTIONS = ("cache_dir", "force_download", "proxies", "token", "revision", "local_files_only", "subfolder")


def _pickle_refusal(source: Any) -> str:
    return (
        f"{source} has no safetensors weights, only pickled ones (pytorch_model.bin), which can run code while they "
        "are read. Convert them to safetensors, or if you trust their source pass allow_pickle=True to "
        "DFlashDraftModel.from_pretrained (they are then read with torch.load(weights_only=True))"
    )


def _choose_weight_format(source: Any, allow_pickle: bool, kwargs: dict[str, Any]) -> None:
    """Make transformers read safetensors only, or with `allow_pickle` pickles through weights_only=True (edits kwargs).

    A local folder is checked here, so its refusal names the opt-in; a Hub repo's comes from the OSError transformers
    raises when asked for safetensors it does not have."""
    if allow_pickle:
        if kwargs.get("weights_only") is False:
            raise ValueError("allow_pickle=True reads pickles with torch.load(weights_only=True) only; drop weights_only=False")
        kwargs["weights_only"] = True
        return
    if kwargs.get("use_safetensors") is False:
        raise ValueError(
            "use_safetensors=False asks for pickled weights, which can run code while they are read; if you trust "
            "their source pass allow_pickle=True (they are then read with torch.load(weights_only=True))"
        )
    kwargs["use_safetensors"] = True
    folder = Path(source) / kwargs.get("subfolder", "")
    if folder.is_dir() and not any(folder.glob("*.safetensors*")) and any((folder / n).is_file() for n in PICKLED_WEIGHTS):
        raise ValueError(_pickle_refusal(source))


def _read_draft_vocabulary(source: Any, config: DFlashConfig, kwargs: dict[str, Any]) -> torch.LongTensor:
    """The draft vocabulary of the drafter at `source` (folder or Hub id), whose config records draft_vocab_size."""
    options = {name: kwargs[name] for name in FILE_LOOKUP_OPTIONS if name in kwargs}
    path = cached_file(source, DRAFT_VOCAB_FILE, _raise_exceptions_for_missing_entries=False, **options)
    if path is None:
        raise ValueError(
            f"the config of {source} records draft_vocab_size {config.draft_vocab_size} but {DRAFT_VOCAB_FILE} is not "
            "beside its weights; copy that file there, or delete draft_vocab_size from config.json to draft over the "
            "full vocabulary"
        )
    return draft_vocabulary_from_maps(load_file(path), config.vocab_size, config.draft_vocab_size, path)


def _names_dflash2(source: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the drafter at `source` (folder or Hub id; `config=` when given) is a DFlash2 one. A config that
    cannot be read here answers False: the load itself then fails with its own message."""
    config = kwargs.get("config")
    if not isinstance(config, DFlashConfig):
        options = {name: kwargs[name] for name in FILE_LOOKUP_OPTIONS if name in kwargs}
        try:
            config = DFlashConfig.from_pretrained(source, **options)
        except Exception:
            return False
    return config.is_dflash2


class DFlashPreTrainedModel(PreTrainedModel):
    config_class = DFlashConfig
    config: DFlashConfig
    base_model_prefix = "dflash"
    main_input_name = "noise_embeds"
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(mean=0.0, std=std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, DFlashRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, DFlashRotaryEmbedding):
            module.inv_freq.copy_(DFlashRotaryEmbedding(self.config).inv_freq)


class DFlashDraftModel(DFlashPreTrainedModel):
    """A DFlash drafter. Pass it as `assistant_model=` to any causal LM's `generate` for lossless speculative decoding.

    Weights (no prefix): fc [H, k*H_target], hidden_norm, layers.{i}.*, norm. No embedding, no lm_head.

    `draft_vocabulary`: the sorted target ids ((K,) int64) the drafter drafts over, or None for the full vocabulary
    (`set_draft_vocabulary`; saved beside the weights as `draft_vocab.safetensors`, dflash_draft_vocabulary.py).
    """

    # The layer a subclass swaps in (DFlash2's wraps attention and the MLP in convolutions), built once in __init__.
    decoder_layer_class: type[nn.Module] = DFlashDecoderLayer
    # Whether a sliding layer's block rows see only the rows up to their own (DFlash) or each other both ways
    # within the window (DFlash2); the runtime builds the masks (dflash_masks.in_window).
    causal_sliding_window: bool = True

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.fc = nn.Linear(config.num_context_features, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config)
        # Filled by from_pretrained when the folder has one, or by set_draft_vocabulary; not a weight (its own file).
        self.draft_vocabulary: torch.LongTensor | None = None
        self.post_init()

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: Any, *args: Any, allow_pickle: bool = False, **kwargs: Any
    ) -> "DFlashDraftModel":
        """Load any published layout (z-lab, transformers-native, ours). Every tensor in the file must be consumed
        and every parameter filled: a missing, unexpected or mis-shaped tensor is an error, not a warning.

        Weights load from safetensors only. A pickled `pytorch_model.bin` can run code while it is read, so it is
        refused unless `allow_pickle=True`, and then read with `torch.load(weights_only=True)`.

        `DFlashDraftModel.from_pretrained` of a DFlash2 drafter returns a `DFlash2DraftModel`."""
        if cls is DFlashDraftModel and _names_dflash2(pretrained_model_name_or_path, kwargs):
            from .modeling_dflash2 import DFlash2DraftModel  # imported here: modeling_dflash2 imports this file

            return DFlash2DraftModel.from_pretrained(
                pretrained_model_name_or_path, *args, allow_pickle=allow_pickle, **kwargs
            )
        wants_info = kwargs.pop("output_loading_info", False)
        kwargs.setdefault("key_mapping", loading_key_mapping())  # the layouts' names of fc and hidden_norm
        _choose_weight_format(pretrained_model_name_or_path, allow_pickle, kwargs)
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs
            )
        except SafetensorError as error:
            raise ValueError(
                f"a safetensors file of {pretrained_model_name_or_path} is truncated or corrupted ({error}); download "
                "it again (from_pretrained(..., force_download=True)) or save the drafter again"
            ) from error
        except OSError as error:
            # A published drafter's Hub id failing here means its weights are not reachable (offline, not cached).
            if str(pretrained_model_name_or_path) not in DFlashConfig.published_configs:
                if not allow_pickle and "does not appear to have a file named" in str(error):
                    raise OSError(_pickle_refusal(pretrained_model_name_or_path)) from error
                raise
            raise OSError(
                f"the weights of {pretrained_model_name_or_path} are not on this machine and the Hub is out of reach "
                "(offline, or no network). Its published config is known: DFlashConfig.from_pretrained("
                f"{str(pretrained_model_name_or_path)!r}) returns it, and DFlashDraftModel(config) under "
                "`torch.device('meta')` gives a weightless model of the right shape. For the weights, download them "
                f"where the Hub is reachable (`hf download {pretrained_model_name_or_path}`) and copy the cache here."
            ) from error
        problems = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
        # A copy of the target's embedding or draft-vocabulary maps beside the drafter: a checkpoint to convert first.
        if SpeculatorsLayout.detects_tensors(set(problems.get("unexpected_keys", []))):
            raise ValueError(
                f"{pretrained_model_name_or_path} holds an embedding copy or draft-vocabulary maps (d2t/t2d): it is a "
                "vLLM speculators checkpoint; convert it first: `hf-dflash convert SRC OUT --to ours`"
            )
        if problems or info.get("error_msgs"):
            raise ValueError(
                f"{pretrained_model_name_or_path} does not match the DFlash drafter its config describes: "
                f"{problems or info['error_msgs']}. Check that the config (layers, hidden size, target_layer_ids) "
                "belongs to these weights."
            )
        if model.config.draft_vocab_size is not None:
            model.draft_vocabulary = _read_draft_vocabulary(pretrained_model_name_or_path, model.config, kwargs)
        return (model, info) if wants_info else model

    def set_draft_vocabulary(self, token_ids: torch.Tensor | list[int] | None) -> None:
        """Draft over these target token ids only (any order, each once), or over the full vocabulary again (None).

        Drafting then computes logits for those lm_head rows only and never proposes another token; the target still
        verifies every draft, so the output is unchanged (greedy identical, sampling target-distributed) and only
        acceptance can drop, when the target picks a token outside the set. The mask token need not be included (it
        is the drafter's input, never a draft). `save_pretrained` writes it beside the weights, `from_pretrained`
        reads it back, and `hf-dflash convert --to speculators` writes it as vLLM's d2t/t2d maps."""
        self._dflash_draft_head = None  # the head copied for the old vocabulary (dflash_proposer.py)
        if token_ids is None:
            self.draft_vocabulary = None
            self.config.draft_vocab_size = None
            return
        self.draft_vocabulary = checked_draft_vocabulary(token_ids, self.config.vocab_size)
        self.config.draft_vocab_size = len(self.draft_vocabulary)

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *args: Any,
        repo_id: str | None = None,
        target_model: str | None = None,
        tau: float | None = None,
        **kwargs: Any,
    ) -> None:
        """transformers' save_pretrained (safetensors weights, config with `auto_map`, this remote-code bundle), plus
        a model card (README.md), a `generation_config.json`, and the trainer's `training_args.json` when the drafter
        was loaded from a folder that has one.

        repo_id: where the drafter will live (shown in the card's example); target_model: the target's Hub id when
        the config does not record it (`config.target_model`); tau: acceptance length you measured, for the card.
        """
        if self.draft_vocabulary is None and self.config.draft_vocab_size is not None:
            raise ValueError(
                f"the config records draft_vocab_size {self.config.draft_vocab_size} but the drafter holds no draft "
                "vocabulary; give it one (drafter.set_draft_vocabulary(ids)) or none "
                "(drafter.set_draft_vocabulary(None))"
            )
        super().save_pretrained(save_directory, *args, **kwargs)
        if not kwargs.get("is_main_process", True):
            return
        out = Path(save_directory)
        # transformers copies this file and what it imports; the rest of the bundle (DFlash2's model, imported only
        # when a DFlash2 config asks for it) is copied too, so every saved drafter carries the whole runtime.
        for module in Path(__file__).parent.glob("*.py"):
            if module.name != "__init__.py" and not (out / module.name).exists():
                shutil.copyfile(module, out / module.name)
        if self.draft_vocabulary is None:
            (out / DRAFT_VOCAB_FILE).unlink(missing_ok=True)  # an older save's, which would no longer match
        else:
            maps = draft_vocabulary_maps(self.draft_vocabulary, self.config.vocab_size)
            save_file(maps, str(out / DRAFT_VOCAB_FILE), metadata={"format": "pt"})
        source = Path(str(self.name_or_path))
        training_args = None
        if (source / "training_args.json").is_file():
            training_args = json.loads((source / "training_args.json").read_text())
            if source.resolve() != out.resolve():
                (out / "training_args.json").write_text(json.dumps(training_args, indent=2))
        card = model_card(
            self.config,
            num_parameters=sum(p.numel() for p in self.parameters()),
            repo_id=repo_id,
            target_model=target_model,
            tau=tau,
            training_args=training_args,
        )
        (out / "README.md").write_text(card)
        # transformers' assisted decoding reads num_assistant_tokens from the assistant's generation config; for a
        # DFlash drafter that is the number of drafts per block.
        drafts = self.config.block_size - 1
        GenerationConfig(num_assistant_tokens=drafts, num_assistant_tokens_schedule="constant").save_pretrained(out)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        target_model: str | None = None,
        tau: float | None = None,
        commit_message: str | None = None,
        commit_description: str | None = None,
        private: bool | None = None,
        token: bool | str | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        max_shard_size: int | str | None = "50GB",
    ) -> Any:
        """Publish the drafter: exactly the folder `save_pretrained` writes (weights, config with `auto_map`, the
        remote-code bundle, README.md model card, generation_config.json, training_args.json when known), in one
        commit. transformers' own push_to_hub would replace our model card with a generic one, hence this override.
        Returns the commit info."""
        repo_id = hf_api().create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(
                folder, max_shard_size=max_shard_size, repo_id=repo_id, target_model=target_model, tau=tau
            )
            return upload_folder(
                self,
                folder,
                repo_id,
                commit_message=commit_message or "Upload DFlash drafter",
                token=token,
                create_pr=create_pr,
                revision=revision,
                commit_description=commit_description,
            )

    def propose(
        self,
        hidden: torch.Tensor,
        anchor_ids: torch.LongTensor,
        head: Callable[[torch.Tensor], torch.Tensor],
        rule: DecodingRule,
    ) -> Proposal:
        """Drafts for block rows 1..B-1 from the drafter's output there: the argmax of each row's logits, or under
        rejection sampling a sample of each row's softmax at the rule's temperature (rows are independent here; a
        drafter whose rows depend on the drafts before them overrides this).

        hidden (b, B - 1, H) the final-norm rows; anchor_ids (b, 1) the tokens before them (unused here); head maps
        rows to the target vocabulary's logits (b, B - 1, V), -inf outside a draft vocabulary."""
        logits = head(hidden)
        drafts, probs = rule.propose(logits)
        if probs is None:
            confidence = torch.softmax(logits.float(), dim=-1).gather(-1, drafts[..., None])[..., 0]
        else:
            confidence = probs.gather(-1, drafts[..., None])[..., 0]
        return Proposal(drafts=drafts, probs=probs, confidence=confidence)

    def context_features(self, context_hidden_states: torch.Tensor) -> torch.Tensor:
        """(b, c, k*H_target) captured target rows -> (b, c, H) drafter features: fc, then hidden_norm."""
        return self.hidden_norm(self.fc(context_hidden_states.to(self.fc.weight.dtype)))

    def context_key_values(
        self, context_hidden_states: torch.Tensor, position_ids: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys/values of new context rows, rotated at their own absolute positions.

        Computed once per context row and kept; a row's keys never change afterwards.
        """
        features = self.context_features(context_hidden_states)
        cos, sin = self.rotary_emb(features, position_ids)
        return [layer.self_attn.key_values(features, cos, sin) for layer in self.layers]

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any | None = None,
        past_key_values: Any | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutput:
        r"""
        noise_embeds: (b, q, H) target embeddings of the block [anchor, mask x (q - 1)].
        context_hidden_states: (b, c, k*H_target) new context rows, or None when `cache` already holds every
            context row's keys/values (our paged cache).
        position_ids: (b, c + q) absolute positions of [new context rows ; block rows].
        attention_mask: 2D (b, kv_len) padding mask over everything the block attends to (1 = keep); or masks
            broadcastable to (b, heads, q, kv_len), one per layer type ({"full_attention": ...,
            "sliding_attention": ...}): boolean (True = keep), or additive floats under sdpa attention. None attends
            to all.
        cache / past_key_values: a transformers `Cache` (its `update` appends and returns all keys/values), or None.
        """
        cache = cache if cache is not None else past_key_values
        features = None if context_hidden_states is None else self.context_features(context_hidden_states)
        if position_ids is None:
            raise ValueError("DFlashDraftModel needs position_ids for the context and block rows")
        hidden_states = noise_embeds.to(self.fc.weight.dtype)
        position_embeddings = self.rotary_emb(hidden_states, position_ids.to(hidden_states.device))
        if not isinstance(attention_mask, dict):
            if "sliding_attention" in self.config.layer_types:
                raise NotImplementedError(
                    "sliding-window drafters need per-layer masks; use generate(assistant_model=drafter) without "
                    "speculation_type='dflash' (our runtime builds them)"
                )
            if attention_mask is not None and bool(attention_mask.all()):
                attention_mask = None
            elif attention_mask is not None:
                attention_mask = attention_mask.bool()[:, None, None, :]  # (b, 1, 1, kv_len) key padding
            attention_mask = {"full_attention": attention_mask}
        for layer, layer_type in zip(self.layers, self.config.layer_types):
            hidden_states = layer(hidden_states, position_embeddings, features, attention_mask[layer_type], cache)
        return BaseModelOutput(last_hidden_state=self.norm(hidden_states))


DFlashDraftModel.register_for_auto_class("AutoModel")
# Importing the drafter makes `target.generate(assistant_model=drafter)` take the DFlash path (dflash_dispatch.py).
install_generate_dispatch()
install_continuous_batching_dispatch()

__all__ = ["DFlashDraftModel", "DFlashPreTrainedModel"]
