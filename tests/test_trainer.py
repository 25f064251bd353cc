"""DrafterTrainer on a tiny random target (real tokenizer, real regenerated files): training computes exactly what
drafting computes, the loss goes down, resume continues identically, and batch x accumulation splits agree."""

import pytest
import torch
from transformers import TrainerCallback

from angelspec_hf import DFlashDrafter, DFlyDrafter, MTPDrafter
from angelspec_hf.trainer.arguments import DrafterTrainingArguments
from angelspec_hf.trainer.data import load_train_prompts
from angelspec_hf.trainer.dataset import DrafterCollator, load_regenerated
from angelspec_hf.trainer.features import target_features
from angelspec_hf.trainer.regenerate import regenerate
from angelspec_hf.trainer.trainer import DrafterTrainer, pack_blocks
from helpers import tiny_chat_target

CLASSES = {"mtp": (MTPDrafter, {"num_draft_tokens": 3}), "dflash": (DFlashDrafter, {"block_size": 4}),
           "dfly": (DFlyDrafter, {"block_size": 4}),
           "mtp_eagle3": (MTPDrafter, {"num_draft_tokens": 3, "layout": "eagle3"})}  # `--config_overrides layout=eagle3`


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("regenerated")
    target, tokenizer = tiny_chat_target()
    for name in ("gsm8k", "code_alpaca", "sharegpt"):
        regenerate(target, tokenizer, load_train_prompts(name)[:8], folder / f"{name}.jsonl", batch_size=8,
                   max_new_tokens=24, max_prompt_tokens=200, progress=False)
    return target, tokenizer, folder


def make_drafter(family, target, seed=1):
    cls, kw = CLASSES[family]
    torch.manual_seed(seed)
    drafter = cls.from_target(target, **kw)
    if family == "dfly":
        with torch.no_grad():
            drafter.ar_head.down_proj.weight.normal_(std=0.1)
    return drafter


def make_args(tmp_path, family, folder, **kw):
    defaults = dict(
        output_dir=str(tmp_path / "out"), drafter_type=family, block_size=4, num_anchors=4, mtp_num_steps=3,
        regenerated_dir=str(folder), train_sets=["gsm8k", "code_alpaca", "sharegpt"], per_device_train_batch_size=4,
        learning_rate=3e-3, max_steps=30, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        seed=0, data_seed=0, max_seq_length=192, dataloader_num_workers=0,
    )
    return DrafterTrainingArguments(**(defaults | kw))


def dataset_for(setup, args):
    target, tokenizer, folder = setup
    return load_regenerated(tokenizer, folder, args.train_sets, max_length=args.max_seq_length)


