"""The scale-out presets are valid without the hardware they target: every configs/accelerate/*.yaml goes through
accelerate's own config loader and `accelerate launch` argument resolution, and the environment that launch would
give the training processes builds accelerate's DeepSpeed / FSDP plugin objects (DeepSpeed itself need not be
installed for that); configs/mimesis-9b.yaml parses with the main job's parser. No GPU, DeepSpeed or vLLM needed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
ACC = ROOT / "configs" / "accelerate"
GPU_PRESETS = {"multi_gpu.yaml": "MULTI_GPU", "zero2.yaml": "DEEPSPEED", "zero3.yaml": "DEEPSPEED", "fsdp2.yaml": "FSDP"}
CPU_PRESETS = {"cpu.yaml": 1, "cpu2.yaml": 2}


def resolve_launch(path: Path):
    """What `accelerate launch --config_file PATH script.py` resolves: (args, cluster config, env of the children)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    if args.use_deepspeed:
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    elif args.use_fsdp or args.multi_gpu:
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    return args, defaults, {k: v for k, v in env.items() if os.environ.get(k) != v}


def test_every_preset_is_known():
    assert sorted(p.name for p in ACC.glob("*.yaml")) == sorted({**GPU_PRESETS, **CPU_PRESETS})


@pytest.mark.parametrize("name", sorted({**GPU_PRESETS, **CPU_PRESETS}))
def test_loads_with_accelerate_and_has_no_unknown_keys(name):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    cfg = load_config_from_file(str(ACC / name))  # raises on keys accelerate does not know
    assert isinstance(cfg, ClusterConfig)
    # keys nested under deepspeed_config / fsdp_config are copied onto the launch arguments by name: a misspelt one
    # would be ignored silently, so each must be an argument `accelerate launch` knows
    known = {a.dest for a in launch_command_parser()._actions}
    raw = yaml.safe_load((ACC / name).read_text())
    for section in ("deepspeed_config", "fsdp_config"):
        for key in raw.get(section, {}) or {}:
            assert key in known, f"{name}: {section}.{key} is not an accelerate launch argument"


@pytest.mark.parametrize("name,kind", sorted(GPU_PRESETS.items()))
def test_gpu_presets_resolve_to_their_engine(name, kind):
    args, defaults, env = resolve_launch(ACC / name)
    assert str(defaults.distributed_type).endswith(kind)
    assert args.num_processes >= 2 and args.mixed_precision == "bf16" and not args.use_cpu
    if kind == "DEEPSPEED":
        from accelerate.utils import DeepSpeedPlugin, patch_environment

        with patch_environment(**env):
            plugin = DeepSpeedPlugin()
        stage = 3 if name == "zero3.yaml" else 2
        zero = plugin.deepspeed_config["zero_optimization"]
        assert plugin.zero_stage == stage and zero["stage"] == stage
        assert zero["offload_optimizer"]["device"] == "none" and zero["offload_param"]["device"] == "none"
        # the job's GRPOConfig decides accumulation and clipping ("auto"), so they cannot disagree with it
        assert plugin.deepspeed_config["gradient_accumulation_steps"] == "auto"
        if stage == 3:  # saving must gather full 16-bit weights, or OUTPUT_DIR/best holds only ZeRO shards
            assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    if kind == "FSDP":
        from accelerate.utils import FullyShardedDataParallelPlugin, patch_environment

        with patch_environment(**env):
            plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
        assert "FULL_STATE_DICT" in str(plugin.state_dict_type)  # saving gathers full weights
        # True would leave non-zero ranks' discriminator on the meta device
        assert plugin.cpu_ram_efficient_loading is False


@pytest.mark.parametrize("name,processes", sorted(CPU_PRESETS.items()))
def test_cpu_presets(name, processes):
    args, defaults, env = resolve_launch(ACC / name)
    assert args.num_processes == processes and args.mixed_precision == "no" and args.use_cpu
    if processes > 1:
        # only the torchrun launcher starts several local processes (the simple one, used by --cpu and MULTI_CPU,
        # starts one); each child then finds no GPU and forms a gloo group (see the comment in cpu2.yaml)
        assert args.multi_gpu and not args.cpu
    else:
        assert env["ACCELERATE_USE_CPU"] == "True"


