"""DFlash2DraftModel against an independent reference written here from the published description, in float64:
the grouped dynamic causal convolutions around attention and the MLP, two-stream attention over context and block rows,
scaled soft-capped logits, and the candidate selector's walk (greedy against a brute-force search over every path;
rejection sampling's proposal rows, checked exactly and statistically)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch

from hf_dflash.modeling import PAGE_SIZE, DFlashConfig, DFlashDraftModel, PagedDrafterCache
from hf_dflash.modeling.dflash_acceptance import DecodingRule
from hf_dflash.modeling.dflash_layouts import DFLASH2_DEFAULTS
from hf_dflash.modeling.dflash_paged_cache import PagedView, page_slots
from hf_dflash.modeling.modeling_dflash2 import DFlash2DraftModel
from tests.test_sampling import chi_square_p_value

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = DecodingRule(do_sample=False, rejection=False)


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    group: int
    taps: int
    block: int
    vocab: int
    rank: int
    top_k: int
    layer_types: tuple[str, ...] = ()
    window: int | None = None
    multiplier: float = 1.0
    softcap: float | None = None
    input_scale: float = 1.0


SHAPES = {
    # GQA, block 8, two layers, every scaling on
    "gqa_b8": Shape(64, 4, 2, 16, 2, 16, 2, 8, 50, 8, 5, multiplier=0.7, softcap=3.0, input_scale=1.3),
    # MHA, block 16, one channel per group, three taps
    "mha_b16_depthwise": Shape(48, 3, 3, 16, 1, 1, 3, 16, 40, 4, 8),
    # one key/value head, a single group spanning all channels, sliding layers whose window cuts the context
    "mqa_sliding": Shape(32, 4, 1, 8, 2, 32, 2, 8, 30, 6, 4, ("sliding_attention",) * 2, window=6, softcap=5.0),
    # a sliding layer and a full one, block 16, four taps
    "mixed_b16": Shape(40, 2, 1, 20, 2, 8, 4, 16, 60, 5, 6, ("sliding_attention", "full_attention"), window=9,
                       multiplier=1.5),
}


def make_config(shape: Shape) -> DFlashConfig:
    return DFlashConfig(
        hidden_size=shape.hidden,
        intermediate_size=2 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab,
        num_target_layers=4,
        target_layer_ids=[0, 2],
        block_size=shape.block,
        mask_token_id=shape.vocab - 1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        layer_types=list(shape.layer_types) or None,
        sliding_window=shape.window,
        conv_kernel_size=shape.taps,
        conv_group_size=shape.group,
        selector_rank=shape.rank,
        selector_top_k=shape.top_k,
        output_multiplier=shape.multiplier,
        final_logit_softcapping=shape.softcap,
        input_embedding_scale=shape.input_scale,
    )


@torch.no_grad()
def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight random (a fresh drafter's identity convolutions and silent selector would hide mistakes)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator)
        if name.endswith("norm.weight"):
            param.copy_(1 + 0.2 * noise)
        elif name.endswith("base_kernel") or "kernel_projection" in name:  # a convolution keeps rows' scale
            param.copy_(0.4 * noise / math.sqrt(param.shape[-1] if "kernel_projection" in name else 1))
        elif name.endswith("codebook"):
            param.copy_(0.7 * noise)
        else:
            param.copy_(noise / math.sqrt(param.shape[-1]))
    return model.eval()


def make_model(shape: Shape, seed: int = 0) -> DFlash2DraftModel:
    return randomized(DFlash2DraftModel(make_config(shape)), seed)


# --------------------------------------------------------------------------------------------------
# The reference: the description in plain float64 loops, reading the weights by their published names
# --------------------------------------------------------------------------------------------------


class Reference:
    def __init__(self, model: DFlash2DraftModel, shape: Shape, lm_head: torch.Tensor):
        self.w = {k: v.detach().double() for k, v in model.state_dict().items()}
        self.s = shape
        self.lm_head = lm_head.double()
        self.eps = model.config.rms_norm_eps

    def rms(self, x, weight):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def rotate(self, x, position):  # x (..., d) at one absolute position
        d = x.shape[-1]
        inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.cat([position * inv_freq, position * inv_freq])
        half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
        return x * torch.cos(angles) + half * torch.sin(angles)

    def conv(self, rows, dynamic, base):
        """rows (n, H); dynamic (n, K, G); base (K, H): row t = sum_j (base[j] + dynamic[t, j] per group) * row t-j."""
        out = torch.zeros_like(rows)
        for t in range(rows.shape[0]):
            for j in range(self.s.taps):
                if t - j >= 0:
                    out[t] += (base[j] + dynamic[t, j].repeat_interleave(self.s.group)) * rows[t - j]
        return out

    def visible(self, layer_type, query_pos, key_pos):
        if layer_type == "sliding_attention":  # DFlash2: a symmetric window, block rows see each other both ways
            return abs(query_pos - key_pos) < self.s.window
        return True

    def attention(self, i, rows, context, row_pos, context_pos, layer_type):
        w, s = self.w, self.s
        p = f"layers.{i}.self_attn."
        kv_rows = torch.cat([context, rows])
        kv_pos = list(context_pos) + list(row_pos)
        q = (rows @ w[p + "q_proj.weight"].T).view(len(rows), s.heads, s.head_dim)
        k = (kv_rows @ w[p + "k_proj.weight"].T).view(len(kv_rows), s.kv_heads, s.head_dim)
        v = (kv_rows @ w[p + "v_proj.weight"].T).view(len(kv_rows), s.kv_heads, s.head_dim)
        q, k = self.rms(q, w[p + "q_norm.weight"]), self.rms(k, w[p + "k_norm.weight"])
        out = torch.zeros(len(rows), s.heads, s.head_dim, dtype=torch.float64)
        for r in range(len(rows)):
            for h in range(s.heads):
                g = h // (s.heads // s.kv_heads)
                qr = self.rotate(q[r, h], row_pos[r])
                keys = [j for j in range(len(kv_rows)) if self.visible(layer_type, row_pos[r], kv_pos[j])]
                logits = torch.stack([qr @ self.rotate(k[j, g], kv_pos[j]) for j in keys]) / math.sqrt(s.head_dim)
                weights = torch.softmax(logits, dim=0)
                out[r, h] = sum(weights[n] * v[j, g] for n, j in enumerate(keys))
        return out.view(len(rows), -1) @ w[p + "o_proj.weight"].T

    def mlp(self, i, x):
        p = f"layers.{i}.mlp."
        gate = x @ self.w[p + "gate_proj.weight"].T
        up = x @ self.w[p + "up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ self.w[p + "down_proj.weight"].T

    def wrapped(self, i, name, normed, sublayer):
        """conv_after(sublayer(conv_before(normed))), both kernels projected from `normed`."""
        p = f"layers.{i}.{name}."
        groups = self.s.hidden // self.s.group
        dynamic = (normed @ self.w[p + "kernel_projection.weight"].T).view(len(normed), 2, self.s.taps, groups)
        base = self.w[p + "base_kernel"]
        return self.conv(sublayer(self.conv(normed, dynamic[:, 0], base[0])), dynamic[:, 1], base[1])

    def hidden(self, noise, context_hidden, context_pos, row_pos):
        """noise (n, H) target embeddings of the block, context_hidden (c, k*H) -> final-norm rows (n, H)."""
        w = self.w
        context = self.rms(context_hidden.double() @ w["fc.weight"].T, w["hidden_norm.weight"])
        h = noise.double() * self.s.input_scale
        types = self.s.layer_types or ("full_attention",) * self.s.layers
        for i, layer_type in enumerate(types):
            normed = self.rms(h, w[f"layers.{i}.input_layernorm.weight"])
            h = h + self.wrapped(
                i, "attention_conv", normed, lambda x: self.attention(i, x, context, row_pos, context_pos, layer_type)
            )
            normed = self.rms(h, w[f"layers.{i}.post_attention_layernorm.weight"])
            h = h + self.wrapped(i, "mlp_conv", normed, lambda x: self.mlp(i, x))
        return self.rms(h, w["norm.weight"])

    def logits(self, hidden):
        scaled = hidden.double() @ self.lm_head.T * self.s.multiplier
        return scaled if self.s.softcap is None else torch.tanh(scaled / self.s.softcap) * self.s.softcap

    def score(self, hidden_row, unary_row, previous, candidate):
        """S(previous, candidate) at one row, straight from the published names."""
        w = self.w
        projected = w["candidate_selector.hidden_projection.weight"] @ hidden_row.double()
        bigram = (w["candidate_selector.predecessor_codebook"][previous] * projected) @ w[
            "candidate_selector.successor_codebook"
        ][candidate]
        return float(unary_row[candidate] + bigram)

    def candidates(self, unary_row):
        return sorted(range(len(unary_row)), key=lambda v: -float(unary_row[v]))[: self.s.top_k]

    def greedy_walk(self, hidden, anchor):
        """hidden (n, H) rows after the anchor -> the selector's drafts (n,)."""
        unary = self.logits(hidden)
        previous, path = anchor, []
        for i in range(len(hidden)):
            options = self.candidates(unary[i])
            previous = max(options, key=lambda c: self.score(hidden[i], unary[i], previous, c))
            path.append(previous)
        return path


