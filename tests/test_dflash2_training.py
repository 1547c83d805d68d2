"""The DFlash2 training objective: against a plain per-row reference, its gradient, its simulated tau against the real
greedy walk, and its relation to DFlash's objective for a fresh drafter."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from hf_dflash.modeling import DFlashConfig, DFlashDraftModel
from hf_dflash.modeling.dflash_acceptance import DecodingRule
from hf_dflash.modeling.dflash_layouts import DFLASH2_DEFAULTS
from hf_dflash.modeling.modeling_dflash2 import DFlash2DraftModel
from hf_dflash.training.objective import IGNORE, DFlashObjective, row_weights
from hf_dflash.training.objective_dflash2 import DFlash2Objective, dflash2_block_loss, predecessor_ids
from tests.conftest import MASK_ID, VOCAB, tiny_target
from tests.test_dflash2 import randomized
from tests.test_training import random_batch

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK = 4


def drafter_config(target: torch.nn.Module, **fields) -> DFlashConfig:
    # 32 candidates of 256 tokens: random data puts enough labels among a random drafter's candidates
    dflash2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=32)
    dflash2.update(fields)
    return DFlashConfig.for_target(target.config, num_hidden_layers=2, block_size=BLOCK, mask_token_id=MASK_ID,
                                   **dflash2)


def random_drafter(target: torch.nn.Module, seed: int = 0) -> DFlash2DraftModel:
    config = drafter_config(target, output_multiplier=0.8, final_logit_softcapping=6.0, input_embedding_scale=1.2)
    return randomized(DFlash2DraftModel(config), seed).train()


def plain_loss(hidden, lm_head, labels, predecessors, weights, drafter, selector_weight):
    """The objective row by row: unary CE, then CE over the row's top-k candidates scored after the true token."""
    selector = drafter.candidate_selector
    numerator = denominator = 0.0
    for row, label, previous, weight in zip(hidden.flatten(0, 1), labels.flatten(), predecessors.flatten(),
                                            weights.expand_as(labels).flatten()):
        if label == IGNORE:
            continue
        unary = drafter.unary_logits(row @ lm_head.T)
        numerator = numerator + weight * F.cross_entropy(unary[None], label[None])
        denominator = denominator + weight
        candidates = sorted(range(VOCAB), key=lambda v: -float(unary[v].detach()))[: selector.top_k]
        if int(label) not in candidates:
            continue
        projected = selector.hidden_projection(row)
        scores = torch.stack([
            unary[c] + (selector.predecessor_codebook[previous] * projected) @ selector.successor_codebook[c]
            for c in candidates
        ])
        numerator = numerator + selector_weight * weight * F.cross_entropy(
            scores[None], torch.tensor([candidates.index(int(label))])
        )
    return numerator / denominator


@pytest.mark.parametrize("selector_weight", [1.0, 0.3])
def test_loss_and_gradient_equal_the_plain_reference_in_any_chunking(selector_weight):
    target = tiny_target("qwen3")
    drafter = random_drafter(target)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 3 * BLOCK, 64, generator=generator)
    labels = torch.randint(0, VOCAB, (2, 3, BLOCK), generator=generator)
    labels[..., 0] = IGNORE
    labels[1, 2, 2:] = IGNORE
    # make most labels reachable: the label of half the rows is one of its top candidates
    lm_head = target.get_output_embeddings().weight.detach()
    with torch.no_grad():
        top = (hidden @ lm_head.T).topk(3, dim=-1).indices.view(2, 3, BLOCK, 3)
    pick = torch.rand(labels.shape, generator=generator) < 0.5
    labels = torch.where(pick & (labels != IGNORE), top[..., 1], labels)
    predecessors = torch.randint(0, VOCAB, labels.shape, generator=generator)
    weights = row_weights(BLOCK, 4.0)

    expected_hidden = hidden.clone().requires_grad_(True)
    expected = plain_loss(expected_hidden, lm_head, labels, predecessors, weights, drafter, selector_weight)
    expected.backward()
    expected_grad = expected_hidden.grad
    for chunk_rows in (3, 4096):
        drafter.zero_grad()
        rows = hidden.clone().requires_grad_(True)
        out = dflash2_block_loss(rows, lm_head, labels, predecessors, weights, drafter, selector_weight,
                                 chunk_rows=chunk_rows)
        out.loss.backward()
        torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rows.grad, expected_grad, rtol=1e-4, atol=1e-6)
        assert 0 < float(out.candidate_recall) < 1