@pytest.mark.distributed
def test_cpu_presets_leave_no_default_values_warning(tmp_path):
    """`accelerate launch --config_file cpu2.yaml` names every launch setting: no "had defaults used instead"."""
    script = tmp_path / "noop.py"
    script.write_text("print('ok')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in CPU_PRESETS:
        r = subprocess.run(["accelerate", "launch", "--config_file", str(ACC / name), str(script)],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "had defaults used instead" not in r.stderr, (name, r.stderr)
        assert r.stdout.count("ok") == CPU_PRESETS[name], (name, r.stdout)


def test_mimesis_9b_parses_with_the_job_parser(monkeypatch):
    """Every key of the 9B preset is checked by the job's parser; its `bf16: true` sets the run's precision (on a
    CPU too: trainer configs default to use_cpu there), and `--bf16 false` turns it to fp32."""
    from adversary.train import parse_args
    from conversations.config import ConfigError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the 9B model is a hub id: fine where the hub can serve it
    cfg, args = parse_args(["--config", str(ROOT / "configs" / "mimesis-9b.yaml")])
    assert cfg.dtype == "bf16" and args.bf16 and args.mixed_precision == "bf16"
    cfg, args = parse_args(["--config", str(ROOT / "configs" / "mimesis-9b.yaml"), "--bf16", "false"])
    assert cfg.dtype == "fp32" and not args.bf16 and args.mixed_precision == "no"
    assert cfg.model.startswith("Qwen/") and cfg.lora_r > 0
    assert args.use_vllm and args.vllm_mode == "colocate" and 0 < args.vllm_gpu_memory_utilization < 1
    assert args.gradient_checkpointing and args.ds3_gather_for_generation
    assert (args.per_device_train_batch_size * args.gradient_accumulation_steps) % args.num_generations == 0
    raw = yaml.safe_load((ROOT / "configs" / "mimesis-9b.yaml").read_text())
    assert raw["bf16"] is True
    cfg, args = parse_args(["--config", str(ROOT / "configs" / "mimesis-9b.yaml"), "--dtype", "fp32"])
    assert cfg.dtype == "fp32" and not args.bf16  # the command line over the preset
    with pytest.raises(ConfigError, match="contradicts"):
        parse_args(["--config", str(ROOT / "configs" / "mimesis-9b.yaml"), "--dtype", "fp32", "--bf16", "true"])


def test_parsing_the_9b_preset_imports_neither_engine(monkeypatch):
    """Neither vLLM nor DeepSpeed is a dependency of the CPU path: the job parses the 9B preset without importing
    them (TRL imports vLLM only when the trainer is built with use_vllm)."""
    import sys

    from adversary.train import parse_args

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = {m for m in ("vllm", "deepspeed") if m in sys.modules}
    parse_args(["--config", str(ROOT / "configs" / "mimesis-9b.yaml"), "--bf16", "false"])
    assert {m for m in ("vllm", "deepspeed") if m in sys.modules} == before


def test_gpu_check_dry_run_parses_every_path(tmp_path, monkeypatch):
    """bench/gpu_check.py --dry-run on a CPU: every path it would launch on the GPU parses its config with the job's
    own parser and then stops only for the lack of a GPU (or of vLLM / DeepSpeed), with the message the script
    expects; a broken path makes it exit 1."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: run bench/gpu_check.py itself")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run"], capture_output=True,
                       text=True, cwd=ROOT, timeout=300, env={**os.environ, "OUT": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    lines = dict(line.split(": ", 1) for line in r.stdout.strip().splitlines())
    assert set(lines) == {"install", "smoke_bf16", "demo_bf16", "vllm_colocate", "zero3", "heldout", "agent_rl", "mfu",
                          "cuda_tests"}
    assert all(v.startswith("failed ") for v in lines.values())
    assert "no GPU is visible" in lines["smoke_bf16"] and "no GPU is visible" in lines["agent_rl"]
    assert "vLLM is not installed" in lines["vllm_colocate"] and "use_vllm" in lines["vllm_colocate"]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["dry_run"] and all(c["expected"] for c in summary["checks"].values())