def inputs(shape: Shape, batch: int, context_len: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch, shape.block, shape.hidden, generator=generator)
    context = torch.randn(batch, context_len, 2 * shape.hidden, generator=generator)
    lm_head = torch.randn(shape.vocab, shape.hidden, generator=generator) / math.sqrt(shape.hidden)
    return noise, context, lm_head


def layer_masks(shape: Shape, query_pos: torch.Tensor, key_pos: torch.Tensor, valid: torch.Tensor | None = None):
    """Per layer type, the boolean (b, 1, q, kv) masks of the reference's rule (None: all keys)."""
    full = None if valid is None else valid[:, None, None, :]
    window = (query_pos[:, :, None] - key_pos[:, None, :]).abs() < (shape.window or 0)
    if valid is not None:
        window &= valid[:, None, :]
    return {"full_attention": full, "sliding_attention": window[:, None]}


# --------------------------------------------------------------------------------------------------
# The forward
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHAPES)
def test_forward_with_context_equals_the_reference(name):
    shape = SHAPES[name]
    model = make_model(shape, seed=1)
    batch, context_len = 2, 11
    noise, context, lm_head = inputs(shape, batch, context_len, seed=2)
    positions = torch.arange(context_len + shape.block).expand(batch, -1)
    block_pos = positions[:, context_len:]
    with torch.no_grad():
        hidden = model(
            noise_embeds=noise,
            context_hidden_states=context,
            position_ids=positions,
            attention_mask=layer_masks(shape, block_pos, positions),
        ).last_hidden_state
    reference = Reference(model, shape, lm_head)
    for b in range(batch):
        block_positions = list(range(context_len, context_len + shape.block))
        expected = reference.hidden(noise[b], context[b], range(context_len), block_positions)
        assert (hidden[b].double() - expected).abs().max() <= 1e-5
        logits = model.unary_logits(hidden[b] @ lm_head.T)
        assert (logits.double() - reference.logits(expected)).abs().max() <= 1e-5