def test_gradient_reaches_every_dflash2_parameter():
    target = tiny_target("qwen3")
    drafter = random_drafter(target, seed=2)
    objective = DFlash2Objective(target, drafter.config, max_anchors=6)
    out = objective(drafter, random_batch(3, batch=2, seq_len=32), torch.Generator().manual_seed(0))
    assert math.isfinite(float(out.loss.detach())) and out.num_blocks > 0
    out.loss.backward()
    for name, param in drafter.named_parameters():
        assert param.grad is not None and bool(torch.isfinite(param.grad).all()), name
        assert float(param.grad.abs().max()) > 0, f"no gradient reaches {name}"
    assert target.get_output_embeddings().weight.grad is None  # the target stays frozen


def test_selector_stop_gradient_keeps_its_loss_out_of_the_backbone():
    target = tiny_target("qwen3")
    batch = random_batch(4, batch=2, seq_len=28)

    def gradients(**options):
        drafter = random_drafter(target, seed=3)
        objective = DFlash2Objective(target, drafter.config, max_anchors=5, **options)
        objective(drafter, batch, torch.Generator().manual_seed(0)).loss.backward()
        return {name: p.grad.clone() for name, p in drafter.named_parameters()}

    stopped, unary_only = gradients(selector_stop_gradient=True), gradients(selector_weight=0.0)
    for name, grad in stopped.items():
        if name.startswith("candidate_selector."):
            assert float(grad.abs().max()) > 0 and float(unary_only[name].abs().max()) == 0, name
        else:
            torch.testing.assert_close(grad, unary_only[name], rtol=1e-5, atol=1e-7)


def test_predecessors_are_the_tokens_before_the_labels():
    input_ids = torch.arange(100, 130)[None].repeat(2, 1)
    anchors = torch.tensor([[0, 5, 27], [3, 9, 12]])
    previous = predecessor_ids(input_ids, anchors, BLOCK)
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            for k in range(1, BLOCK):
                if a + k < 30:
                    assert int(previous[b, i, k]) == 100 + a + k - 1


def test_simulated_tau_is_the_acceptance_of_the_greedy_walk():
    """Labels that follow the walk's drafts for a random number of rows, then leave them: the teacher-forced picks
    (after the true previous token) find exactly the rows the decode-time walk would have had accepted."""
    target = tiny_target("qwen3")
    drafter = random_drafter(target, seed=5).eval()
    lm_head = target.get_output_embeddings().weight
    generator = torch.Generator().manual_seed(6)
    batch, anchors = 3, 5
    hidden = torch.randn(batch, anchors * BLOCK, 64, generator=generator)
    anchor_ids = torch.randint(0, VOCAB, (batch, anchors), generator=generator)
    with torch.no_grad():
        rows = hidden.view(batch, anchors, BLOCK, -1)[:, :, 1:].flatten(0, 1)
        drafts = drafter.propose(rows, anchor_ids.flatten()[:, None], lambda h: h @ lm_head.T,
                                 DecodingRule(do_sample=False, rejection=False)).drafts.view(batch, anchors, -1)
    followed = torch.randint(0, BLOCK, (batch, anchors), generator=generator)  # rows whose label is the draft
    labels = torch.full((batch, anchors, BLOCK), IGNORE)
    for b in range(batch):
        for i in range(anchors):
            for k in range(1, BLOCK):
                draft = int(drafts[b, i, k - 1])
                labels[b, i, k] = draft if k <= followed[b, i] else (draft + 1 + k) % VOCAB
    # the true token before each label: the anchor before row 1 (row 0 has no label)
    predecessors = torch.cat([anchor_ids[..., None], anchor_ids[..., None], labels[..., 1:-1]], dim=-1)
    with torch.no_grad():
        out = dflash2_block_loss(hidden, lm_head, labels, predecessors, row_weights(BLOCK, 4.0), drafter)
    torch.testing.assert_close(out.tau, (followed + 1).float().mean())
    assert float(out.unary_tau) < float(out.tau)  # the walk left the per-row argmax somewhere: a real check