class LossLog(TrainerCallback):
    def __init__(self):
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def train(setup, args, drafter, callbacks=(), resume=None):
    target, tokenizer, _ = setup
    trainer = DrafterTrainer(drafter, args, target, train_dataset=dataset_for(setup, args),
                             data_collator=DrafterCollator(tokenizer.pad_token_id), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def teacher(tokens):
    """A `select` that picks the true next tokens (teacher forcing), so drafting follows the training sequence."""
    it = iter(tokens)

    def select(logits, j):
        return torch.tensor([next(it)]), logits.float(), None

    return select


@pytest.mark.parametrize("family", ["mtp", "mtp_eagle3", "dflash", "dfly"])
def test_training_forward_equals_drafting(setup, family):
    target, tokenizer, folder = setup
    drafter = make_drafter(family, target).eval()
    if family == "dfly":
        drafter.bind_embeddings(target.get_input_embeddings())
    ex = load_regenerated(tokenizer, folder, ["gsm8k"])[0]
    ids = torch.tensor([ex["input_ids"]])
    layer_ids = drafter.config.target_layer_ids
    features = target_features(target, ids, torch.ones_like(ids), layer_ids)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        if family.startswith("mtp"):
            steps, length = 3, ids.shape[1] - 1
            step_tokens = torch.stack([torch.cat([ids[0, 1 + j:], ids.new_zeros(j)])[:length] for j in range(steps)])
            hidden = drafter(features[:, :length], embed(step_tokens[None])).last_hidden_state[0]  # [S, L, H]
            for t in (3, 10, length - steps - 1):
                draft_logits = drafter.propose(
                    drafter.new_draft_state(), features[:, : t + 1], ids[:, : t + 2], steps, embed, lm_head,
                    teacher(ids[0, t + 2 : t + 2 + steps].tolist()))[1][0]
                for j in range(steps):
                    torch.testing.assert_close(drafter.head(hidden[j, t], lm_head), draft_logits[j], rtol=1e-4, atol=1e-4)
        else:
            block = drafter.config.block_size
            supervised = torch.tensor([ex["supervised"]]).bool()
            block_ids, position_ids, keep, labels, previous, valid = pack_blocks(
                ids, supervised, torch.ones_like(ids), torch.tensor([0]), 3, block, drafter.config.mask_token_id, 0)
            mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
            hidden = drafter(embed(block_ids), features, position_ids, mask[:, None], previous_ids=previous).last_hidden_state
            rows = hidden.view(3, block, -1)
            anchors = position_ids[0, ids.shape[1]::block]
            for i, a in enumerate(anchors.tolist()):
                assert valid[0, i].any()
                draft_logits = drafter.propose(
                    drafter.new_draft_state(), features[:, :a], ids[:, : a + 1], block - 1, embed, lm_head,
                    teacher(ids[0, a + 1 : a + block].tolist()))[1][0]
                torch.testing.assert_close(lm_head(rows[i, 1:]), draft_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family,loss_kind,pruned", [("mtp", "ce", False), ("dflash", "ce", False), ("dfly", "ce", False),
                                                     ("mtp", "kl", True), ("dfly", "ce+kl", True),
                                                     ("mtp_eagle3", "ce", True)])
