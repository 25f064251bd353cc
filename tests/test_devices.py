"""`--device` / `--dtype`: the resolvers, the loaders honouring them, every command accepting them (and refusing a GPU
this machine lacks without a traceback), CPU-only prepacking kept off other devices, and greedy identity
(speculative == plain) per device and dtype: on the CPU here, on CUDA where there is one (`gpu` marker)."""

import subprocess
import sys

import pytest
import torch
import yaml

import angelspec_hf
from angelspec_hf import bench, cli, draft_vocab
from angelspec_hf.cpu_kernels import use_linear_kernels
from angelspec_hf.devices import DeviceError, resolve_device, resolve_dtype
from angelspec_hf.identity import IdentityJudge
from angelspec_hf.shipped import drafter_for_target, shipped_or_untrained, untrained_drafter
from angelspec_hf.tgi_patch.engine import generate_batch
from angelspec_hf.trainer import run as train_run
from helpers import tiny_chat_target, tiny_drafter, tiny_target

NO_CUDA = "--device cuda: no CUDA device is available (torch.cuda.is_available() is False; this torch is a CPU build)"


@pytest.fixture
def cpu_build(monkeypatch):
    """This process as a CPU build of torch, whatever machine runs the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)


@pytest.fixture
def two_gpus(monkeypatch):
    """This process as if it saw two CUDA devices with bf16 (for the resolvers only: nothing runs on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)


def test_resolve_device(cpu_build):
    for name in (None, "auto", "AUTO", "cpu", torch.device("cpu")):
        assert resolve_device(name) == torch.device("cpu")
    with pytest.raises(DeviceError) as error:
        resolve_device("cuda")
    assert str(error.value) == NO_CUDA
    with pytest.raises(DeviceError, match="not a device name"):
        resolve_device("gpu0")


def test_resolve_device_names_what_is_missing(monkeypatch, two_gpus):
    assert resolve_device(None) == torch.device("cuda") and resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(DeviceError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\) \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    with pytest.raises(DeviceError, match="built for CUDA 12.8 but sees no GPU"):
        resolve_device("cuda")


def test_resolve_dtype(cpu_build):
    assert resolve_dtype(None, "cpu") == resolve_dtype("auto", torch.device("cpu")) == torch.float32
    for names, dtype in ((("float32", "fp32", "FP32", "torch.float32"), torch.float32),
                         (("bfloat16", "bf16", "BF16"), torch.bfloat16), (("float16", "fp16"), torch.float16)):
        for name in names:
            assert resolve_dtype(name, "cpu") == dtype
    assert resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    for bad in ("int8", "half-ish", torch.int64):
        with pytest.raises(DeviceError, match="--dtype"):
            resolve_dtype(bad, "cpu")