@pytest.mark.parametrize("name", SHAPES)
def test_paged_cache_path_equals_the_reference(name):
    """context_key_values into the paged cache, then forward(noise, position_ids, cache=view) through `PagedView`, as
    the engine's step drafts: a ragged batch of two sequences whose pages interleave in the pool (their block tables
    are not the identity), each row reading its own pages at positions 0..kv-1 under a mask that hides what it does
    not hold (slots filled with noise, so that a leak shows), each against the reference with its own context."""
    shape = SHAPES[name]
    model = make_model(shape, seed=3)
    lengths = [13, 7]
    noise, context, lm_head = inputs(shape, 2, max(lengths), seed=4)
    config = model.config
    kv = max(lengths) + shape.block
    pages = -(-kv // PAGE_SIZE)
    cache = PagedDrafterCache(config.num_hidden_layers, 2 * pages + 1, config.num_key_value_heads, config.head_dim,
                              torch.float32, "cpu")
    for pool in (*cache.key_pools, *cache.value_pools):
        pool.normal_(generator=torch.Generator().manual_seed(5))
    cache.take(1)  # another sequence's page comes first
    taken = [cache.take(1)[0] for _ in range(2 * pages)]
    tables = torch.tensor([taken[1::2], taken[0::2]])  # (2, pages): sequence 0 the odd pages taken, 1 the even
    with torch.no_grad():
        for b, n in enumerate(lengths):
            positions = torch.arange(n)[None]
            slots = page_slots(tables[b : b + 1], positions)
            for layer, (key, value) in enumerate(model.context_key_values(context[b : b + 1, :n], positions)):
                cache.write_rows(layer, slots, key, value)
        block_pos = torch.tensor(lengths)[:, None] + torch.arange(shape.block)
        key_pos = torch.arange(kv).expand(2, -1)
        view = PagedView(cache, page_slots(tables, block_pos), read_slots=page_slots(tables, key_pos))
        valid = key_pos < torch.tensor(lengths)[:, None] + shape.block
        hidden = model(
            noise_embeds=noise,
            position_ids=block_pos,
            attention_mask=layer_masks(shape, block_pos, key_pos, valid),
            cache=view,
        ).last_hidden_state
    reference = Reference(model, shape, lm_head)
    for b, n in enumerate(lengths):
        expected = reference.hidden(noise[b], context[b, :n], range(n), list(range(n, n + shape.block)))
        assert (hidden[b].double() - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["gqa_b8", "mha_b16_depthwise"])
def test_greedy_proposal_is_the_reference_walk(name):
    shape = SHAPES[name]
    model = make_model(shape, seed=5)
    noise, context, lm_head = inputs(shape, 3, 9, seed=6)
    anchors = torch.tensor([[3], [0], [shape.vocab - 2]])
    with torch.no_grad():
        hidden = model(noise_embeds=noise, context_hidden_states=context,
                       position_ids=torch.arange(9 + shape.block).expand(3, -1)).last_hidden_state[:, 1:]
        proposal = model.propose(hidden, anchors, lambda h: h @ lm_head.T, GREEDY)
    reference = Reference(model, shape, lm_head)
    for b in range(3):
        assert proposal.drafts[b].tolist() == reference.greedy_walk(hidden[b], int(anchors[b, 0]))
    assert proposal.probs is None
    assert bool(((proposal.confidence > 0) & (proposal.confidence <= 1)).all())


def test_blocks_end_to_end_do_not_convolve_across_each_other():
    """Training lays many blocks end to end in one forward: each block computes what it computes alone."""
    shape = SHAPES["gqa_b8"]
    model = make_model(shape, seed=7)
    generator = torch.Generator().manual_seed(8)
    context_len, blocks = 6, 3
    noise = torch.randn(1, blocks * shape.block, shape.hidden, generator=generator)
    context = torch.randn(1, context_len, 2 * shape.hidden, generator=generator)
    row_block = torch.arange(blocks * shape.block) // shape.block
    own_block = row_block[:, None] == row_block[None, :]
    mask = torch.cat([torch.ones(blocks * shape.block, context_len, dtype=torch.bool), own_block], dim=1)
    block_pos = context_len + torch.arange(shape.block).repeat(blocks)
    with torch.no_grad():
        together = model(noise_embeds=noise, context_hidden_states=context,
                         position_ids=torch.cat([torch.arange(context_len), block_pos])[None],
                         attention_mask={"full_attention": mask[None, None]}).last_hidden_state
        for i in range(blocks):
            rows = slice(i * shape.block, (i + 1) * shape.block)
            alone = model(noise_embeds=noise[:, rows], context_hidden_states=context,
                          position_ids=torch.arange(context_len + shape.block)[None]).last_hidden_state
            assert (together[:, rows] - alone).abs().max() <= 1e-5


def test_a_fresh_drafter_computes_what_its_dflash_backbone_computes():
    """The published starting point: identity convolutions and a silent selector, so the rows are DFlash's and the
    greedy drafts are each row's argmax."""
    config = make_config(SHAPES["gqa_b8"])
    torch.manual_seed(9)
    fresh = DFlash2DraftModel(config).eval()
    backbone = DFlashDraftModel(config).eval()
    missing, unexpected = backbone.load_state_dict(fresh.state_dict(), strict=False)
    assert not missing and all("conv" in k or "candidate_selector" in k for k in unexpected)
    noise, context, lm_head = inputs(SHAPES["gqa_b8"], 2, 5, seed=10)
    kwargs = dict(context_hidden_states=context, position_ids=torch.arange(5 + config.block_size).expand(2, -1))
    with torch.no_grad():
        rows = fresh(noise_embeds=noise, **kwargs).last_hidden_state
        expected = backbone(noise_embeds=noise * 1.3, **kwargs).last_hidden_state  # DFlash2 scales its block input
        proposal = fresh.propose(rows[:, 1:], torch.tensor([[1], [2]]), lambda h: h @ lm_head.T, GREEDY)
    torch.testing.assert_close(rows, expected, rtol=0, atol=1e-6)
    assert torch.equal(proposal.drafts, (rows[:, 1:] @ lm_head.T).argmax(-1))


# --------------------------------------------------------------------------------------------------
# The selector on tiny vocabularies: brute force over every path
# --------------------------------------------------------------------------------------------------

TINY = Shape(8, 2, 1, 4, 1, 4, 2, 4, 7, 3, 3, softcap=2.0, multiplier=0.8)


def tiny_case(seed: int, batch: int = 4):
    model = make_model(TINY, seed=seed)
    generator = torch.Generator().manual_seed(seed + 1000)
    hidden = torch.randn(batch, TINY.block - 1, TINY.hidden, generator=generator)
    lm_head = 2 * torch.randn(TINY.vocab, TINY.hidden, generator=generator)
    anchors = torch.randint(0, TINY.vocab, (batch, 1), generator=generator)
    return model, hidden, lm_head, anchors


def consistent_paths(reference: Reference, hidden: torch.Tensor, anchor: int) -> list[tuple[int, ...]]:
    """Every path (one token per row, over the whole vocabulary) whose every token is, among its row's top-k tokens,
    the best-scored after the token before it: what the selector's greedy walk computes, by definition."""
    unary = reference.logits(hidden)
    found = []
    for path in itertools.product(range(TINY.vocab), repeat=len(hidden)):
        previous, ok = anchor, True
        for i, token in enumerate(path):
            options = reference.candidates(unary[i])
            scores = {c: reference.score(hidden[i], unary[i], previous, c) for c in options}
            if token not in options or scores[token] < max(scores.values()):
                ok = False
                break
            previous = token
        if ok:
            found.append(path)
    return found


@pytest.mark.parametrize("seed", range(6))
def test_greedy_walk_is_the_one_consistent_path_of_a_brute_force_search(seed):
    model, hidden, lm_head, anchors = tiny_case(seed)
    reference = Reference(model, TINY, lm_head)
    with torch.no_grad():
        proposal = model.propose(hidden, anchors, lambda h: h @ lm_head.T, GREEDY)
    for b in range(hidden.shape[0]):
        paths = consistent_paths(reference, hidden[b], int(anchors[b, 0]))
        assert paths == [tuple(proposal.drafts[b].tolist())]


def test_the_selector_changes_drafts_away_from_the_per_row_argmax():
    """The test cases exercise the selector: over the seeds, some drafts differ from the unary argmax."""
    differ = 0
    for seed in range(6):
        model, hidden, lm_head, anchors = tiny_case(seed)
        with torch.no_grad():
            drafts = model.propose(hidden, anchors, lambda h: h @ lm_head.T, GREEDY).drafts
        differ += int((drafts != (hidden @ lm_head.T).argmax(-1)).sum())
    assert differ > 0


def reference_q(reference: Reference, hidden_row, previous: int, temperature: float) -> torch.Tensor:
    """The proposal row: softmax of the scores / T over the row's candidates, 0 elsewhere (V,)."""
    unary = reference.logits(hidden_row[None])[0]
    options = reference.candidates(unary)
    q = torch.zeros(TINY.vocab, dtype=torch.float64)
    q[options] = torch.softmax(
        torch.tensor([reference.score(hidden_row, unary, previous, c) for c in options], dtype=torch.float64)
        / temperature,
        dim=0,
    )
    return q


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_rejection_rows_are_the_selectors_q_given_the_drafts_before_them(temperature):
    model, hidden, lm_head, anchors = tiny_case(11, batch=64)
    reference = Reference(model, TINY, lm_head)
    rule = DecodingRule(do_sample=True, rejection=True, temperature=temperature)
    torch.manual_seed(12)
    with torch.no_grad():
        proposal = model.propose(hidden, anchors, lambda h: h @ lm_head.T, rule)
    probs, drafts = proposal.probs, proposal.drafts
    assert probs.shape == (64, TINY.block - 1, TINY.vocab) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(64, TINY.block - 1))
    torch.testing.assert_close(proposal.confidence, probs.gather(-1, drafts[..., None])[..., 0])
    assert bool((proposal.confidence > 0).all())  # every draft was drawn from where its row has weight
    for b in range(0, 64, 7):
        previous = int(anchors[b, 0])
        for i in range(TINY.block - 1):
            expected = reference_q(reference, hidden[b, i], previous, temperature)
            assert (probs[b, i].double() - expected).abs().max() <= 1e-5
            previous = int(drafts[b, i])