def test_loss_goes_down(setup, tmp_path, family, loss_kind, pruned):
    """Every family learns, with hard labels and with distillation from the target's logits, over the whole
    vocabulary and over a pruned draft vocabulary (the target's reply tokens and some others)."""
    log = LossLog()
    drafter = make_drafter(family, setup[0])
    if pruned:
        _, tokenizer, folder = setup
        replies = {t for ex in load_regenerated(tokenizer, folder, ["gsm8k"]) for t, s in
                   zip(ex["input_ids"], ex["supervised"]) if s}
        drafter.set_draft_vocab(sorted(replies | set(range(500))))
    args = make_args(tmp_path, family.removesuffix("_eagle3"), setup[2], max_steps=30, learning_rate=1e-2,
                     loss_kind=loss_kind)
    train(setup, args, drafter, [log])
    losses = [log.losses[s] for s in sorted(log.losses)]
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, " ".join(f"{x:.2f}" for x in losses)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["dfly", "mtp_eagle3"])
def test_training_on_cuda_with_a_bf16_target(setup, tmp_path, family):
    """The GPU playbook's recipe: the frozen target in bf16 on CUDA, the fp32 drafter under bf16 autocast, CE + KL over
    a pruned draft vocabulary. The loss goes down as on the CPU (the CPU twin: `test_loss_goes_down`), the pruned head
    the student's logits come from is float32 on the device (not the bf16 target's rows), and the
    training's τ eval drafts with the trained fp32 drafter beside the bf16 target on the device."""
    import copy

    from angelspec_hf.trainer.evaluation import measure_acceptance

    target, tokenizer, folder = setup
    gpu_target = copy.deepcopy(target).to("cuda", torch.bfloat16)
    drafter = make_drafter(family, target)
    replies = {t for ex in load_regenerated(tokenizer, folder, ["gsm8k"]) for t, s in
               zip(ex["input_ids"], ex["supervised"]) if s}
    drafter.set_draft_vocab(sorted(replies | set(range(500))))
    log = LossLog()
    args = make_args(tmp_path, family.removesuffix("_eagle3"), folder, max_steps=30, learning_rate=1e-2,
                     loss_kind="ce+kl", use_cpu=False, bf16=True)
    trainer = train((gpu_target, tokenizer, folder), args, drafter, [log])
    losses = [log.losses[s] for s in sorted(log.losses)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, " ".join(f"{x:.2f}" for x in losses)
    head, _ = trainer.training_head()
    assert head.weight.device.type == "cuda" and head.weight.dtype == torch.float32
    trained = trainer.model.eval()
    assert next(trained.parameters()).device.type == "cuda" and trained.dtype == torch.float32
    result = measure_acceptance(gpu_target, trained, tokenizer, ["What is 12 * 13?"], max_new_tokens=16)
    assert result["rounds"] > 0


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True


def test_resume_continues_identically(setup, tmp_path):
    args = dict(max_steps=12, save_strategy="steps", save_steps=6)
    full = LossLog()
    train(setup, make_args(tmp_path / "a", "dfly", setup[2], **args), make_drafter("dfly", setup[0]), [full])
    interrupted = make_args(tmp_path / "b", "dfly", setup[2], **args)
    train(setup, interrupted, make_drafter("dfly", setup[0]), [StopAt(6)])
    resumed = LossLog()
    train(setup, interrupted, make_drafter("dfly", setup[0], seed=123), [resumed],
          resume=str(tmp_path / "b" / "out" / "checkpoint-6"))
    assert sorted(resumed.losses) == list(range(7, 13))
    for step in range(7, 13):
        assert resumed.losses[step] == pytest.approx(full.losses[step], rel=1e-4)


@pytest.mark.parametrize("family", ["mtp", "dfly"])
def test_batch_times_accumulation_invariance(setup, tmp_path, family):
    results = []
    for batch, accumulation in ((4, 1), (2, 2), (1, 4)):
        drafter = make_drafter(family, setup[0])
        log = LossLog()
        args = make_args(tmp_path / f"{batch}", family, setup[2], max_steps=1, per_device_train_batch_size=batch,
                         gradient_accumulation_steps=accumulation, optim="sgd", learning_rate=0.5)
        train(setup, args, drafter, [log])
        results.append((log.losses[1], torch.cat([p.detach().flatten() for p in drafter.parameters()])))
    for loss, params in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-5)
        torch.testing.assert_close(params, results[0][1], rtol=1e-5, atol=1e-6)


def test_cached_features_match_online(setup, tmp_path):
    """fp16 features cached once in Arrow (half of fp32 per token) give the online loss up to fp16 rounding."""
    from angelspec_hf.trainer.features import cache_features

    target, tokenizer, _ = setup
    args = make_args(tmp_path, "dfly", setup[2], max_steps=1)
    drafter = make_drafter("dfly", target)
    dataset = dataset_for(setup, args).select(range(4))
    cached = cache_features(target, dataset, drafter.config.target_layer_ids, tmp_path / "features")
    row = cached[0]
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    assert torch.as_tensor(row["features"]).shape == (len(row["input_ids"]), width)
    collate = DrafterCollator(tokenizer.pad_token_id)
    online_batch, cached_batch = collate([dataset[i] for i in range(4)]), collate([cached[i] for i in range(4)])
    assert cached_batch["features"].dtype == torch.float16
    trainer = DrafterTrainer(drafter, args, target, train_dataset=dataset, data_collator=collate)
    with torch.no_grad():
        online = trainer.compute_loss(drafter, online_batch, num_items_in_batch=100)
        from_cache = trainer.compute_loss(drafter, cached_batch, num_items_in_batch=100)
    assert from_cache.item() == pytest.approx(online.item(), rel=1e-2)