def test_a_fresh_drafter_trains_from_dflashs_loss():
    """A fresh DFlash2 drafter (identity convolutions, silent selector) without output scaling has DFlash's block
    loss and tau on the same batch and anchors."""
    target = tiny_target("qwen3")
    torch.manual_seed(7)
    fresh = DFlash2DraftModel(drafter_config(target))
    backbone = DFlashDraftModel(fresh.config)
    backbone.load_state_dict(fresh.state_dict(), strict=False)
    batch = random_batch(8, batch=2, seq_len=30)
    dflash2 = DFlash2Objective(target, fresh.config, max_anchors=6)(fresh, batch, torch.Generator().manual_seed(2))
    dflash = DFlashObjective(target, fresh.config, max_anchors=6)(backbone, batch, torch.Generator().manual_seed(2))
    torch.testing.assert_close(dflash2.block_loss, dflash.loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dflash2.tau, dflash.tau)
    torch.testing.assert_close(dflash2.unary_tau, dflash.tau)
    assert float(dflash2.selector_loss) > 0


def test_a_few_steps_lower_the_loss_on_a_fixed_batch():
    target = tiny_target("qwen3")
    drafter = random_drafter(target, seed=9)
    objective = DFlash2Objective(target, drafter.config, max_anchors=6)
    tokens = 10 + (torch.arange(24) + torch.tensor([[0], [2]])) % 5  # a pattern the drafter can learn
    batch = {"input_ids": tokens, "loss_mask": (torch.arange(24) >= 4).long().expand(2, -1),
             "attention_mask": torch.ones_like(tokens)}
    optimizer = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    losses, taus = [], []
    for _ in range(15):
        out = objective(drafter, batch, torch.Generator().manual_seed(3))
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(float(out.loss.detach()))
        taus.append(float(out.tau))
    assert losses[-1] < losses[0] - 0.5
    assert taus[0] < 2 and taus[-1] > 3  # of at most 4 (block 4): the walk learned the pattern


def test_a_dflash_drafter_is_refused_by_the_dflash2_objective():
    target = tiny_target("qwen3")
    config = drafter_config(target)
    with pytest.raises(ValueError, match="DFlash2Objective trains a DFlash2 drafter"):
        DFlash2Objective(target, config)(DFlashDraftModel(config), random_batch(0, batch=1, seq_len=20))


# --------------------------------------------------------------------------------------------------
# hf-dflash train --arch dflash2: stories260K, two steps, reloaded every way a user loads a drafter
# --------------------------------------------------------------------------------------------------

REMOTE_CODE_GENERATE = textwrap.dedent(
    """
    import sys
    sys.modules["hf_dflash"] = None  # this interpreter cannot import the library
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
    drafter = AutoModel.from_pretrained(sys.argv[2], trust_remote_code=True).eval()
    assert type(drafter).__module__.startswith("transformers_modules"), type(drafter).__module__
    prompt = torch.tensor([[1, 403, 407, 261, 378, 284]])
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    out = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                          return_dict_in_generate=True)
    assert torch.equal(plain, out.sequences)
    print("remote-code", type(drafter).__name__, "ok")
    """
)


