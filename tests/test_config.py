"""The engine's and the server's settings as configs (`EngineConfig`, `ServeConfig`): validated when built (a
`ValueError` naming the field), every field an `angelspec serve` flag with its help, a flag's value reaching the engine
that `angelspec serve` builds, and the engine's old keyword arguments still working as overrides of its config."""

import argparse
import dataclasses

import pytest
import torch

import angelspec_hf
from angelspec_hf.cli import build_parser, config_from_args, main
from angelspec_hf.tgi_patch.engine import EngineConfig, SamplingParams, SpeculativeEngine
from angelspec_hf.tgi_patch.server.config import ServeConfig
from helpers import tiny_chat_target, tiny_drafter, tiny_target

PROMPTS = [[5, 17, 33, 8], [9, 9, 41], [12, 70, 3, 3, 51, 6], [44], [7, 30, 30, 30, 2 + 20]]


def serve_parser() -> argparse.ArgumentParser:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]


def flat_fields(cls=ServeConfig):
    for f in dataclasses.fields(cls):
        if f.name == "engine":
            yield from dataclasses.fields(EngineConfig)
        else:
            yield f


def test_engine_config_is_exported():
    assert angelspec_hf.EngineConfig is EngineConfig
    assert {f.name for f in dataclasses.fields(EngineConfig)} >= {
        "verify", "max_batch_size", "max_prefill_tokens", "kv_cache_tokens", "lookup_tokens", "probe_every",
        "measure_rates", "early_stop_drafting", "isolate_faults", "cost_model_cache"}


def test_every_field_is_a_serve_flag_with_help():
    actions = {a.dest: a for a in serve_parser()._actions}
    for f in flat_fields():
        assert f.name in actions, f"`angelspec serve` has no flag for {f.name}"
        action = actions[f.name]
        assert f"--{f.name.replace('_', '-')}" in action.option_strings
        assert f.metadata["help"].strip() and action.help.startswith(f.metadata["help"][:20].replace("%", "%%"))
    # the flag names of the CLI before the configs still parse
    old = ["--payload-limit", "5", "--max-batch-size", "2", "--kv-cache-tokens", "64", "--verify", "depth:2",
           "--max-concurrent-requests", "3", "--max-client-batch-size", "2", "--threads", "1"]
    config = config_from_args(ServeConfig, build_parser().parse_args(["serve", *old]))
    assert (config.max_payload_bytes, config.max_concurrent_requests, config.engine.kv_cache_tokens) == (5, 3, 64)


def test_flags_default_to_the_config_defaults_and_each_reaches_its_field():
    parser = build_parser()
    assert config_from_args(ServeConfig, parser.parse_args(["serve"])) == ServeConfig()
    for f in flat_fields():
        default = getattr(ServeConfig(), f.name, getattr(EngineConfig(), f.name, None))
        if isinstance(default, bool) or f.name == "early_stop_drafting":
            argv, value = [f"--no-{f.name.replace('_', '-')}" if default in (True, None) else
                           f"--{f.name.replace('_', '-')}"], default is not True and default is not None
        elif f.name == "linear_kernels":
            argv, value = ["--linear-kernels", "stock"], "stock"
        elif f.name == "verify":
            argv, value = ["--verify", "budget:5"], "budget:5"
        elif isinstance(default, (int, float)) or default is None and "min" in f.metadata:
            value = (default or 0) + 3
            argv = [f"--{f.name.replace('_', '-')}", str(value)]
        else:
            argv, value = [f"--{f.name.replace('_', '-')}", "some/where"], "some/where"
        config = config_from_args(ServeConfig, parser.parse_args(["serve", *argv]))
        got = getattr(config.engine if f.name in EngineConfig.__dataclass_fields__ else config, f.name)
        assert got == value, (f.name, argv, got)


@pytest.mark.parametrize("bad, field", [
    (dict(max_batch_size=0), "max_batch_size"), (dict(max_batch_size=2.5), "max_batch_size"),
    (dict(kv_cache_tokens=0), "kv_cache_tokens"), (dict(lookup_tokens=-1), "lookup_tokens"),
    (dict(verify="sometimes"), "verify"), (dict(verify=True), "verify"), (dict(verify=-2), "verify"),
    (dict(probe_every=0), "probe_every"), (dict(max_prefill_tokens=0), "max_prefill_tokens"),
    (dict(measure_rates="no"), "measure_rates"), (dict(early_stop_drafting=1), "early_stop_drafting"),
    (dict(cost_model_cache=3), "cost_model_cache"),
])
def test_bad_engine_settings_name_the_field(bad, field):
    with pytest.raises(ValueError, match=f"^{field} must"):
        EngineConfig(**bad)
    with pytest.raises(ValueError, match=f"^{field} must"):
        SpeculativeEngine(tiny_target(), None, **bad)


