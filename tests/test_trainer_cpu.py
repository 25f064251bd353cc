"""The CPU training recipe's fast paths on a tiny random target (real tokenizer, real regenerated files): the teacher
over a pruned vocabulary is the full teacher's columns, a bf16 copy of the target computes the training signal while
the target itself stays as loaded, dropped padding anchors change no loss, length-grouped batches resume to the step,
the blocks count survives a resume, the states store fills as training reads it, and a run with the store and the
compiled drafter trains as the online, eager run does."""

import copy
import shutil

import pytest
import torch
from transformers import TrainerCallback

from angelspec_hf import DFlyDrafter
from angelspec_hf.trainer.arguments import DrafterTrainingArguments
from angelspec_hf.trainer.data import load_train_prompts
from angelspec_hf.trainer.dataset import DrafterCollator, load_regenerated
from angelspec_hf.trainer.features import target_states
from angelspec_hf.trainer.losses import token_loss, weighted_cross_entropy, weighted_distillation
from angelspec_hf.modeling.drafter_utils import additive_mask
from angelspec_hf.trainer.regenerate import regenerate
from angelspec_hf.trainer.trainer import DrafterTrainer, SeededLengthGroupedSampler, pack_blocks
from helpers import tiny_chat_target

SETS = ["gsm8k", "code_alpaca"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("regenerated")
    target, tokenizer = tiny_chat_target()
    for name in SETS:
        regenerate(target, tokenizer, load_train_prompts(name)[:10], folder / f"{name}.jsonl", batch_size=10,
                   max_new_tokens=24, max_prompt_tokens=200, progress=False)
    return target, tokenizer, folder


def make_drafter(target, vocab=None):
    torch.manual_seed(1)
    drafter = DFlyDrafter.from_target(target, block_size=4)
    if vocab is not None:
        drafter.set_draft_vocab(vocab)
    return drafter


def make_args(tmp_path, folder, **kw):
    defaults = dict(
        output_dir=str(tmp_path / "out"), drafter_type="dfly", block_size=4, num_anchors=4, regenerated_dir=str(folder),
        train_sets=SETS, per_device_train_batch_size=4, learning_rate=3e-3, max_steps=10, logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", seed=0, data_seed=0, max_seq_length=192,
        dataloader_num_workers=0, loss_kind="ce+kl",
    )
    return DrafterTrainingArguments(**(defaults | kw))


def make_trainer(setup, args, drafter, callbacks=()):
    target, tokenizer, folder = setup
    dataset = load_regenerated(tokenizer, folder, args.train_sets, max_length=args.max_seq_length)
    return DrafterTrainer(drafter, args, target, train_dataset=dataset,
                          data_collator=DrafterCollator(tokenizer.pad_token_id), callbacks=list(callbacks))


class Logs(TrainerCallback):
    def __init__(self):
        self.rows = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.rows[state.global_step] = logs


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True


def test_ce_plus_kl_from_one_log_softmax_equals_the_two_terms():
    torch.manual_seed(0)
    student = torch.randn(7, 13, requires_grad=True)
    teacher, weights = torch.randn(7, 13), torch.rand(7)
    labels = torch.tensor([1, -100, 3, 4, 5, 12, 0])
    both = token_loss(student, labels, weights, 9, teacher, kind="ce+kl")
    (grad,) = torch.autograd.grad(both, student)
    apart = weighted_cross_entropy(student, labels, weights, 9) + weighted_distillation(student, teacher, weights, 9)
    (grad_apart,) = torch.autograd.grad(apart, student)
    assert float(both.detach()) == pytest.approx(float(apart.detach()), rel=1e-6)
    torch.testing.assert_close(grad, grad_apart)


def test_pruned_teacher_logits_are_the_full_logits_columns(setup, tmp_path):
    target, _, folder = setup
    vocab = sorted({*range(3, 400, 3), 7, 11})
    for dtype in (None, "bfloat16"):
        trainer = make_trainer(setup, make_args(tmp_path, folder, target_states_dtype=dtype), make_drafter(target, vocab))
        hidden = torch.randn(5, target.config.hidden_size)
        full = target.get_output_embeddings()(hidden)[:, vocab]  # the fp32 target's logits, then its columns
        head = trainer.teacher_head()
        pruned = head(hidden.to(head.weight.dtype)).float()
        assert pruned.shape == (5, len(vocab))
        if dtype is None:
            assert head is trainer.training_head()[0]
            torch.testing.assert_close(pruned, full, rtol=0, atol=0)
        else:
            assert head.weight.dtype == torch.bfloat16
            torch.testing.assert_close(pruned, full, rtol=0.02, atol=0.05)


def test_bf16_states_come_from_a_copy_and_leave_the_target_as_loaded(setup, tmp_path):
    target, tokenizer, folder = setup
    args = make_args(tmp_path, folder, target_states_dtype="bfloat16")
    trainer = make_trainer(setup, args, make_drafter(target))
    assert trainer.target is target and target.dtype == torch.float32
    assert trainer.states_target is not target and trainer.states_target.dtype == torch.bfloat16
    batch = DrafterCollator(tokenizer.pad_token_id)([trainer.train_dataset[i] for i in range(4)])
    layers = trainer._drafter.config.target_layer_ids
    f32, _ = target_states(target, batch["input_ids"], batch["attention_mask"], layers)
    b16, _ = target_states(trainer.states_target, batch["input_ids"], batch["attention_mask"], layers)
    assert b16.dtype == torch.bfloat16
    rel = ((b16.float() - f32).norm() / f32.norm()).item()
    assert 0 < rel < 0.05
    reference = make_trainer(setup, make_args(tmp_path / "f", folder), make_drafter(target))
    with torch.no_grad():
        fast = trainer.compute_loss(trainer.model, batch, num_items_in_batch=100).item()
        exact = reference.compute_loss(reference.model, batch, num_items_in_batch=100).item()
    assert fast != exact and fast == pytest.approx(exact, rel=0.02)


def test_dropped_padding_anchors_change_no_loss(setup, tmp_path):
    """Anchors past every row's eligible positions are dropped (A shrinks to the most real anchors of any row); the
    loss is what the padded blocks gave, since they carried none."""
    target, tokenizer, folder = setup
    trainer = make_trainer(setup, make_args(tmp_path, folder, num_anchors=500), make_drafter(target))
    batch = DrafterCollator(tokenizer.pad_token_id)([trainer.train_dataset[i] for i in range(4)])
    block_ids, _, keep, labels, _, valid = pack_blocks(batch["input_ids"], batch["supervised"],
                                                       batch["attention_mask"], batch["example_index"], 500, 4, 2, 0)
    eligible = [int(s[2:].sum()) for s in batch["supervised"]]
    assert labels.shape[1] == max(eligible) < 500 and block_ids.shape[1] == 4 * max(eligible)
    assert valid.any(-1).sum(1).tolist() == eligible
    with torch.no_grad():
        many = trainer.compute_loss(trainer.model, batch, num_items_in_batch=100).item()
        trainer.args.num_anchors = max(eligible)
        exact = trainer.compute_loss(trainer.model, batch, num_items_in_batch=100).item()
    assert many == pytest.approx(exact, rel=1e-6)


def test_length_grouped_batches_are_seeded_by_epoch():
    lengths = [5, 90, 12, 40, 41, 88, 7, 60, 61, 13, 89, 6] * 30
    sampler = SeededLengthGroupedSampler(4, lengths, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(len(lengths))) and list(sampler) == first  # same epoch: same order
    sampler.set_epoch(1)
    assert list(sampler) != first
    batches = [first[i:i + 4] for i in range(0, len(first), 4)]
    spread = sum(max(lengths[j] for j in b) - min(lengths[j] for j in b) for b in batches) / len(batches)
    assert spread < 10  # random batches of these lengths spread by ~60 tokens


def test_fast_recipe_resumes_to_the_step(setup, tmp_path):
    """Length-grouped batches, bf16 target states, many anchors: a run stopped mid-epoch and resumed logs what the
    uninterrupted run logs at every later step, and its count of blocks seen continues."""
    target = setup[0]
    fast = dict(max_steps=9, save_strategy="steps", save_steps=4, train_sampling_strategy="group_by_length",
                target_states_dtype="bfloat16", num_anchors=32)
    full = Logs()
    make_trainer(setup, make_args(tmp_path / "a", setup[2], **fast), make_drafter(target), [full]).train()
    interrupted = make_args(tmp_path / "b", setup[2], **fast)
    make_trainer(setup, interrupted, make_drafter(target), [StopAt(4)]).train()
    resumed = Logs()
    torch.manual_seed(123)
    make_trainer(setup, interrupted, DFlyDrafter.from_target(target, block_size=4), [resumed]).train(
        resume_from_checkpoint=str(tmp_path / "b" / "out" / "checkpoint-4"))
    assert sorted(resumed.rows) == list(range(5, 10))
    for step in range(5, 10):
        assert resumed.rows[step]["loss"] == pytest.approx(full.rows[step]["loss"], rel=1e-4)
        assert resumed.rows[step]["blocks"] == full.rows[step]["blocks"]
    assert full.rows[9]["blocks"] > full.rows[1]["blocks"] > 0


def tau_by_training_script():
    """`scripts/tau_by_training.py` as a module (scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "tau_by_training.py"
    spec = importlib.util.spec_from_file_location("tau_by_training", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_tau_by_compute_reads_a_runs_logs_and_extrapolates(tmp_path):
    """`scripts/tau_by_training.py --from-logs`: the held-out τ a run logged, against blocks seen (with the starting
    drafter's blocks added), fitted as τ = a + b·ln(blocks) and solved for τ 3 and 4."""
    import json
    import math

    script = tau_by_training_script()
    history = [{"loss": 2.0, "step": 10, "blocks": 5000, "blocks_per_second": 100.0}]
    for step, blocks in ((250, 100_000), (500, 200_000), (750, 300_000), (1000, 400_000)):
        tau = 1.0 + 0.25 * math.log(blocks + 1_000_000)
        history += [{"loss": 1.0, "step": step, "blocks": blocks, "blocks_per_second": 120.0},
                    {"tau/held_out": tau, "first/held_out": 0.5, "step": step, "blocks": blocks}]
    run = tmp_path / "run"
    (run / "checkpoint-500").mkdir(parents=True)
    (run / "checkpoint-500" / "trainer_state.json").write_text(json.dumps({"global_step": 500,
                                                                          "log_history": history[:5]}))
    (run / "checkpoint-1000").mkdir()
    (run / "checkpoint-1000" / "trainer_state.json").write_text(json.dumps({"global_step": 1000,
                                                                           "log_history": history}))
    result = script.from_logs(run, tmp_path / "out", blocks_before=1_000_000)
    assert [r["step"] for r in result["rows"]] == [250, 500, 750, 1000]  # the newest checkpoint's history
    assert result["rows"][0]["blocks"] == 1_100_000
    assert result["fit"]["a"] == pytest.approx(1.0) and result["fit"]["b"] == pytest.approx(0.25)
    assert result["goals"]["3.0"]["blocks"] == pytest.approx(math.exp(8.0), rel=1e-6)
    assert result["blocks_per_second"] == 120.0  # the median logged
    assert result["goals"]["4.0"]["cpu_hours"] == pytest.approx(math.exp(12.0) / 120.0 / 3600, rel=1e-6)
    assert (tmp_path / "out" / "tau_by_compute.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    earlier = [script.parse_earlier("round 1:200000:1.5"), script.parse_earlier("round 2:600000:9.9")]
    assert earlier[0] == {"label": "round 1", "blocks": 200_000, "tau": 1.5}
    again = script.from_logs(run, tmp_path / "out2", blocks_before=1_000_000, earlier=earlier)
    assert again["fit"] == result["fit"] and again["earlier"] == earlier  # drawn beside, not fitted
    compare = [script.parse_earlier("DFlash:300000:0.5")]  # far below the curve and left of it: not fitted either
    third = script.from_logs(run, tmp_path / "out3", blocks_before=1_000_000, earlier=earlier, compare=compare)
    assert third["fit"] == result["fit"] and third["compare"] == compare
    fourth = script.from_logs(run, tmp_path / "out4", blocks_before=1_000_000, goals=(2.0,))
    assert list(fourth["goals"]) == ["2.0"] and fourth["goals"]["2.0"]["blocks"] == pytest.approx(math.exp(4.0))
    drawn = [(tmp_path / out / "tau_by_compute.png").read_bytes() for out in ("out2", "out3")]
    assert drawn[0] != drawn[1]
    assert script.blocks_for(3.0, 2.0, -0.1) is None  # a falling fit reaches no goal
    with pytest.raises(ValueError, match="two or more"):
        script.fit_log_curve([10, 10], [1.5, 1.6])


def test_tau_by_compute_chains_runs_that_continue_one_another(tmp_path, capsys):
    """`--from-logs RUN RUN2`: the second run started from the first one's final drafter, so its steps and blocks
    count on from the first's end, its start-of-run τ (the first run's last drafter again) is not a new point, and
    one curve is fitted over both."""
    import json
    import math

    script = tau_by_training_script()

    def run(name, points, total, start_tau):
        history = [{"tau/held_out": start_tau, "step": 0, "blocks": 0}]
        for step, blocks, tau in points:
            history += [{"loss": 1.0, "step": step, "blocks": blocks, "blocks_per_second": 100.0},
                        {"tau/held_out": tau, "step": step, "blocks": blocks}]
        history.append({"train_runtime": 1.0, "step": points[-1][0], "blocks": total})
        folder = tmp_path / name
        folder.mkdir()
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": points[-1][0], "log_history": history}))
        return folder

    def tau(blocks):
        return 1.0 + 0.25 * math.log(blocks)

    first = run("first", [(100, 40_000, tau(1_040_000)), (200, 80_000, tau(1_080_000))], 80_000, tau(1_000_000))
    second = run("second", [(100, 50_000, tau(1_130_000)), (300, 150_000, tau(1_230_000))], 150_000,
                 tau(1_080_000))  # the first run's last drafter again: not a new point
    third = run("third", [(50, 20_000, tau(1_250_000))], 20_000, tau(1_230_000))
    result = script.from_logs([first, second, third], tmp_path / "out", blocks_before=1_000_000)
    assert [(r["step"], r["blocks"]) for r in result["rows"]] == [
        (0, 1_000_000), (100, 1_040_000), (200, 1_080_000), (300, 1_130_000), (500, 1_230_000), (550, 1_250_000)]
    assert result["fit"]["a"] == pytest.approx(1.0) and result["fit"]["b"] == pytest.approx(0.25)
    assert script.from_logs(first, tmp_path / "one", blocks_before=1_000_000)["rows"] == result["rows"][:3]
    assert "warning" not in capsys.readouterr().err
    # a run that does not start where the one before it ended is said to, not silently joined
    odd = run("odd", [(100, 50_000, tau(1_130_000))], 50_000, tau(1_080_000) + 0.5)
    script.from_logs([first, odd], tmp_path / "odd-out", blocks_before=1_000_000)
    assert "did it start from that run's final drafter" in capsys.readouterr().err


def test_tau_by_compute_fits_the_ends_of_pieces(tmp_path):
    """`--fit-ends`: the fit goes through each chained run's end (and `--fitted` earlier ends), not the points
    inside a piece, which a restart at the peak learning rate pulls down; every logged point is still drawn."""
    import json
    import math

    script = tau_by_training_script()

    def tau(blocks):
        return 1.0 + 0.25 * math.log(blocks)

    def run(name, points, start_tau):
        history = [{"tau/held_out": start_tau, "step": 0, "blocks": 0}]
        for step, blocks, t in points:
            history += [{"loss": 1.0, "step": step, "blocks": blocks, "blocks_per_second": 100.0},
                        {"tau/held_out": t, "step": step, "blocks": blocks}]
        folder = tmp_path / name
        folder.mkdir()
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": points[-1][0], "log_history": history}))
        return folder

    # each piece dips below the curve after its restart and ends on it
    first = run("first", [(100, 40_000, tau(1_040_000) - 0.3), (200, 80_000, tau(1_080_000))], tau(1_000_000))
    second = run("second", [(100, 50_000, tau(1_130_000) - 0.3), (300, 150_000, tau(1_230_000))], tau(1_080_000))
    fitted = [script.parse_earlier("round 0:500000:" + repr(tau(500_000)))]
    ends = script.from_logs([first, second], tmp_path / "ends", blocks_before=1_000_000, fit_ends=True,
                            fitted=fitted)
    assert ends["fit"]["a"] == pytest.approx(1.0) and ends["fit"]["b"] == pytest.approx(0.25)
    assert [p["blocks"] for p in ends["fit"]["points"]] == [500_000, 1_080_000, 1_230_000]
    assert ends["goals"]["3.0"]["blocks"] == pytest.approx(math.exp(8.0), rel=1e-6)
    assert len(ends["rows"]) == 5 and ends["fitted"] == fitted  # every logged point drawn; the earlier end kept
    every = script.from_logs([first, second], tmp_path / "every", blocks_before=1_000_000)
    assert every["fit"]["b"] != pytest.approx(0.25)  # the dips pull a fit over every point away
    assert script.main(["--from-logs", str(first), str(second), "--blocks-before", "1000000", "--fit-ends",
                        "--fitted", "round 0:500000:" + repr(tau(500_000)), "--out", str(tmp_path / "cli")]) == 0
    stored = json.loads((tmp_path / "cli" / "tau_by_compute.json").read_text())
    assert stored["fit"]["b"] == pytest.approx(0.25) and (tmp_path / "cli" / "tau_by_compute.png").is_file()
    with pytest.raises(ValueError, match="fit_ends"):  # earlier ends mixed into a fit over every logged point
        script.from_logs([first, second], tmp_path / "mixed", blocks_before=1_000_000, fitted=fitted)
    with pytest.raises(ValueError, match="--fitted"):  # one end alone fixes no slope
        script.from_logs(first, tmp_path / "alone", blocks_before=1_000_000, fit_ends=True)
    # the earlier ends a run's config records (`held_out_tau_ends`) stand in for --fitted; later ones are its own
    recorded = [{"blocks": 500_000, "tau": tau(500_000)}, {"blocks": 1_000_000, "tau": tau(1_000_000)},
                {"blocks": 1_080_000, "tau": tau(1_080_000)}]
    recorded = [dict(e, prompts=12) for e in recorded]
    recorded.insert(1, {"blocks": 700_000, "tau": 1.0, "prompts": 2})  # measured otherwise: left out
    (first / "config.json").write_text(json.dumps({"held_out_tau_ends": recorded}))
    own = script.from_logs([first, second], tmp_path / "recorded", blocks_before=1_000_000, fit_ends=True)
    assert [p["blocks"] for p in own["fit"]["points"]] == [500_000, 1_000_000, 1_080_000, 1_230_000]
    assert own["fit"]["b"] == pytest.approx(0.25) and [p["label"] for p in own["fitted"]] == ["piece 1", "piece 3"]


def test_a_runs_card_fits_through_the_pieces_ends(tmp_path):
    """The card a training run writes (`compute_curve.card_section`) fits through where each piece ended (the
    starting drafter's `held_out_tau_ends` and the run's last point), not the run's own dip after its restart, and
    over every logged point for a run with no earlier end."""
    import math

    from angelspec_hf.trainer.compute_curve import card_section, piece_ends

    def tau(blocks):
        return 1.0 + 0.25 * math.log(blocks)

    history = [{"tau/held_out": tau(2_000_000), "step": 0, "blocks": 0}]
    for step, blocks, dip in ((100, 100_000, 0.3), (200, 200_000, 0.2), (300, 300_000, 0.0)):
        history += [{"loss": 1.0, "step": step, "blocks": blocks, "blocks_per_second": 100.0},
                    {"tau/held_out": tau(2_000_000 + blocks) - dip, "step": step, "blocks": blocks}]
    settings = {"prompts": 12, "max_new_tokens": 64}
    ends_before = [{"blocks": b, "tau": tau(b), **settings} for b in (500_000, 1_000_000, 2_000_000)]
    ends = piece_ends(history, 2_000_000, ends_before, settings=settings)
    assert ends == [*ends_before, {"blocks": 2_300_000, "tau": tau(2_300_000), **settings}]
    assert piece_ends(history[:1], 2_000_000, ends_before) == ends_before  # its start is the last end measured again
    # a checkpoint saved before the run's last eval (blocks seen past the last τ) records no end of its own
    assert piece_ends(history, 2_000_000, ends_before, blocks_now=310_000) == ends_before
    assert piece_ends(history, 2_000_000, ends_before, settings=settings, blocks_now=300_000) == ends
    # an end measured otherwise (a 2-prompt smoke eval) is kept in the record but not fitted
    odd = {"blocks": 1_500_000, "tau": 1.0, "prompts": 2, "max_new_tokens": 8}
    (tmp_path / "ends").mkdir()
    card = card_section(history, tmp_path / "ends", 2_000_000, [*ends_before[:2], odd, ends_before[2]], settings)
    assert "Fit through where each of the 4 pieces of training ended" in card
    assert "τ = 1.00 + 0.250·ln(blocks)" in card and f"τ 3 at {math.exp(8.0):.3g} blocks" in card
    assert (tmp_path / "ends" / "tau_by_compute.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "every").mkdir()
    alone = card_section(history, tmp_path / "every", 2_000_000)
    assert "Fit over every logged point" in alone and "0.250·ln" not in alone  # the dips pull the fit away


def test_acceptance_eval_drafts_in_fp32_during_a_bf16_run(setup, tmp_path):
    """Under `--bf16` accelerate wraps the trained drafter's forward in bf16 autocast; the τ eval in the middle of
    such a run must still draft as inference does (fp32 on CPU), and training goes on under autocast afterwards."""
    from angelspec_hf.trainer.evaluation import measure_acceptance

    target, tokenizer, folder = setup
    trainer = make_trainer(setup, make_args(tmp_path, folder, bf16=True, max_steps=1), make_drafter(target))
    trainer.train()
    drafter = trainer.accelerator.unwrap_model(trainer.model)
    assert "forward" in drafter.__dict__  # accelerate's autocast wrapper, as the callback finds it mid-run
    linear = next(m for m in drafter.modules() if isinstance(m, torch.nn.Linear))
    dtypes = []
    handle = linear.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    try:
        result = measure_acceptance(target, drafter, tokenizer, ["Count from one to ten."], max_new_tokens=12)
        assert result["rounds"] > 0 and dtypes and set(dtypes) == {torch.float32}
        dtypes.clear()
        batch = DrafterCollator(tokenizer.pad_token_id)([trainer.train_dataset[i] for i in range(2)])
        with torch.no_grad():
            trainer.compute_loss(trainer.model, batch, num_items_in_batch=10)
        assert set(dtypes) == {torch.bfloat16}  # the training forward is wrapped again
    finally:
        handle.remove()


def test_states_store_fills_as_training_reads_and_reads_back(setup, tmp_path):
    """`--feature_mode filling`: a sequence's states are computed and written the first time it is read, read back
    unchanged after (bf16 stays bf16); a batch mixing stored and new sequences gives what the target gives; the
    store is keyed by target and layers (the same weights from another folder find it, other weights do not); an unreadable file is computed again; a store it cannot write to leaves
    training running online."""
    from angelspec_hf.trainer.features import StatesStore

    target, tokenizer, folder = setup
    states_target = copy.deepcopy(target).to(torch.bfloat16)
    dataset = load_regenerated(tokenizer, folder, SETS, max_length=192)
    collate = DrafterCollator(tokenizer.pad_token_id)
    layers = make_drafter(target).config.target_layer_ids
    store = StatesStore(tmp_path / "store", states_target, layers, final=True)
    first = collate([dataset[i] for i in range(4)])
    features, final = store.states(states_target, first["input_ids"], first["attention_mask"])
    online, online_final = target_states(states_target, first["input_ids"], first["attention_mask"], layers, True)
    assert features.dtype == torch.bfloat16 and (store.written, store.read) == (4, 0)
    pad = first["attention_mask"].bool()
    assert torch.equal(features[pad], online[pad]) and torch.equal(final[pad], online_final[pad])
    assert not features[~pad].any()
    again = store.states(states_target, first["input_ids"], first["attention_mask"])
    assert (store.written, store.read) == (4, 4)
    assert torch.equal(again[0], features) and torch.equal(again[1], final)
    mixed = collate([dataset[i] for i in (2, 7, 0, 9)])
    features, final = store.states(states_target, mixed["input_ids"], mixed["attention_mask"])
    assert (store.written, store.read) == (6, 6)
    online, _ = target_states(states_target, mixed["input_ids"], mixed["attention_mask"], layers, True)
    pad = mixed["attention_mask"].bool()
    torch.testing.assert_close(features[pad].float(), online[pad].float(), rtol=0.02, atol=0.02)
    assert len(list(store.folder.glob("*.safetensors"))) == 6
    other = StatesStore(tmp_path / "store", states_target, [0, *layers], final=True)
    assert other.folder != store.folder and StatesStore(tmp_path / "store", states_target, layers, True).folder == \
        store.folder
    moved = copy.deepcopy(states_target)
    moved.config._name_or_path = "/another/cache/SmolLM2-135M-Instruct"
    assert StatesStore(tmp_path / "store", moved, layers, True).folder == store.folder
    with torch.no_grad():
        moved.model.norm.weight.mul_(1.5)
    assert StatesStore(tmp_path / "store", moved, layers, True).folder != store.folder
    row = mixed["input_ids"][1, : int(mixed["attention_mask"][1].sum())].tolist()
    store.path(row).write_bytes(b"not a safetensors file")
    assert torch.equal(store.states(states_target, mixed["input_ids"], mixed["attention_mask"])[0], features)
    assert store.written == 7
    blocked = StatesStore(tmp_path / "blocked", states_target, layers, final=True)
    shutil.rmtree(blocked.folder)
    blocked.folder.write_text("a file where the store's folder was: every write fails")
    features, _ = blocked.states(states_target, first["input_ids"], first["attention_mask"])
    assert blocked.written == 0 and torch.equal(features, again[0])
    features, _ = blocked.states(states_target, first["input_ids"], first["attention_mask"])
    assert blocked.written == 0 and blocked.read == 0 and torch.equal(features, again[0])


def test_filling_store_and_compiled_drafter_train_as_the_online_eager_run(setup, tmp_path):
    """Two epochs over the data with `--feature_mode filling --compile_drafter true`: the second epoch reads every
    sequence from the store, and every step's logged loss is the online, eager run's."""
    target = setup[0]
    common = dict(max_steps=8, target_states_dtype="bfloat16", num_anchors=16, per_device_train_batch_size=8,
                  train_sampling_strategy="group_by_length")
    plain = Logs()
    make_trainer(setup, make_args(tmp_path / "a", setup[2], **common), make_drafter(target), [plain]).train()
    fast = Logs()
    args = make_args(tmp_path / "b", setup[2], feature_mode="filling", feature_cache_dir=str(tmp_path / "store"),
                     compile_drafter=True, **common)
    trainer = make_trainer(setup, args, make_drafter(target), [fast])
    trainer.train()
    sequences = len(trainer.train_dataset)
    assert trainer.state.epoch >= 2 and trainer._states_store.written == sequences
    assert trainer._states_store.read >= sequences  # the second epoch read them all back
    assert trainer._compiled is not None
    for step in range(1, 9):
        assert fast.rows[step]["loss"] == pytest.approx(plain.rows[step]["loss"], rel=2e-3)


def test_block_sparse_training_attention_is_dense_attention_under_the_block_mask(setup, tmp_path):
    """A training step's attention computes each block's context scores and its own block's, not every packed block
    against every other: the loss and every gradient are dense SDPA's under the full mask, to rounding (fp32), with
    grouped-query heads and padded sequences; evaluation and inference keep the drafter's own attention."""
    from angelspec_hf.trainer.block_attention import block_attention

    torch.manual_seed(0)
    n, heads, kv_heads, dim, anchors, block, context = 2, 6, 2, 8, 5, 4, 11
    query = torch.randn(n, heads, anchors * block, dim)
    key, value = torch.randn(2, n, kv_heads, context + anchors * block, dim)
    sees = torch.rand(n, anchors, context) < 0.6
    sees[..., 0] = True
    keep_context = sees.repeat_interleave(block, dim=1)  # [N, A·B, T]
    of = torch.arange(anchors).repeat_interleave(block)
    keep = torch.cat([keep_context, (of[:, None] == of[None, :]).expand(n, -1, -1)], dim=2)
    dense = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=additive_mask(keep, torch.float32)[:, None], enable_gqa=True)
    module = type("Attention", (), {"config": type("Config", (), {"block_size": block})()})()
    sparse, _ = block_attention(module, query, key, value, additive_mask(keep_context, torch.float32)[:, None])
    torch.testing.assert_close(sparse.transpose(1, 2), dense, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="context mask"):
        block_attention(module, query, key, value, additive_mask(keep, torch.float32)[:, None])

    target, tokenizer, folder = setup
    batch = DrafterCollator(tokenizer.pad_token_id)([make_trainer(setup, make_args(tmp_path, folder),
                                                                  make_drafter(target)).train_dataset[i]
                                                     for i in range(4)])
    results = {}
    for sparse_attention in (True, False):
        args = make_args(tmp_path / str(sparse_attention), folder, block_sparse_attention=sparse_attention,
                         num_anchors=12)
        trainer = make_trainer(setup, args, make_drafter(target))
        trainer.model.train()
        loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=100)
        loss.backward()
        results[sparse_attention] = (loss.item(), {k: p.grad.clone() for k, p in trainer.model.named_parameters()
                                                   if p.grad is not None})
        assert trainer._drafter.config._attn_implementation == "sdpa"  # restored after the step
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-5)
    assert results[True][1].keys() == results[False][1].keys() and len(results[True][1]) > 10
    for name, grad in results[True][1].items():
        torch.testing.assert_close(grad, results[False][1][name], rtol=1e-4, atol=1e-6)