def test_sampled_drafts_follow_the_selectors_joint_distribution():
    """Many draws of the same block: the (row 1, row 2) draft pairs follow q1(d1) * q2(d2 | d1) (chi-square), and a
    distribution that ignores the first draft is rejected by the same test."""
    model, hidden, lm_head, anchors = tiny_case(13, batch=1)
    reference = Reference(model, TINY, lm_head)
    draws, temperature = 6000, 0.8
    rule = DecodingRule(do_sample=True, rejection=True, temperature=temperature)
    torch.manual_seed(14)
    with torch.no_grad():
        drafts = model.propose(hidden.expand(draws, -1, -1), anchors.expand(draws, -1), lambda h: h @ lm_head.T,
                               rule).drafts
    counts = torch.zeros(TINY.vocab, TINY.vocab)
    counts.index_put_((drafts[:, 0], drafts[:, 1]), torch.ones(draws), accumulate=True)
    first = reference_q(reference, hidden[0, 0], int(anchors[0, 0]), temperature)
    joint = torch.stack([first[d] * reference_q(reference, hidden[0, 1], d, temperature) for d in range(TINY.vocab)])
    assert chi_square_p_value(counts.flatten(), joint.flatten().float()) > 1e-3
    after_anchor = reference_q(reference, hidden[0, 1], int(anchors[0, 0]), temperature)
    unconditioned = first[:, None] * after_anchor[None, :]
    assert chi_square_p_value(counts.flatten(), unconditioned.flatten().float()) < 1e-3


