"""`angelspec train` end to end: a killed run resumes from its last checkpoint, LoRA adapters (PEFT), the files a
Hub push uploads, two processes (torchrun) match one process, and a short real run on the embedded target."""

import json
import os
import socket
import signal
import subprocess
import sys
import time

import pytest
import torch

import angelspec_hf
from angelspec_hf.trainer.data import load_train_prompts
from angelspec_hf.trainer.regenerate import regenerate
from angelspec_hf.trainer.regenerated_files import read_records
from angelspec_hf.trainer.run import main as train_main
from angelspec_hf.trainer.run import parse_config_overrides
from angelspec_hf.trainer.schedule import schedule_factor
from helpers import tiny_chat_target

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target saved as a normal HF folder (with the real tokenizer) and its regenerated responses (gzip
    jsonl, as the project keeps them)."""
    root = tmp_path_factory.mktemp("tiny")
    target, tokenizer = tiny_chat_target()
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    regenerate(target, tokenizer, load_train_prompts("gsm8k")[:16], root / "data" / "gsm8k.jsonl.gz", batch_size=8,
               max_new_tokens=24, max_prompt_tokens=200, progress=False)
    return root


def cli_args(tiny, out, *extra):
    return ["--target", str(tiny / "target"), "--regenerated_dir", str(tiny / "data"), "--train_sets", "gsm8k",
            "--output_dir", str(out), "--drafter_type", "dfly", "--block_size", "4", "--num_anchors", "4",
            "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--logging_steps", "1",
            "--report_to", "none", "--use_cpu", "true", "--seed", "0", "--max_seq_length", "192", *extra]


def logged_losses(folder):
    state = json.loads((folder / "trainer_state.json").read_text())
    return {h["step"]: h["loss"] for h in state["log_history"] if "loss" in h}


def test_killed_run_resumes_from_last_checkpoint(tiny, tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    steps = ["--max_steps", "60", "--save_steps", "4", "--logging_steps", "1"]
    train_main(cli_args(tiny, full, *steps))
    cmd = [sys.executable, "-m", "angelspec_hf.trainer.run", *cli_args(tiny, killed, *steps)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while not list(killed.glob("checkpoint-*/trainer_state.json")):
        assert proc.poll() is None and time.time() < deadline, "training ended before its first checkpoint"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # mid-run, right after its first checkpoint
    proc.wait()
    assert not (killed / "trainer_state.json").exists(), "the run finished before it could be killed"
    done = max(int(p.parent.name.split("-")[1]) for p in killed.glob("checkpoint-*/trainer_state.json"))
    assert done < 60
    # a kill while saving leaves a newer, incomplete checkpoint folder: resume must skip it
    (killed / f"checkpoint-{done + 4}").mkdir(exist_ok=True)
    (killed / f"checkpoint-{done + 4}" / "config.json").write_text("{}")
    train_main(cli_args(tiny, killed, *steps, "--resume", "true"))
    reference, resumed = logged_losses(full), logged_losses(killed)
    assert sorted(resumed) == list(range(1, 61))
    for step in range(done + 1, 61):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-4)


def test_rounds_with_other_seeds_share_one_feature_cache(tiny, tmp_path):
    """`--feature_mode cached` writes the target's states once; a later round with another `--seed` (and `--bf16`)
    reads the same cache when `--dataset_seed` fixes the data order, and recomputes nothing."""
    cache = tmp_path / "features"
    common = ["--max_steps", "2", "--save_strategy", "no", "--feature_mode", "cached", "--feature_cache_dir",
              str(cache), "--dataset_seed", "0", "--loss_kind", "ce+kl"]
    train_main(cli_args(tiny, tmp_path / "round1", *common))
    written = {p.name: p.stat().st_mtime_ns for p in cache.rglob("*")}
    assert (cache / "angelspec_features.json").is_file() and any(name.startswith("shard-") for name in written)
    args = cli_args(tiny, tmp_path / "round2", *common, "--bf16", "true")
    args[args.index("--seed") + 1] = "1"
    train_main(args)
    assert {p.name: p.stat().st_mtime_ns for p in cache.rglob("*")} == written
    assert logged_losses(tmp_path / "round2")


def test_a_continued_run_plots_held_out_tau_against_every_block_seen(tiny, tmp_path):
    """A run's saved config records the training blocks its drafter has seen (`training_blocks`); a run continued
    from it counts on from there, and its card shows held-out τ against the whole count with the fit
    (`tau_by_compute.png`)."""
    common = ["--max_steps", "2", "--save_strategy", "no", "--eval_steps", "1", "--eval_prompts", "1",
              "--eval_prompts_from", "held_out", "--eval_max_new_tokens", "8"]
    first, second = tmp_path / "first", tmp_path / "second"
    train_main(cli_args(tiny, first, *common))
    seen = json.loads((first / "config.json").read_text())["training_blocks"]
    logged = [h for h in json.loads((first / "trainer_state.json").read_text())["log_history"] if "blocks" in h]
    assert seen == logged[-1]["blocks"] > 0
    train_main(cli_args(tiny, second, *common, "--init_drafter", str(first)))
    history = json.loads((second / "trainer_state.json").read_text())["log_history"]
    run_blocks = max(h["blocks"] for h in history if "blocks" in h)
    assert json.loads((second / "config.json").read_text())["training_blocks"] == seen + run_blocks
    card = (second / "README.md").read_text()
    assert "### Held-out τ against training compute" in card and "(tau_by_compute.png)" in card
    assert (second / "tau_by_compute.png").read_bytes()[:4] == b"\x89PNG"
    points = [h for h in history if "tau/held_out" in h]
    assert len(points) == 3  # before the first step, after steps 1 and 2
    assert [h["step"] for h in history if "loss" in h] == [1, 2]  # an eval at a logging step keeps its loss
    assert f"{points[0]['tau/held_out']:.3f} at {seen:,} blocks" in card  # the count starts where the first run ended
    # each run records where it ended; the continued run's card fits through the two ends, not its three points
    first_end = {"blocks": seen, "tau": [h for h in json.loads((first / "trainer_state.json").read_text())
                                         ["log_history"] if "tau/held_out" in h][-1]["tau/held_out"],
                 "prompts": 1, "max_new_tokens": 8}  # measured with the run's eval settings
    assert json.loads((first / "config.json").read_text())["held_out_tau_ends"] == [first_end]
    ends = json.loads((second / "config.json").read_text())["held_out_tau_ends"]
    assert ends == [first_end, {"blocks": seen + points[-1]["blocks"], "tau": points[-1]["tau/held_out"],
                                "prompts": 1, "max_new_tokens": 8}]
    assert "Fit through where each of the 2 pieces of training ended" in card
    assert "Fit over every logged point" in (first / "README.md").read_text()  # a run from scratch: one end


def test_output_is_what_a_push_uploads(tiny, tmp_path):
    out = tmp_path / "run"
    train_main(cli_args(tiny, out, "--max_steps", "2", "--save_strategy", "no", "--eval_prompts", "1",
                        "--eval_max_new_tokens", "8", "--loss_kind", "ce+kl"))
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "README.md", "modeling_dfly.py", "configuration_dfly.py",
            "loss_curve.png", "lookup_corpus.safetensors"} <= files
    assert "(loss_curve.png)" in (out / "README.md").read_text() and "loss: ce+kl" in (out / "README.md").read_text()
    card = (out / "README.md").read_text()
    assert card.startswith("---\nbase_model: ") and "openai/gsm8k" in card
    assert "| humaneval |" in card and "| gsm8k |" in card and "block size 4" in card
    assert "## Lookup corpus" in card and "16 of the target's own replies" in card
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_dfly.DFlyDrafter" and config["block_size"] == 4
    drafter = angelspec_hf.load_drafter(out)
    assert type(drafter).__name__ == "DFlyDrafter" and not drafter.ar_head.down_proj.weight.eq(0).all()
    # its lookup corpus: the replies of the sets it trained on, attached as it loads
    replies = [r["response_ids"] for r in read_records(tiny / "data" / "gsm8k.jsonl.gz")]
    assert [s.tolist() for s in drafter.lookup_corpus.sequences()] == replies
    # ...and, once pushed, it resolves by Hub id from the local cache with the Hub unreachable
    snapshot = tmp_path / "hub" / "models--me--tiny-dfly" / "snapshots" / ("b" * 40)
    snapshot.mkdir(parents=True)
    for name in files:
        if (out / name).is_file():
            (snapshot / name).write_bytes((out / name).read_bytes())
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("b" * 40)
    def refuse(*args, **kwargs):  # the Hub is unreachable: any connection attempt fails the test
        raise AssertionError(f"network access attempted: {args}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", refuse)
        patch.setattr(socket, "create_connection", refuse)
        by_id = angelspec_hf.load_drafter("me/tiny-dfly", cache_dir=str(tmp_path / "hub"), local_files_only=True)
    assert all(torch.equal(a, b) for a, b in zip(by_id.state_dict().values(), drafter.state_dict().values()))
    assert [s.tolist() for s in by_id.lookup_corpus.sequences()] == replies


def test_yaml_recipe(tiny, tmp_path):
    recipe = f"""
