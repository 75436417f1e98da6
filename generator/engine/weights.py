"""The model the engine decodes: a frozen inference copy with any LoRA adapter merged, in the precision's dtype, made
without a transient full-precision copy (`inference_copy`); the trainer's model made ready for the engine
(`inference_model`); and the one way every caller that samples from a policy being trained goes through them:
`policy_model` (the model ready for the engine) and `policy_engine` (an `Engine` on it)."""

from __future__ import annotations


def _copied_weights(model, dtype) -> tuple[dict, bool]:
    """A `copy.deepcopy` memo that makes the copy's parameters in `dtype` as they are copied, each LoRA layer's base
    weight already merged with its active adapters (`base + delta` in the weights' own precision, then cast: what
    peft's merge followed by a cast gives): a deepcopy in fp32 first would cost the model's size again (a 1.0 GB
    transient for SmolLM2 + LoRA, 0.3 GB this way), and the hole it leaves is where the next stage's peak lands.
    Returns (memo, merged). merged is False for a model without adapters (the memo only casts); the memo is empty (a
    plain deepcopy, peft merges after it, the cast comes last: as before) for any other adapter than plain LoRA on a
    peft model (DoRA, a LoRA bias, a merged or disabled adapter, another tuner) or a weight that is not a plain
    floating-point tensor (quantized)."""
    import torch

    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        LoraLayer = ()
    memo: dict = {}
    if any(type(p) is not torch.nn.Parameter or not p.dtype.is_floating_point for p in model.parameters()):
        return memo, False
    lora = [m for m in model.modules() if LoraLayer and isinstance(m, LoraLayer)]
    adapted = bool(lora) or hasattr(model, "merge_and_unload")
    plain = adapted and bool(lora) and hasattr(model, "unload") and not getattr(model, "_disabled_adapter", False) \
        and all(not m.merged and not m.disable_adapters and not any(m.use_dora.get(a) for a in m.active_adapters)
                and not any(getattr(m, "lora_bias", {}).get(a) for a in m.active_adapters)
                and hasattr(m.get_base_layer(), "weight") for m in lora)
    if adapted and not plain:
        return memo, False
    with torch.no_grad():
        if plain:
            for m in lora:
                w = m.get_base_layer().weight
                merged = w.detach()
                for a in m.active_adapters:
                    if a in m.lora_A:
                        merged = merged + m.get_delta_weight(a).to(w.dtype)
                memo[id(w)] = torch.nn.Parameter(merged.to(dtype, copy=True), requires_grad=False)
        for p in model.parameters():
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype, copy=True), requires_grad=False)
    return memo, plain


def inference_copy(model, precision: str = "fp32"):
    """A frozen copy of `model` for the engine: any LoRA adapter merged, weights in the precision's dtype (a bf16 copy
    decodes faster than autocast over fp32 weights, which re-casts every weight at every step), eval mode. The
    original is not touched."""
    import copy

    from conversations.precision import inference_dtype

    memo, merged = _copied_weights(model, inference_dtype(precision))
    frozen = copy.deepcopy(model, memo)
    if merged:
        frozen = frozen.unload()  # the LoRA layers dropped; their base weights are the merged ones
    elif hasattr(frozen, "merge_and_unload"):
        frozen = frozen.merge_and_unload()
    for module in frozen.modules():
        # a forward patched onto the instance (TRL's fused LM head, accelerate's autocast wrapper) is a closure over
        # the *original* model: the copy would run the training weights. The copy runs its class's own forward
        module.__dict__.pop("forward", None)
    if getattr(frozen.config, "_attn_implementation", None) == "eager":
        from generator.model import set_attention

        set_attention(frozen, "sdpa")  # trained with eager on a CPU; sdpa decodes faster
    frozen = frozen.to(inference_dtype(precision)).eval().requires_grad_(False)
    from generator.engine.packed import pack_linears

    pack_linears(frozen)  # bf16 on a CPU: weights packed once, not reordered at every product (where measured faster)
    return frozen


def inference_model(model_wrapped, accelerator, *, precision: str = "fp32", merge_lora: bool = True,
                    gather_zero3: bool = True):
    """The trainer's model, ready for the engine outside TRL: unwrapped, gradient checkpointing off (TRL's
    `unwrap_model_for_generation`, which under ZeRO-3 also gathers the partitioned weights so that every rank runs
    whole layers) and, with `merge_lora` on an unsharded model, a frozen copy with any LoRA adapter merged (plain
    linear layers: LoRA's extra matmuls cost ~20% of a decoding step on a CPU) in the precision's dtype (a bf16 copy
    decodes faster than autocast over fp32 weights, which re-casts every weight at every step). The copy is dropped on
    exit; the training weights are never touched. A context manager."""
    import contextlib

    from accelerate.utils import DistributedType
    from trl.models import unwrap_model_for_generation

    @contextlib.contextmanager
    def ctx():
        sharded = accelerator.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP)
        with unwrap_model_for_generation(model_wrapped, accelerator, gather_deepspeed3_params=gather_zero3) as model:
            if merge_lora and not sharded:
                yield inference_copy(model, precision)  # + one copy of the weights while it is in use
            else:
                yield model

    return ctx()


def _is_trainer(policy) -> bool:
    return hasattr(policy, "model_wrapped") and hasattr(policy, "accelerator")


def policy_model(policy, *, precision: str = "fp32", merge_lora: bool = True, gather_zero3: bool = True):
    """The one way a policy being trained is made ready for the engine, a context manager yielding the model to
    decode. `policy` is a model or a transformers/TRL trainer:
    - a trainer: its wrapped model unwrapped for generation (`inference_model`: gradient checkpointing off, ZeRO-3
      weights gathered when `gather_zero3`), then a merged copy as below unless the model is sharded;
    - a model: with `merge_lora` a frozen copy with any LoRA adapter merged, in the precision's dtype
      (`inference_copy`); without, the model itself (no second copy of the weights: a GPU short of memory).
    The copy is made on entry (a caller may trim the heap first) and dropped on exit; the training weights are
    never touched."""
    import contextlib

    if _is_trainer(policy):
        return inference_model(policy.model_wrapped, policy.accelerator, precision=precision, merge_lora=merge_lora,
                               gather_zero3=gather_zero3)

    @contextlib.contextmanager
    def ctx():
        yield inference_copy(policy, precision) if merge_lora else policy

    return ctx()


def policy_engine(policy, tokenizer, *, precision: str = "fp32", batch_size: int = 64, merge_lora: bool = True,
                  gather_zero3: bool = True, **engine_kw):
    """An `Engine` on `policy_model(policy, ...)` (see there), a context manager: every caller that samples from a
    policy being trained (the discriminator's fit, the rounds' pairs, GRPO's and the agents' rollouts) enters the
    engine here. `engine_kw` go to `Engine` (stop_ids, share_prefix, ...). On exit the engine lets go of its model,
    so the copy is freed even where the caller's name for the engine lives on (the next stage's peak lands there)."""
    import contextlib

    from generator.engine.decode import Engine

    @contextlib.contextmanager
    def ctx():
        with policy_model(policy, precision=precision, merge_lora=merge_lora, gather_zero3=gather_zero3) as model:
            engine = Engine(model, tokenizer, batch_size=batch_size, precision=precision, **engine_kw)
            del model
            try:
                yield engine
            finally:
                engine.model = None

    return ctx()
