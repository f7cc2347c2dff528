"""RunConfig loading: precedence CLI > file > defaults, file formats, and one-line errors that
name the file and the field."""

import json

import pytest

from zerotrain.config import Mode, RunConfig, load_config, parse_bytes
from zerotrain.errors import ZerotrainError


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_are_a_valid_run():
    run = load_config()
    assert run == RunConfig()
    assert run.model.name_or_path == "flux-dev" and run.data.resolution == 1024


def test_precedence_cli_over_file_over_defaults(tmp_path):
    path = write(tmp_path, "run.yaml", "training:\n  mode: lora\n  lora:\n    rank: 8\ndata:\n  resolution: 768\n")
    run = load_config(path, ["training.lora.rank=32"])
    assert run.training.lora.rank == 32  # CLI beats file
    assert run.data.resolution == 768  # file beats default
    assert run.training.mode is Mode.lora
    assert run.optimizer.lr == RunConfig().optimizer.lr  # default where neither says
    # The last override wins.
    assert load_config(path, ["training.lora.rank=32", "training.lora.rank=4"]).training.lora.rank == 4


@pytest.mark.parametrize("name,text", [
    ("run.json", json.dumps({"training": {"mode": "lora"}, "hardware": {"gpus": "2xH100-80GB"}})),
    ("run.toml", '[training]\nmode = "lora"\n[hardware]\ngpus = "2xH100-80GB"\n'),
    ("run.yml", "training: {mode: lora}\nhardware: {gpus: 2xH100-80GB}\n"),
])
def test_json_toml_yaml(tmp_path, name, text):
    run = load_config(write(tmp_path, name, text))
    assert run.training.mode is Mode.lora and run.hardware.gpus == "2xH100-80GB"


def test_override_values_are_parsed_as_yaml():
    run = load_config(None, ["planner.stages=[2,3]", "planner.headroom=0.2", "model.name_or_path=sdxl-base"])
    assert run.planner.stages == [2, 3] and run.planner.headroom == 0.2
    assert run.model.name_or_path == "sdxl-base"


@pytest.mark.parametrize("overrides,expected", [
    (["training.lora.rank=0"], "training.lora.rank: Input should be greater than or equal to 1 (got 0)"),
    (["training.quantize_base=qint8"], "needs mode=lora"),
    (["training.modee=lora"], "training.modee: unknown field"),
    (["hardware.gpu_memory=lots"], "hardware.gpu_memory: 'lots' is not a size"),
    (["training.micro_batch_size=0"], "training.micro_batch_size"),
    (["planner.stages=[4]"], "planner.stages.0"),
    (["training"], "write it as section.field=value"),
])
def test_bad_values_give_one_line_naming_the_field(overrides, expected):
    with pytest.raises(ZerotrainError) as err:
        load_config(None, overrides)
    message = str(err.value)
    assert expected in message
    assert "\n" not in message


def test_file_errors_name_the_file(tmp_path):
    bad = write(tmp_path, "bad.yaml", "training: [unclosed\n")
    with pytest.raises(ZerotrainError, match=r"bad\.yaml: not valid YAML"):
        load_config(bad)
    with pytest.raises(ZerotrainError, match=r"run\.yaml: config file not found"):
        load_config(tmp_path / "run.yaml")
    listing = write(tmp_path, "list.yaml", "- a\n- b\n")
    with pytest.raises(ZerotrainError, match="top level must be a mapping"):
        load_config(listing)
    wrong = write(tmp_path, "wrong.yaml", "data:\n  resolution: huge\n")
    with pytest.raises(ZerotrainError, match=r"wrong\.yaml: data\.resolution: .*got 'huge'"):
        load_config(wrong)


@pytest.mark.parametrize("text,value", [("48GiB", 48 * 2**30), ("80GB", 80 * 10**9), ("512 MiB", 512 * 2**20),
                                        (1024, 1024), ("1.5TiB", int(1.5 * 2**40))])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "48 parsecs", "-1GB", "0"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_training_config_mistakes_name_the_field(tmp_path):
    with pytest.raises(ZerotrainError, match=r"data\.datasets\.0\.path: .*nowhere does not exist"):
        load_config(None, [f"data.datasets=[{{path: {tmp_path / 'nowhere'}}}]"])
    with pytest.raises(ZerotrainError, match=r"training: lora options are set but mode=full"):
        load_config(None, ["training.lora.rank=8"])
    with pytest.raises(ZerotrainError, match=r"quantize_base=qint8 needs mode=lora"):
        load_config(None, ["training.mode=full", "training.quantize_base=qint8"])
    assert load_config(None, ["training.mode=lora", "training.lora.rank=8"]).training.lora.rank == 8


def test_the_tests_fault_injection_is_a_section_of_its_own_left_out_of_the_reference():
    """Issue 48 §9: the hooks zerotrain's tests make faults with are no setting of the user's: they live in
    `testing:`, which docs/configuration.md's generated reference leaves out, and not among faults:."""
    from zerotrain.config import load_config
    from zerotrain.config.reference import reference
    from zerotrain.config.sections import FaultsConfig

    run = load_config(None, ["testing.oom_at=[2]", "testing.kill={step: 4, point: optimizer}"])
    assert run.testing.oom_at == [2] and run.testing.kill.point == "optimizer"
    assert not [name for name in FaultsConfig.model_fields if "inject" in name]
    assert "`testing." not in reference() and "inject" not in reference()
    assert "`faults.grace_seconds`" in reference()