def test_bf16_autocast_trains_the_drafter_on_the_fp32_targets_states(setup, tmp_path):
    """Under `--bf16` (CPU autocast) only the drafter runs in bf16: the online target states and the teacher's logits
    are the fp32 target's, so an online step's loss equals the loss on states computed outside autocast."""
    from angelspec_hf.trainer.features import target_states

    target, tokenizer, _ = setup
    args = make_args(tmp_path, "dfly", setup[2], max_steps=1, loss_kind="ce+kl")
    drafter = make_drafter("dfly", target)
    dataset = dataset_for(setup, args).select(range(4))
    batch = DrafterCollator(tokenizer.pad_token_id)([dataset[i] for i in range(4)])
    features, final = target_states(target, batch["input_ids"], batch["attention_mask"],
                                    drafter.config.target_layer_ids, final=True)
    trainer = DrafterTrainer(drafter, args, target, train_dataset=dataset,
                             data_collator=DrafterCollator(tokenizer.pad_token_id))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        online = trainer.compute_loss(drafter, batch, num_items_in_batch=100)
        given = trainer.compute_loss(drafter, batch | {"features": features, "final": final}, num_items_in_batch=100)
    assert online.item() == given.item()
    with torch.no_grad():
        assert trainer.compute_loss(drafter, batch, num_items_in_batch=100).item() != online.item()  # bf16 did run


def test_a_killed_feature_cache_keeps_its_finished_shards(setup, tmp_path, monkeypatch):
    """The caching pass is written shard by shard: killed in its third shard, the rerun computes only what was not
    written and gives what one uninterrupted pass gives; a folder holding another dataset's features is replaced."""
    from angelspec_hf.trainer import features

    target, _, _ = setup
    args = make_args(tmp_path, "dfly", setup[2], max_steps=1)
    layers = make_drafter("dfly", target).config.target_layer_ids
    dataset = dataset_for(setup, args).select(range(10))
    whole = features.cache_features(target, dataset, layers, tmp_path / "whole", batch_size=2, final=True,
                                    shard_size=4)

    real, rows_computed = features.target_states, []

    def killed_in_third_shard(target, input_ids, *args):
        if len(rows_computed) >= 8:  # shards 0 and 1 done
            raise KeyboardInterrupt
        rows_computed.extend([0] * len(input_ids))
        return real(target, input_ids, *args)

    monkeypatch.setattr(features, "target_states", killed_in_third_shard)
    with pytest.raises(KeyboardInterrupt):
        features.cache_features(target, dataset, layers, tmp_path / "run", batch_size=2, final=True, shard_size=4)
    assert sorted(p.name for p in (tmp_path / "run").glob("shard-*")) == ["shard-00000", "shard-00001"]
    (tmp_path / "run" / "shard-00002.tmp").mkdir()  # as if killed while saving the third shard
    (tmp_path / "run" / "shard-00002.tmp" / "data-00000-of-00001.arrow").write_bytes(b"half a file")
    rows_computed.clear()
    monkeypatch.setattr(features, "target_states", lambda target, ids, *a: rows_computed.extend([0] * len(ids))
                        or real(target, ids, *a))
    resumed = features.cache_features(target, dataset, layers, tmp_path / "run", batch_size=2, final=True,
                                      shard_size=4)
    assert len(rows_computed) == 2 and len(resumed) == 10  # the last shard's 2 rows, nothing else
    for i in range(10):
        for column in ("input_ids", "features", "final"):
            assert resumed[i][column] == whole[i][column]
    rows_computed.clear()
    assert len(features.cache_features(target, dataset, layers, tmp_path / "run", final=True, shard_size=4)) == 10
    assert rows_computed == []  # complete: read, not recomputed
    other = features.cache_features(target, dataset.select(range(3)), layers, tmp_path / "run", shard_size=4)
    assert len(other) == 3 and len(rows_computed) == 3
    assert sorted(p.name for p in (tmp_path / "run").glob("shard-*")) == ["shard-00000"]