def test_train_arch_dflash2_saves_a_drafter_that_loads_back_as_dflash2(tmp_path):
    """Both architectures train two steps on the same answers; the DFlash2 one is saved as a DFlash2DraftModel (its
    published fields in config.json, its trained convolutions and selector in the weights) and loads back as one
    through DFlashDraftModel.from_pretrained and through the remote-code bundle alone; the DFlash one is unchanged."""
    from hf_dflash.bundled_models import load_stories260k
    from hf_dflash.cli import main as cli_main
    from hf_dflash.training import write_jsonl_prompts

    prompts = [f"Once upon a time, {name} had a {thing}." for name in ("Lily", "Tom") for thing in ("ball", "dog")]
    write_jsonl_prompts(prompts, tmp_path / "p.jsonl.gz", sources=["made up here"] * len(prompts))
    common = ["train", "--target", "stories260k", "--prompts", str(tmp_path / "p.jsonl.gz"), "--max-new-tokens", "16",
              "--batch-size", "2", "--max-anchors", "4", "--regenerated", str(tmp_path / "data.safetensors"),
              "--mask-token-id", "0", "--steps", "2", "--lr", "1e-2"]
    assert cli_main([*common, "--out", str(tmp_path / "dflash")]) == 0
    assert cli_main([*common, "--out", str(tmp_path / "dflash2"), "--arch", "dflash2"]) == 0

    plain = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert plain["architectures"] == ["DFlashDraftModel"] and plain["block_size"] == 16
    assert not set(DFLASH2_DEFAULTS) & set(plain)
    assert type(DFlashDraftModel.from_pretrained(tmp_path / "dflash")) is DFlashDraftModel

    saved = json.loads((tmp_path / "dflash2" / "config.json").read_text())
    assert saved["architectures"] == ["DFlash2DraftModel"] and saved["block_size"] == 8
    assert saved["auto_map"]["AutoModel"] == "modeling_dflash2.DFlash2DraftModel"
    assert {k: saved.get(k) for k in DFLASH2_DEFAULTS} == DFLASH2_DEFAULTS
    assert json.loads((tmp_path / "dflash2" / "training_args.json").read_text())["arch"] == "dflash2"
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "dflash2")
    assert type(drafter) is DFlash2DraftModel
    # trained with the DFlash2 objective: a fresh drafter's convolutions are the identity (kernel_projection zero;
    # the selector learns only once labels reach its candidates, which two steps do not promise)
    for conv in (drafter.layers[0].attention_conv, drafter.layers[0].mlp_conv):
        assert float(conv.kernel_projection.weight.detach().abs().max()) > 0

    target, tokenizer = load_stories260k()
    prompt = tokenizer("Once upon a time, Tom had a ball.", return_tensors="pt")["input_ids"]
    expected = target.generate(prompt, max_new_tokens=24, do_sample=False)
    out = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter.eval(),
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected) and len(out.acceptance_lengths[0]) >= 1

    target.save_pretrained(tmp_path / "target")
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_CODE_GENERATE, str(tmp_path / "target"), str(tmp_path / "dflash2")],
        capture_output=True, text=True, timeout=300,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HOME": str(tmp_path / "hf")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "remote-code DFlash2DraftModel ok" in result.stdout


def test_train_arch_dflash2_refuses_what_it_cannot_do(tmp_path, capsys):
    from hf_dflash.cli import main as cli_main

    base = ["train", "--target", "stories260k", "--prompts", "humaneval", "--mask-token-id", "0", "--steps", "1"]
    for extra, message in (
        (["--arch", "dflash2", "--distill-topk", "4"], "--distill-topk trains DFlash drafters only"),
        (["--arch", "dflash3"], "invalid choice: 'dflash3'"),
    ):
        with pytest.raises(SystemExit) as refused:
            cli_main([*base, "--out", str(tmp_path / "out"), *extra])
        assert refused.value.code == 2 and message in capsys.readouterr().err


def test_a_dflash_drafter_upgraded_to_dflash2_drafts_what_it_drafted():
    """`train --init-from DFLASH_DRAFTER --arch dflash2` starts from `upgrade_to_dflash2`: every trained weight kept,
    convolutions the identity and the selector silent, so the upgraded drafter's rows and greedy drafts are the DFlash
    drafter's; the DFlash2 parts are there to learn."""
    from hf_dflash.training.drafter import upgrade_to_dflash2
    from tests.test_dflash2 import GREEDY, SHAPES, inputs, make_config

    shape = SHAPES["gqa_b8"]
    dflash_fields = {k: v for k, v in make_config(shape).to_dict().items() if k not in DFLASH2_DEFAULTS}
    config = DFlashConfig(**{**dflash_fields, "architectures": ["DFlashDraftModel"]})
    assert not config.is_dflash2
    trained = randomized(DFlashDraftModel(config), seed=3).eval()
    upgraded = upgrade_to_dflash2(trained).eval()
    assert type(upgraded) is DFlash2DraftModel and upgraded.config.block_size == trained.config.block_size
    assert {k: getattr(upgraded.config, k) for k in DFLASH2_DEFAULTS} == DFLASH2_DEFAULTS
    noise, context, lm_head = inputs(shape, 2, 5, seed=4)
    kwargs = dict(context_hidden_states=context, position_ids=torch.arange(5 + config.block_size).expand(2, -1))
    with torch.no_grad():
        rows = upgraded(noise_embeds=noise, **kwargs).last_hidden_state
        expected = trained(noise_embeds=noise, **kwargs).last_hidden_state
        proposal = upgraded.propose(rows[:, 1:], torch.tensor([[1], [2]]), lambda h: h @ lm_head.T, GREEDY)
    torch.testing.assert_close(rows, expected, rtol=0, atol=1e-6)
    assert torch.equal(proposal.drafts, (expected[:, 1:] @ lm_head.T).argmax(-1))
    with pytest.raises(ValueError, match="DFlash2 drafter already"):
        upgrade_to_dflash2(upgraded)