target: {tiny / "target"}
regenerated_dir: {tiny / "data"}
train_sets: [gsm8k]
output_dir: {tmp_path / "run"}
drafter_type: mtp
mtp_num_steps: 2
max_steps: 1
per_device_train_batch_size: 2
max_seq_length: 128
report_to: none
use_cpu: true
save_strategy: "no"
"""
    (tmp_path / "recipe.yaml").write_text(recipe)
    train_main([str(tmp_path / "recipe.yaml")])
    assert json.loads((tmp_path / "run" / "trainer_state.json").read_text())["global_step"] == 1
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["num_draft_tokens"] == 2
    # an MTP block: a position whose unrolled chain has a supervised prediction (at most 2 x 127 in one step)
    assert 0 < config["training_blocks"] <= 2 * 127


def test_mtp_under_bf16_autocast_leaves_autocast_off(tiny, tmp_path):
    """MTP's unrolled training forward does not re-enter the forward accelerate wraps in one autocast context: entered
    from inside itself, that context restored "on" at its exit, and everything after the run (the τ eval included)
    ran under bf16 autocast."""
    args = cli_args(tiny, tmp_path / "run", "--max_steps", "1", "--save_strategy", "no", "--bf16", "true",
                    "--mtp_num_steps", "2")
    args[args.index("--drafter_type") + 1] = "mtp"
    train_main(args)
    assert json.loads((tmp_path / "run" / "trainer_state.json").read_text())["global_step"] == 1
    assert not torch.is_autocast_enabled("cpu")


def test_schedule_fitted_to_time_decays_to_zero_and_a_step_run_of_its_length_matches_it(tiny, tmp_path):
    """`--fit_schedule_to_time`: the run times its warm-up, stops at the step its budget fits, with the cosine decayed
    to zero there, the length kept in trainer_state.json; a run given
    `--max_steps` = that length (no fit) trains on the same rates and, with the same seed and data, the same losses."""
    fitted_dir, steps_dir = tmp_path / "fitted", tmp_path / "steps"
    common = ("--warmup_steps", "4", "--lr_scheduler_type", "cosine", "--save_strategy", "no")
    train_main(cli_args(tiny, fitted_dir, *common, "--max_steps", "100000", "--max_train_seconds", "6",
                        "--fit_schedule_to_time", "true"))
    state = json.loads((fitted_dir / "trainer_state.json").read_text())
    fitted = state["stateful_callbacks"]["FittedSchedule"]["attributes"]["steps"]
    assert 4 < fitted < 100000 and state["global_step"] <= fitted
    rates = {h["step"]: h["learning_rate"] for h in state["log_history"] if "learning_rate" in h}
    if state["global_step"] == fitted:  # stopped by the fit, not by the time limit (a step run long over its plan)
        # the last step ran at the schedule's last rate before zero (a log entry carries the rate its step used)
        assert rates[fitted] == pytest.approx(3e-3 * schedule_factor(fitted - 1, 4, fitted, "cosine"), rel=1e-6)
        assert schedule_factor(fitted, 4, fitted, "cosine") == 0.0
    train_main(cli_args(tiny, steps_dir, *common, "--max_steps", str(fitted), "--stop_at_step",
                        str(state["global_step"])))
    again = json.loads((steps_dir / "trainer_state.json").read_text())
    assert {h["step"]: h["learning_rate"] for h in again["log_history"] if "learning_rate" in h} == rates
    assert logged_losses(steps_dir) == logged_losses(fitted_dir)


def test_config_overrides_shape_a_fresh_drafter(tiny, tmp_path):
    from angelspec_hf.modeling import DFlyConfig

    assert parse_config_overrides("use_ar_head=false, num_hidden_layers=2,hidden_act=silu", DFlyConfig) == {
        "use_ar_head": False, "num_hidden_layers": 2, "hidden_act": "silu"}
    with pytest.raises(ValueError, match="no field 'use_ar_heads'"):
        parse_config_overrides("use_ar_heads=false", DFlyConfig)
    with pytest.raises(ValueError, match="key=value"):
        parse_config_overrides("use_ar_head", DFlyConfig)
    train_main(cli_args(tiny, tmp_path / "run", "--max_steps", "1", "--save_strategy", "no",
                        "--config_overrides", "use_ar_head=false,use_layer_fusion=false"))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["use_ar_head"] is False and config["use_layer_fusion"] is False
    with pytest.raises(ValueError, match="init_drafter"):
        train_main(cli_args(tiny, tmp_path / "again", "--max_steps", "1", "--init_drafter", str(tmp_path / "run"),
                            "--config_overrides", "use_ar_head=false"))
    # a trained drafter warm-starts a deeper one: the new layers are trained and saved
    train_main(cli_args(tiny, tmp_path / "deeper", "--max_steps", "2", "--init_drafter", str(tmp_path / "run"),
                        "--num_drafter_layers", "3"))
    deeper = angelspec_hf.load_drafter(str(tmp_path / "deeper"))
    assert deeper.config.num_hidden_layers == 3 and deeper.layers[2].self_attn.o_proj.weight.any()
    # a fresh DFly takes its AR head's width from the flag; a trained one is widened to it, and the new units train
    train_main(cli_args(tiny, tmp_path / "head", "--max_steps", "1", "--save_strategy", "no",
                        "--ar_head_intermediate_size", "24"))
    train_main(cli_args(tiny, tmp_path / "wider", "--max_steps", "2", "--init_drafter", str(tmp_path / "head"),
                        "--ar_head_intermediate_size", "40"))
    assert angelspec_hf.load_drafter(str(tmp_path / "head")).config.ar_head_intermediate_size == 24
    wider = angelspec_hf.load_drafter(str(tmp_path / "wider"))
    assert wider.config.ar_head_intermediate_size == 40 and wider.ar_head.down_proj.weight[:, 24:].any()
    mtp = cli_args(tiny, tmp_path / "mtp", "--max_steps", "1", "--ar_head_intermediate_size", "24")
    mtp[mtp.index("--drafter_type") + 1] = "mtp"
    with pytest.raises(ValueError, match="no AR head"):
        train_main(mtp)


ACCELERATE_CPU_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_CPU
num_processes: 2
num_machines: 1
machine_rank: 0
mixed_precision: 'no'
use_cpu: true
mpirun_config:
  mpirun_hostfile: {hostfile}
"""