def test_measured_acceptance_is_the_drafters_own(setup):
    """The training callback's τ drafts whole blocks and verifies no n-gram lookups, even for a drafter configured to
    serve with them: a lookup-inflated τ once made a checkpoint look 50% better than the drafter it continued."""
    from angelspec_hf.trainer.evaluation import measure_acceptance

    target, tokenizer, _ = setup
    drafter = make_drafter("dfly", target).eval()
    drafter.config.lookup_tokens, drafter.config.draft_length = 10, "auto"
    prompt = "Repeat after me: one two three, one two three, one two three, one two three."
    result = measure_acceptance(target, drafter, tokenizer, [prompt, "Count to five."], max_new_tokens=24)
    stats = drafter.last_speculation_stats
    assert stats.lookup_rounds == 0 and stats.plain_steps == 0 and stats.rounds > 0
    assert result["per_prompt"][-1] == [sum(stats.accepted), stats.rounds, sum(a >= 1 for a in stats.accepted)]
    accepted, rounds, first = (sum(column) for column in zip(*result["per_prompt"]))  # the per-prompt counts pool
    assert rounds == result["rounds"] and result["tau"] == (accepted + rounds) / rounds
    assert result["first"] == first / rounds and len(result["per_prompt"]) == result["prompts"] == 2
    assert drafter.config.lookup_tokens == 10 and drafter.config.draft_length == "auto"  # restored


def test_time_limit_stops_at_the_first_step_past_it():
    """`max_train_seconds` (`run.TimeLimit`): training stops at the first step that ends at or past the limit, not
    before; a non-positive limit is refused."""
    from transformers import TrainerControl, TrainerState

    from angelspec_hf.trainer.run import TimeLimit

    now = [100.0]
    limit, state, control = TimeLimit(30, clock=lambda: now[0]), TrainerState(), TrainerControl()
    limit.on_train_begin(None, state, control)
    for t in (110.0, 129.9):
        now[0] = t
        assert not limit.on_step_end(None, state, control).should_training_stop
    now[0] = 130.0
    stopped = limit.on_step_end(None, state, control)
    assert stopped.should_training_stop and stopped.should_save  # a checkpoint of that step: a rerun resumes there
    with pytest.raises(ValueError, match="max_train_seconds"):
        DrafterTrainingArguments(output_dir="unused", max_train_seconds=0)


def test_paired_tau_ratio_reads_a_win_only_where_every_draw_of_prompts_agrees():
    """`paired_tau_ratio`: the pooled τ ratio of two drafters on the same prompts, with a paired bootstrap interval
    over prompts; a gain on one prompt among losses is not a win; mismatched prompt lists are refused."""
    import pytest

    from angelspec_hf.trainer.evaluation import paired_tau_ratio

    base = [[30, 20, 12], [10, 20, 6], [50, 25, 18], [20, 20, 9]]  # [accepted, rounds, first accepted] per prompt
    same = paired_tau_ratio(base, base)
    assert same["ratio"] == same["low"] == same["high"] == 1.0
    better = [[a + 4, r, f] for a, r, f in base]  # 4 more tokens accepted on every prompt
    found = paired_tau_ratio(base, better)
    assert found["ratio"] == pytest.approx((126 + 85) / (110 + 85)) and 1.0 < found["low"] <= found["ratio"]
    mixed = [[a + (40 if i == 2 else -3), r, f] for i, (a, r, f) in enumerate(base)]  # one prompt up, three down
    found = paired_tau_ratio(base, mixed)
    assert found["ratio"] > 1.0 and found["low"] < 1.0 < found["high"]
    with pytest.raises(ValueError, match="same prompts"):
        paired_tau_ratio(base, base[:3])
    with pytest.raises(ValueError, match="one verification round"):
        paired_tau_ratio(base, [*base[:3], [0, 0, 0]])
