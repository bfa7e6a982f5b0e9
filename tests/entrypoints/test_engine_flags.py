"""One list of engine arguments (jpaged.entrypoints.engine_flags): every field of ModelConfig,
CacheConfig and SchedulerConfig is a `jpaged serve` flag, an LLM(...) keyword and a YAML key of the
same name, and all three set the field to the same value. Pure Python: configs only, no model."""

import argparse
import dataclasses
import typing

import pytest
import yaml

from jpaged.config import EngineConfig, load_config
from jpaged.config.docs import attribute_docs
from jpaged.entrypoints import cli
from jpaged.entrypoints.engine_args import engine_config
from jpaged.entrypoints.engine_flags import ENGINE_ARGS, FLAG_EXCEPTIONS, FROM_MODEL, SECTIONS, engine_args_from

# Every engine argument: a value other than its default, and the other arguments its config's
# cross-field checks need with it. A new config field fails test_every_field_has_a_sample until
# it is given one here, and then has to pass every test below.
SAMPLES: dict[str, tuple[object, dict]] = {
    "dtype": ("bfloat16", {}),
    "attention_backend": ("xla", {}),
    "seed": (7, {}),
    "tensor_parallel_size": (2, {}),
    "coordinator_address": ("host0:7000", {"num_processes": 2}),
    "num_processes": (2, {"coordinator_address": "host0:7000"}),
    "process_id": (1, {"num_processes": 2, "coordinator_address": "host0:7000"}),
    "block_size": (32, {}),
    "num_blocks": (100, {}),
    "gpu_memory_utilization": (0.5, {}),
    "kv_cache_memory_bytes": (2**20, {}),
    "num_host_blocks": (0, {}),
    "watermark": (0.05, {}),
    "enable_prefix_caching": (True, {}),
    "num_host_cache_blocks": (64, {"enable_prefix_caching": True}),
    "eviction_policy": ("arc", {}),
    "max_num_seqs": (64, {}),
    "max_num_batched_tokens": (4096, {}),
    "max_model_len": (1024, {}),
    "preemption_mode": ("swap", {}),
    "policy": ("paper", {}),
    "long_prefill_token_threshold": (128, {}),
    "async_scheduling": (True, {}),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    return parser


def _parse(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(["serve", "--model", "tiny-opt", *argv])


def _argv(arguments: dict) -> list[str]:
    """The command line of engine arguments, spelled as `jpaged serve` takes them."""
    argv = []
    for name, value in arguments.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return argv


def _value(config: EngineConfig, name: str) -> object:
    return getattr(getattr(config, ENGINE_ARGS[name]), name)


def _serve_actions() -> dict[str, argparse.Action]:
    subparsers = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in subparsers.choices["serve"]._actions}


def test_every_field_has_a_sample():
    fields = {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
    assert set(ENGINE_ARGS) == fields - set(FROM_MODEL)
    assert set(SAMPLES) == set(ENGINE_ARGS)


def test_exceptions_are_real_fields_and_the_rest_are_generated():
    """FLAG_EXCEPTIONS names real fields only; every other field has a generated flag of its name."""
    section_fields = {f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    top_fields = {f.name for f in dataclasses.fields(EngineConfig) if f.name not in SECTIONS}
    assert set(FLAG_EXCEPTIONS) <= section_fields | top_fields
    assert top_fields <= set(FLAG_EXCEPTIONS)
    actions = _serve_actions()
    for key in sorted(section_fields - set(FLAG_EXCEPTIONS)):
        name = key.split(".")[1]
        assert actions[name].option_strings[0] == "--" + name.replace("_", "-"), key
        assert actions[name].default is None, f"{key}: not given must leave it to --config"


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_flag_keyword_and_yaml_key_set_the_field(name, tmp_path):
    value, companions = SAMPLES[name]
    arguments = {name: value, **companions}
    default = _value(EngineConfig(), name)
    assert value != default, f"{name}: the sample must differ from the default"

    from_flags = engine_config("tiny-opt", **engine_args_from(_parse(*_argv(arguments))))
    from_keyword = engine_config("tiny-opt", **arguments)
    sections: dict[str, dict] = {}
    for key, v in arguments.items():
        sections.setdefault(ENGINE_ARGS[key], {})[key] = v
    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump(sections))
    from_yaml = engine_config("tiny-opt", config=path)

    assert _value(from_flags, name) == value
    assert _value(from_keyword, name) == value
    assert _value(from_yaml, name) == value
    assert _value(load_config(path, EngineConfig), name) == value


def test_help_and_choices_come_from_the_fields():
    actions = _serve_actions()
    for section, cls in SECTIONS.items():
        docs = attribute_docs(cls)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            assert docs.get(field.name), f"{section}.{field.name}: no attribute docstring"
            if f"{section}.{field.name}" in FLAG_EXCEPTIONS:
                continue
            action = actions[field.name]
            assert action.help.startswith(" ".join(docs[field.name].split())), field.name
            if typing.get_origin(hints[field.name]) is typing.Literal:
                assert tuple(action.choices) == typing.get_args(hints[field.name]), field.name
    assert "--no-enable-prefix-caching" in actions["enable_prefix_caching"].option_strings


def test_flags_override_the_yaml_and_absent_flags_leave_it(tmp_path):
    path = tmp_path / "engine.yaml"
    path.write_text("cache: {enable_prefix_caching: true, watermark: 0.2}\nscheduler: {max_num_seqs: 8}\n")
    config = engine_config("tiny-opt", config=path,
                           **engine_args_from(_parse("--no-enable-prefix-caching", "--max-num-seqs", "16")))
    assert (config.cache.enable_prefix_caching, config.cache.watermark, config.scheduler.max_num_seqs) == (False, 0.2, 16)


@pytest.mark.parametrize("argv, field", [
    (["--watermark", "1.5"], "cache.watermark"),
    (["--long-prefill-token-threshold", "-1"], "scheduler.long_prefill_token_threshold"),
    (["--seed", "-1"], "model.seed"),
    (["--block-size", "24"], "cache.block_size"),
])
def test_bad_values_are_refused_naming_the_field(argv, field):
    with pytest.raises(ValueError, match=field):
        engine_config("tiny-opt", **engine_args_from(_parse(*argv)))


def test_bad_choices_and_types_are_refused_by_the_parser(capsys):
    for argv in (["--policy", "fifo"], ["--max-num-seqs", "1e3"]):
        with pytest.raises(SystemExit):
            _parse(*argv)
        assert argv[0] in capsys.readouterr().err


def test_the_speculative_config_flag_sets_a_draft_model():
    flag = '{"method": "draft_model", "model": "assets/stdlib-draft-lm", "num_speculative_tokens": 4}'
    config = engine_config("tiny-opt", **engine_args_from(_parse("--speculative-config", flag)))
    assert (config.speculative.method, config.speculative.model, config.speculative.num_speculative_tokens) == (
        "draft_model", "assets/stdlib-draft-lm", 4)
    with pytest.raises(ValueError, match="speculative.model"):
        engine_config("tiny-opt", speculative_config={"method": "draft_model", "num_speculative_tokens": 4})