@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_two_processes_match_one(tiny, tmp_path, launcher):
    """2 processes (gloo) with a split global batch give the 1-process loss trajectory. On CPU, `accelerate launch`
    starts its processes through mpirun (Debian openmpi-bin, installed by `make test`)."""
    common = ["--max_steps", "4", "--save_strategy", "no", "--accelerator_config", '{"split_batches": true}']
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run([sys.executable, "-m", "angelspec_hf.trainer.run", *cli_args(tiny, one, *common)], check=True,
                   capture_output=True, timeout=900)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if launcher == "torchrun":
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533"]
    else:
        (tmp_path / "hostfile").write_text("localhost slots=2\n")
        (tmp_path / "accelerate.yaml").write_text(ACCELERATE_CPU_CONFIG.format(hostfile=tmp_path / "hostfile"))
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "accelerate.yaml")]
    run = subprocess.run([*launch, "-m", "angelspec_hf.trainer.run", *cli_args(tiny, two, *common)],
                         capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "- processes: 2" in (two / "README.md").read_text()
    a, b = logged_losses(one), logged_losses(two)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4)


@pytest.mark.real_model
def test_short_real_run_on_embedded_target(tmp_path):
    out = tmp_path / "real"
    data = os.path.join(REPO, "data", "regenerated", "smollm2-135m-instruct")
    train_main(["--regenerated_dir", data, "--train_sets", "gsm8k", "--output_dir", str(out), "--drafter_type",
                "dfly", "--max_steps", "2", "--per_device_train_batch_size", "2", "--max_seq_length", "256", "--max_train_samples", "8",
                "--report_to", "none", "--use_cpu", "true", "--save_strategy", "no", "--logging_steps", "1"])
    drafter = angelspec_hf.load_drafter(out)
    target, tokenizer = angelspec_hf.load_default_target()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 * 7?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    kw = dict(max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, **kw), target.generate(ids, assistant_model=drafter, **kw))


def test_trainer_api_imports_from_the_package_without_weighing_on_angelspec_hf():
    import subprocess
    import sys

    code = ("import sys, angelspec_hf; assert 'angelspec_hf.trainer.trainer' not in sys.modules; "
            "from angelspec_hf.trainer import DrafterTrainer, DrafterTrainingArguments; "
            "from transformers import Trainer, TrainingArguments; "
            "assert issubclass(DrafterTrainer, Trainer) and issubclass(DrafterTrainingArguments, TrainingArguments)")
    subprocess.run([sys.executable, "-c", code], check=True)