@pytest.mark.parametrize("bad, field", [
    (dict(port=-1), "port"), (dict(port=70000), "port"), (dict(max_total_tokens=1), "max_total_tokens"),
    (dict(max_concurrent_requests=0), "max_concurrent_requests"), (dict(linear_kernels="fast"), "linear_kernels"),
    (dict(graceful_shutdown_s=-1.0), "graceful_shutdown_s"), (dict(engine={"max_batch_size": 2}), "engine"),
    (dict(threads=0), "threads"),
])
def test_bad_serve_settings_name_the_field(bad, field):
    with pytest.raises(ValueError, match=f"^{field} must"):
        ServeConfig(**bad)


@pytest.mark.parametrize("argv, flag", [(["--verify", "sometimes"], "--verify"), (["--port", "70000"], "--port"),
                                        (["--lookup-tokens", "-1"], "--lookup-tokens"),
                                        (["--probe-every", "x"], "--probe-every")])
def test_cli_refuses_bad_values_naming_the_flag_before_loading(argv, flag, capsys):
    try:
        code = main(["serve", *argv])
    except SystemExit as done:  # refused by argparse itself
        code = done.code
    out, err = capsys.readouterr()
    assert code == 2 and f"argument {flag}:" in err and "loading target" not in out, err


def test_old_keyword_arguments_are_overrides_of_the_config(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter("dfly", target, lookup_tokens=6)
    old = dict(verify="depth:2", max_batch_size=3, max_prefill_tokens=50, kv_cache_tokens=100, lookup_tokens=0,
               probe_every=4, measure_rates=False, early_stop_drafting=True, isolate_faults=False,
               cost_model_cache=str(tmp_path))
    engine = SpeculativeEngine(target, drafter, **old)
    assert engine.config == EngineConfig(**old)
    assert (engine.max_batch_size, engine.max_prefill_tokens, engine.isolate_faults, engine.early_stop_drafting) == (
        3, 50, False, True)
    assert engine.policy.lookup_tokens == 0 and engine.policy.measured is None and engine.policy.probe_every == 4
    assert (engine.policy.mode, engine.policy.mode_value) == ("depth", 2)
    # a config, and a keyword that overrides one of its fields (validated again)
    base = EngineConfig(verify="full", max_batch_size=2)
    engine = SpeculativeEngine(target, drafter, base, max_batch_size=5)
    assert engine.config == dataclasses.replace(base, max_batch_size=5) and engine.policy.lookup_tokens == 6
    with pytest.raises(ValueError, match="^max_batch_size must"):
        SpeculativeEngine(target, drafter, base, max_batch_size=0)
    with pytest.raises(TypeError, match="bogus_setting"):
        SpeculativeEngine(target, drafter, verify="full", bogus_setting=1)
    with pytest.raises(TypeError, match="positional"):
        SpeculativeEngine(target, drafter, base, "full")


def test_a_config_engine_admits_its_batch_size_and_is_lossless():
    target, reference_target = tiny_target(), tiny_target()
    drafter = tiny_drafter("dfly", target)
    engine = SpeculativeEngine(target, drafter, EngineConfig(verify="depth:3", max_batch_size=3, lookup_tokens=0))
    ids = [engine.add_request(prompt, SamplingParams(max_new_tokens=12)) for prompt in PROMPTS]
    outputs = {rid: [] for rid in ids}
    events = engine.step()
    assert (engine.num_running, engine.num_waiting) == (3, 2)  # max_batch_size=3 admits 3
    for events in [events, *engine.steps()]:
        for event in events:
            outputs[event.request_id].extend(event.token_ids)
    for rid, prompt in zip(ids, PROMPTS):
        plain = reference_target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                          eos_token_id=2, pad_token_id=0)[0, len(prompt):].tolist()
        assert outputs[rid] == plain
    assert engine.stats["drafted"] > 0