def test_auto_dtype_on_cuda(monkeypatch, two_gpus):
    assert resolve_dtype("auto", "cuda") == resolve_dtype(None, "cuda:1") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype(None, "cuda") == torch.float16
    assert resolve_dtype("fp32", "cuda") == torch.float32


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny target (with the real tokenizer) and a tiny DFly drafter for it, saved as HF folders."""
    root = tmp_path_factory.mktemp("saved")
    target, tokenizer = tiny_chat_target()
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    tiny_drafter("dfly", target).half().save_pretrained(root / "dfly")  # stored in fp16, as the shipped ones
    return root


def test_loaders_honour_device_and_dtype(saved, cpu_build):
    target, _ = angelspec_hf.load_target(str(saved / "target"))
    assert (target.device.type, target.dtype, target.training) == ("cpu", torch.float32, False)
    target, _ = angelspec_hf.load_target(str(saved / "target"), device="cpu", dtype="bf16")
    assert (target.device.type, target.dtype) == ("cpu", torch.bfloat16)
    assert angelspec_hf.load_drafter(str(saved / "dfly")).dtype == torch.float16  # stored dtype by default
    drafter = angelspec_hf.load_drafter(str(saved / "dfly"), device="auto", dtype="float32")
    assert (drafter.device.type, drafter.dtype, drafter.training) == ("cpu", torch.float32, False)
    # a drafter for a target follows the target's device and dtype, loaded or fresh
    for drafter in (drafter_for_target(str(saved / "dfly"), target), untrained_drafter("mtp", target),
                    shipped_or_untrained("dfly", target, folder=saved / "dfly")[0]):
        assert (drafter.device, drafter.dtype) == (target.device, torch.bfloat16)
    for load in (lambda: angelspec_hf.load_target(str(saved / "target"), device="cuda"),
                 lambda: angelspec_hf.load_drafter(str(saved / "dfly"), device="cuda")):
        with pytest.raises(DeviceError, match="no CUDA device is available"):
            load()


def test_prepacking_stays_on_the_cpu():
    """oneDNN prepacking is a CPU trick: on another device (here the meta device stands in for a GPU) `auto` keeps
    the stock kernels and an explicit `prepacked` is refused."""
    target = tiny_target().to("meta")
    assert use_linear_kernels("auto", target).startswith("stock")
    assert use_linear_kernels("stock", target).startswith("stock")
    with pytest.raises(DeviceError, match="CPU only"):
        use_linear_kernels("prepacked", target)


COMMANDS = {  # command line (without --device/--dtype) and where its function is looked up
    "generate": (["generate"], cli, "cmd_generate"),
    "regenerate": (["regenerate"], cli, "cmd_regenerate"),
    "serve": (["serve"], cli, "cmd_serve"),
    "demo": (["demo"], cli, "cmd_demo"),
    "bench": (["bench"], bench, "bench_main"),
    "prune-vocab": (["prune-vocab", "--out", "x"], draft_vocab, "cmd_prune_vocab"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_device_and_dtype(command, monkeypatch, capsys, cpu_build):
    argv, module, name = COMMANDS[command]
    seen = []
    monkeypatch.setattr(module, name, lambda args: seen.append(args) or 0)
    assert cli.main([*argv, "--device", "cpu", "--dtype", "bf16"]) == 0
    assert (seen[0].device, seen[0].dtype) == (torch.device("cpu"), torch.bfloat16)
    assert cli.main(argv) == 0 and (seen[1].device, seen[1].dtype) == (torch.device("cpu"), torch.float32)  # auto
    # refused before anything loads, with the reason and a non-zero status
    assert cli.main([*argv, "--device", "cuda"]) == 2
    assert cli.main([*argv, "--dtype", "int8"]) == 2
    assert len(seen) == 2
    err = capsys.readouterr().err
    assert f"angelspec {command}: error: {NO_CUDA}" in err and "--dtype int8: choose one of" in err


def test_train_device_sets_use_cpu(tmp_path, monkeypatch, capsys, cpu_build):
    assert train_run.use_cpu_for("cpu", None) is True and train_run.use_cpu_for("cpu", True) is True
    assert train_run.use_cpu_for("auto", None) is None and train_run.use_cpu_for(None, False) is False
    with pytest.raises(DeviceError, match="contradicts --use_cpu false"):
        train_run.use_cpu_for("cpu", False)
    seen = []
    monkeypatch.setattr(train_run, "train", lambda margs, args: seen.append((margs, args)))
    common = ["--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    assert cli.main(["train", *common, "--device", "cpu", "--dtype", "bf16"]) == 0
    margs, args = seen[-1]
    assert args.use_cpu and args.device == torch.device("cpu") and (margs.device, margs.dtype) == ("cpu", "bf16")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), "report_to": "none", "device": "cpu"}))
    assert cli.main(["train", str(recipe)]) == 0 and seen[-1][1].use_cpu
    assert cli.main(["train", *common, "--device", "cuda"]) == 2
    assert NO_CUDA in capsys.readouterr().err and len(seen) == 2


def test_train_device_on_a_gpu_machine(two_gpus):
    assert train_run.use_cpu_for("cuda", None) is False and train_run.use_cpu_for("cuda:0", False) is False
    with pytest.raises(DeviceError, match="contradicts --use_cpu true"):
        train_run.use_cpu_for("cuda", True)
    with pytest.raises(DeviceError, match="CUDA_VISIBLE_DEVICES"):
        train_run.use_cpu_for("cuda:1", None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA prints")
def test_generate_without_a_gpu_exits_cleanly():
    """The installed command as a user runs it: one line, status 2, no traceback, nothing loaded."""
    proc = subprocess.run([sys.executable, "-m", "angelspec_hf.cli", "generate", "--device", "cuda"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "angelspec generate: error: --device cuda: no CUDA device is available" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout and "loading target" not in proc.stdout


DEVICE_DTYPES = [pytest.param("cpu", dtype, id=f"cpu-{dtype}") for dtype in ("float32", "bfloat16")] + [
    pytest.param("cuda", dtype, id=f"cuda-{dtype}", marks=pytest.mark.gpu) for dtype in ("float32", "bfloat16")]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_greedy_identity_per_device_and_dtype(device, dtype):
    """Speculative == plain greedy decoding with the target and drafters on `device` in `dtype`: `generate()` with
    every family, and the batched engine (inputs built by the library, on the models' device). Exact in fp32; in bf16
    up to precision ties (`identity.py`: a verification forward may round a near-tie the other way)."""
    device, dtype = resolve_device(device), resolve_dtype(dtype, device)
    target = tiny_target().to(device, dtype)
    judge = IdentityJudge(target)

    def same(prompt, reference, other):
        verdict = judge(list(prompt), list(reference), list(other))
        return verdict["identical"] or verdict["tie"] if dtype != torch.float32 else verdict["identical"]

    ids = torch.randint(3, 99, (1, 9), generator=torch.Generator().manual_seed(0)).to(device)
    plain = target.generate(ids, max_new_tokens=16, do_sample=False)
    prompts = [[5, 7, 9], [11, 4, 3, 8, 20], [30] * 7]
    plain_batch = generate_batch(target, None, prompts, max_new_tokens=12, verify=0)
    for family in ("mtp", "dflash", "dfly"):
        drafter = tiny_drafter(family, tiny_target()).to(device, dtype)
        spec = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=drafter)
        assert spec.device == ids.device, family
        assert same(ids[0].tolist(), plain[0, 9:].tolist(), spec[0, 9:].tolist()), family
        batch = generate_batch(target, drafter, prompts, max_new_tokens=12, verify="full")
        assert all(same(p, a, b) for p, a, b in zip(prompts, plain_batch, batch)), family
