"""Loading the simulator: any causal LM (embedded asset name, model id or path, or a saved LoRA adapter folder),
optionally wrapped with a fresh LoRA adapter, in a dtype that suits the device."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conversations.config import ConfigError

log = logging.getLogger(__name__)

# used when a model ships without a chat template (base models): ChatML, the format SmolLM2 uses
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")


@dataclass
class LoraSettings:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    # peft's "all-linear": every linear layer but the output head
    target_modules: Any = "all-linear"

    def __post_init__(self):
        if self.r < 1:
            raise ConfigError(f"LoRA rank r must be >= 1, got {self.r}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"LoRA dropout must be in [0, 1), got {self.dropout}")

    def to_peft(self):
        return lora_config(self.r, self.alpha, self.dropout, self.target_modules)


@dataclass
class LoraArgs:
    """The LoRA fields of every entry point that trains a causal LM (the main job, generator.sft, agent_rl.sft and
    agent_rl.train), declared once: each entry point's config inherits them, and checks their ranges with its own."""

    lora_r: int = field(default=16, metadata={
        "help": "LoRA rank (>= 1; the main job's grpo objective alone trains every parameter at 0, its warm start "
                "then still uses 16 and the rounds objectives refuse 0)."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (the update is scaled by alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={
        "help": "LoRA dropout; 0 leaves the dropout layer out (at 0.05 it took ~20% of a CPU training step of "
                "SmolLM2, py-spy, 2026-12-01)."})

    def peft_config(self):
        """peft's LoraConfig for these fields (None at r = 0)."""
        return lora_config(self.lora_r, self.lora_alpha, self.lora_dropout)


def lora_config(r: int, alpha: int, dropout: float = 0.0, target_modules="all-linear"):
    """The one place a causal-LM LoRA config is built (every linear layer but the output head by default); None for
    r = 0 (every parameter trains)."""
    if r <= 0:
        return None
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules, task_type="CAUSAL_LM")


def pick_device(device: str | None = None) -> str:
    import torch

    if device:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def training_dtype(precision: str = "auto", device: str = "cpu"):
    """Weights to train in: the precision's dtype on a GPU; fp32 master weights on a CPU, where bf16 runs as autocast
    (measured here: bf16 weights trained far slower than fp32 weights under autocast)."""
    import torch

    from conversations.precision import resolve_precision, torch_dtype

    if not str(device).startswith("cuda"):
        return torch.float32
    return torch_dtype(resolve_precision(precision, device))


def pick_dtype(dtype: Any = "auto", device: str = "cpu"):
    """Weights of a loaded model: `auto` is bf16 on a GPU that supports it (fp16 on an older one) and fp32 on a CPU
    (training weights; frozen inference copies pass `conversations.precision.inference_dtype` instead)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if dtype == "auto":
        if str(device).startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return {
        "float32": torch.float32, "fp32": torch.float32,
        "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
        "float16": torch.float16, "fp16": torch.float16,
    }[dtype]


def load_tokenizer(path: str, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    # left padding: a batch of prompts must end where generation starts
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token if tok.eos_token is not None else tok.unk_token
    if tok.chat_template is None:
        log.warning("%s has no chat template; using ChatML", path)
        tok.chat_template = CHATML_TEMPLATE
    return tok


def _adapter_base(path: Path) -> str | None:
    """The base an adapter folder was trained on (None for a plain model folder); it may itself be an adapter folder
    (`record_adapter_base`)."""
    cfg = path / "adapter_config.json"
    if not cfg.exists():
        return None
    base = json.loads(cfg.read_text()).get("base_model_name_or_path")
    if not base:
        raise ConfigError("adapter_config.json has no base_model_name_or_path", str(cfg))
    return base


def record_adapter_base(adapter_dir: str | os.PathLike, base: str | os.PathLike) -> None:
    """Point the adapter saved in `adapter_dir` at `base` when `base` is itself an adapter folder: peft records the
    plain model under the merged one, so loading the new adapter would silently drop the lower one. A plain base
    is left as peft wrote it."""
    from conversations.assets import resolve_model

    base_dir = Path(resolve_model(base))
    cfg = Path(adapter_dir) / "adapter_config.json"
    if not (base_dir.is_dir() and _adapter_base(base_dir) and cfg.exists()):
        return
    d = json.loads(cfg.read_text())
    d["base_model_name_or_path"] = str(base_dir.resolve())
    cfg.write_text(json.dumps(d, indent=2))


def load_generator(
    name_or_path: str | os.PathLike,
    lora: LoraSettings | None = None,
    dtype: Any = "auto",
    device: str | None = None,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
):
    """(model, tokenizer). `name_or_path`: an embedded asset (`smollm2-135m-instruct`, `tiny-random`), a model id, a
    model folder, or a LoRA adapter folder saved by `generator.sft` (its base is loaded and the adapter merged, or kept
    trainable when `lora` is given). With `lora` and a plain model, a fresh adapter is added."""
    from transformers import AutoModelForCausalLM

    from conversations.assets import NO_HUB_KERNELS, resolve_model, whole_weights

    path = resolve_model(name_or_path)
    device = pick_device(device)
    torch_dtype = pick_dtype(dtype, device)
    adapter_base = _adapter_base(Path(path)) if Path(path).is_dir() else None
    base_path = resolve_model(adapter_base) if adapter_base else path
    tok_path = path if (Path(path) / "tokenizer_config.json").exists() else base_path

    from conversations.assets import load_error

    try:
        tokenizer = load_tokenizer(tok_path, trust_remote_code)
        if adapter_base and Path(base_path).is_dir() and _adapter_base(Path(base_path)):
            # an adapter trained on top of another (agent GRPO after protocol SFT): the lower one merged first
            model, _ = load_generator(base_path, dtype=dtype, device="cpu", trust_remote_code=trust_remote_code)
        else:
            with whole_weights():  # under ZeRO-3 the trainer's `prepare` partitions it, not the load
                model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch_dtype,
                                                             trust_remote_code=trust_remote_code, **NO_HUB_KERNELS)
    except (OSError, ValueError) as e:  # no network, no such repo, a folder that is not a causal LM
        raise load_error("model", str(name_or_path), e) from None
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id

    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
        if adapter_base or lora is not None:
            # frozen embeddings give checkpointed blocks inputs without grad; LoRA weights would get none
            model.enable_input_require_grads()

    if adapter_base:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path, is_trainable=lora is not None)
        if lora is None:
            model = model.merge_and_unload()  # plain model: faster generation
            for p in model.parameters():  # as from_pretrained leaves a plain model: every weight trainable
                p.requires_grad_(True)
        else:
            log.info("continuing to train the adapter in %s (the given LoRA settings are not used)", path)
    elif lora is not None:
        from peft import get_peft_model

        model = get_peft_model(model, lora.to_peft())
    model.to(device)
    return model, tokenizer


# attention for training on a CPU: eager's backward beat sdpa's CPU flash kernel by 13% on SmolLM2 at our lengths
# (8 x 160 tokens, bf16 autocast); its (B, H, T, T) scores are small below ~512 tokens (docs/benchmarks.md)
CPU_TRAIN_ATTENTION = "eager"
CPU_TRAIN_ATTENTION_MAX_LENGTH = 512


def set_attention(model, implementation: str) -> bool:
    """Switch `model`'s attention implementation (transformers' `set_attn_implementation`); False, leaving it as it
    was, for a model without the switch or an architecture without that implementation."""
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        return False
    try:
        setter(implementation)
    except (ValueError, ImportError) as e:
        log.info("attention left as %s: %s", getattr(model.config, "_attn_implementation", "?"), e)
        return False
    return True


def prepare_training(model, device: str = "cpu", max_length: int | None = None):
    """What training `model` on `device` needs beyond the libraries' defaults (returns it). On a CPU:
    - eager attention (`CPU_TRAIN_ATTENTION`) when sequences stay under `CPU_TRAIN_ATTENTION_MAX_LENGTH`; the engine
      switches back to sdpa while it decodes, where sdpa is faster (generator.engine);
    - TRL's fused LM head scores only the labelled positions (`compact_fused_lm_head`), its tiles folded by
      `generator.cpu_lm_head.lean_cpu_tiles` (the same values, fewer passes).
    Nothing changes on a GPU."""
    if str(device).startswith("cuda"):
        return model
    if max_length is None or max_length <= CPU_TRAIN_ATTENTION_MAX_LENGTH:
        set_attention(model, CPU_TRAIN_ATTENTION)
    compact_fused_lm_head()
    from generator.cpu_lm_head import lean_cpu_tiles

    lean_cpu_tiles()
    return model


def compact_fused_lm_head() -> bool:
    """Make TRL's fused LM head (SFTTrainer's loss, GRPOTrainer's log-probs) score only the positions that have a
    label on a CPU, as it already does on Triton devices. Without Triton it scores every position, the prompt's
    included, folding (tokens x 32k) tiles with torch ops and fp32 gradient matmuls: 1.5 s of a 3.4 s SFT step of
    SmolLM2 here, for a loss on the ~25% of tokens that are the user's turn. TRL picks the layout with its private
    `_use_triton`, so this wraps that name in `trl.trainer.utils` (the tiles themselves keep TRL's own choice); a
    TRL without it is left alone (returns False). Idempotent; process-wide."""
    try:
        import trl.trainer.utils as tu
    except ImportError:
        return False
    original = getattr(tu, "_use_triton", None)
    if original is None or not hasattr(tu, "add_fused_lm_head"):
        return False
    if getattr(original, "_compact_on_cpu", False):
        return True

    def use_compact(device):
        return device.type == "cpu" or original(device)

    use_compact._compact_on_cpu = True
    tu._use_triton = use_compact
    return True


def count_trainable(model) -> tuple[int, int]:
    """(trainable, total) parameters of any model (peft's `get_nb_trainable_parameters` exists on a PeftModel only)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def check_vllm(use_vllm: bool) -> None:
    """`use_vllm: true` (TRL's GRPO generation through vLLM) needs vLLM and a GPU: say so up front, in one line,
    instead of an ImportError from inside the trainer's constructor."""
    if not use_vllm:
        return
    import importlib.util

    import torch

    missing = []
    if importlib.util.find_spec("vllm") is None:
        missing.append("vLLM is not installed (pip install -e '.[gpu]')")
    if not torch.cuda.is_available():
        missing.append("no GPU is visible")
    if missing:
        raise ConfigError(f"use_vllm: true, but {' and '.join(missing)}; run with --use_vllm false to generate with "
                          "transformers")