@pytest.mark.parametrize("rejection", [False, True])
def test_a_draft_vocabulary_smaller_than_top_k_is_never_left(rejection):
    """The head gives -inf outside a draft vocabulary; the soft cap must not turn that into a finite score."""
    model, hidden, lm_head, anchors = tiny_case(15, batch=32)
    allowed = torch.tensor([1, 4])  # fewer tokens than selector_top_k = 3

    def head(rows: torch.Tensor) -> torch.Tensor:
        logits = torch.full((*rows.shape[:-1], TINY.vocab), -math.inf)
        logits[..., allowed] = (rows @ lm_head.T)[..., allowed]
        return logits

    torch.manual_seed(16)
    with torch.no_grad():
        proposal = model.propose(hidden, anchors, head, DecodingRule(do_sample=True, rejection=rejection))
    assert bool(torch.isin(proposal.drafts, allowed).all())
    if rejection:
        outside = torch.ones(TINY.vocab, dtype=torch.bool)
        outside[allowed] = False
        assert bool((proposal.probs[..., outside] == 0).all())


@pytest.mark.parametrize("rejection", [False, True])
def test_propose_traces_as_one_graph_without_a_host_sync(rejection):
    """No .item(), no shape that depends on the data: dynamo traces the walk as one graph (what a CUDA graph needs),
    and the traced walk drafts what the eager one does."""
    model, hidden, lm_head, anchors = tiny_case(17, batch=3)
    rule = DecodingRule(do_sample=True, rejection=rejection, temperature=0.7)

    def propose(rows: torch.Tensor, anchor_ids: torch.Tensor):
        proposal = model.propose(rows, anchor_ids, lambda h: h @ lm_head.T, rule)
        return proposal.drafts, proposal.probs, proposal.confidence

    traced = torch.compile(propose, fullgraph=True, backend="eager", dynamic=False)
    with torch.no_grad():
        torch.manual_seed(18)
        drafts, probs, confidence = traced(hidden, anchors)
        torch.manual_seed(18)
        eager = propose(hidden, anchors)
    assert torch.equal(drafts, eager[0])
    torch.testing.assert_close(confidence, eager[2])
    if rejection:
        torch.testing.assert_close(probs, eager[1])