def test_generate_batch_builds_its_engine_from_a_config():
    """`generate_batch(config=...)`: the engine takes the config, `verify` / `max_batch_size` given beside it override
    it, and the output stays the target's own greedy output."""
    target, reference_target = tiny_target(), tiny_target()
    drafter = tiny_drafter("dfly", target)
    config = EngineConfig(verify="full", max_batch_size=2, lookup_tokens=0)
    outputs, engine = angelspec_hf.generate_batch(target, drafter, PROMPTS, max_new_tokens=10, config=config,
                                                  return_engine=True)
    assert engine.config == config and engine.stats["drafted"] > 0
    for output, prompt in zip(outputs, PROMPTS):
        plain = reference_target.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                          eos_token_id=2, pad_token_id=0)[0, len(prompt):].tolist()
        assert output == plain
    _, other = angelspec_hf.generate_batch(target, drafter, PROMPTS[:1], max_new_tokens=2, config=config,
                                           max_batch_size=3, return_engine=True)
    assert other.config == dataclasses.replace(config, max_batch_size=3)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny target with the real tokenizer and a DFly drafter with n-gram lookups on (10 tokens), as HF folders."""
    root = tmp_path_factory.mktemp("serve-config")
    target, tokenizer = tiny_chat_target()
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    tiny_drafter("dfly", target, lookup_tokens=10).save_pretrained(root / "drafter")
    return root


def served(folders, monkeypatch, capsys, *flags):
    """`angelspec serve` on the folders with `flags`, up to where it would listen: `(app, engine)`."""
    pytest.importorskip("fastapi")
    import angelspec_hf.tgi_patch.server as server

    apps = []
    monkeypatch.setattr(server, "serve", lambda app, **kwargs: apps.append((app, kwargs)))
    assert main(["serve", "--target", str(folders / "target"), "--drafter", str(folders / "drafter"),
                 "--linear-kernels", "stock", "--threads", "1", "--verify", "full", *flags]) == 0
    capsys.readouterr()
    [(app, kwargs)] = apps
    return app, app.state.server.worker.engine, kwargs


def test_serve_flags_reach_the_engine_and_the_app(folders, monkeypatch, capsys):
    app, engine, _ = served(folders, monkeypatch, capsys)
    assert engine.config == EngineConfig(verify="full") and engine.policy.lookup_tokens == 10  # the drafter's
    app, engine, listen = served(folders, monkeypatch, capsys, "--lookup-tokens", "0", "--max-batch-size", "3",
                                 "--max-prefill-tokens", "40", "--no-isolate-faults", "--port", "8123",
                                 "--payload-limit", "5000", "--max-concurrent-requests", "7")
    assert engine.config == EngineConfig(verify="full", lookup_tokens=0, max_batch_size=3, max_prefill_tokens=40,
                                         isolate_faults=False)
    assert engine.policy.lookup_tokens == 0 and engine.scheduler.max_prefill_tokens == 40
    assert not engine.isolate_faults and listen["port"] == 8123
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_new_tokens=4))
    engine.step()
    assert (engine.num_running, engine.num_waiting) == (3, 2)
    server = app.state.server
    assert server.max_input_tokens == 40  # clamped to the engine's prefill budget
    assert server.max_concurrent_requests == server.worker.max_concurrent_requests == 7
    assert app.state.config.max_payload_bytes == 5000 and app.state.config.engine == engine.config
    info = server.info()["angelspec"]
    assert info["engine"]["max_batch_size"] == 3 and info["engine"]["lookup_tokens"] == 0 and info["verify"] == "full"


def test_create_app_takes_a_serve_config_and_keyword_limits():
    pytest.importorskip("fastapi")
    from angelspec_hf.tgi_patch.server import create_app

    target, tokenizer = tiny_chat_target()
    engine = SpeculativeEngine(target, None, verify=0, max_batch_size=2)
    app = create_app(engine, tokenizer, "tiny", ServeConfig(max_input_tokens=50, max_stop_sequences=2),
                     max_total_tokens=90)
    server = app.state.server
    assert (server.max_input_tokens, server.max_total_tokens, server.max_stop_sequences) == (50, 90, 2)
    schema = app.openapi()["components"]["schemas"]["GenerateParameters"]["properties"]
    assert schema["truncate"]["anyOf"][0]["maximum"] == 50 and schema["max_new_tokens"]["anyOf"][0]["maximum"] == 89
    with pytest.raises(TypeError, match="max_batch"):
        create_app(engine, tokenizer, "tiny", max_batch=3)
    with pytest.raises(ValueError, match="^max_stop_length must"):
        create_app(engine, tokenizer, "tiny", max_stop_length=0)