# --------------------------------------------------------------------------------------------------
# Config fields
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(conv_group_size=6), "conv_group_size 6 must divide hidden_size 64"),
        (dict(conv_kernel_size=9), "conv_kernel_size 9 must be between 1 and block_size 8"),
        (dict(selector_top_k=51), "selector_top_k 51 must be between 1 and vocab_size 50"),
        (dict(selector_rank=0), r"selector_rank must be an integer >= 1 \(the width of the candidate selector"),
        (dict(output_multiplier=0.0), "output_multiplier must be a number > 0"),
        (dict(final_logit_softcapping=-1.0), "final_logit_softcapping must be a number >= 0"),
        (dict(conv_kernel_size=2.5), "conv_kernel_size must be an integer >= 1"),
        (dict(input_embedding_scale="2"), "input_embedding_scale must be a number > 0"),
    ],
)
def test_bad_dflash2_fields_are_refused_with_the_fix(change, message):
    fields = make_config(SHAPES["gqa_b8"]).to_dict()
    fields.update(change)
    with pytest.raises(ValueError, match=message):
        DFlash2DraftModel(DFlashConfig(**{k: v for k, v in fields.items() if k != "model_type"}))


def test_a_dflash2_config_takes_the_published_value_of_a_field_it_leaves_out():
    fields = {k: v for k, v in make_config(SHAPES["gqa_b8"]).to_dict().items() if k != "model_type"}
    for name in ("conv_group_size", "selector_rank", "final_logit_softcapping"):
        del fields[name]
    config = DFlashConfig(**fields)
    assert config.is_dflash2
    assert (config.conv_group_size, config.selector_rank, config.final_logit_softcapping) == (16, 256, None)
    # the class named in architectures alone makes a config DFlash2's, every field at its published value
    plain = {k: v for k, v in fields.items() if k not in DFLASH2_DEFAULTS}
    assert not DFlashConfig(**plain).is_dflash2
    named = DFlashConfig(**{**plain, "architectures": ["DFlash2DraftModel"]})
    assert {name: getattr(named, name) for name in DFLASH2_DEFAULTS} == DFLASH2_DEFAULTS
    with pytest.raises(ValueError, match="this is a DFlash drafter config"):
        DFlash2DraftModel(DFlashConfig(**plain))
