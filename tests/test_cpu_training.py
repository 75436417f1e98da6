"""What training on a CPU changes beyond the libraries' defaults (`generator.model.prepare_training`), the inference
copy the engine decodes with, and the GRPO rollouts through the engine (seconds each, tiny random models)."""

import pytest
import torch

from conversations.config import ConfigError
from adversary.rollout import EngineRollout
from generator.engine import Engine, SamplingSettings, inference_copy
from generator.model import compact_fused_lm_head, load_generator, prepare_training


def _llama(vocab: int = 64, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5, tie_word_embeddings=True,
                      pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return LlamaForCausalLM(cfg)


def test_compact_fused_head_gives_the_loss_and_gradients_of_the_full_one(monkeypatch):
    """TRL's fused LM head over the labelled positions only (what `compact_fused_lm_head` turns on for a CPU) gives
    the loss and gradients of its every-position layout."""
    import trl.trainer.utils as tu
    from trl.trainer.utils import add_fused_lm_head

    from trl.kernels.chunked_logprob import _use_triton as trl_choice

    # TRL's own choice for the first pass (an earlier test may have patched it: it is process-wide); restored after
    monkeypatch.setattr(tu, "_use_triton", trl_choice)
    ids = torch.randint(3, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :8] = -100  # the prompt: no loss
    labels[2, 8:] = -100  # a row without any label

    def loss_and_grads():
        model = _llama()
        add_fused_lm_head(model)
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        out.loss.backward()
        return out.loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    full_loss, full_grads = loss_and_grads()
    assert tu._use_triton(torch.device("cpu")) is False  # TRL's layout on a CPU: every position
    assert compact_fused_lm_head() and compact_fused_lm_head()  # idempotent
    assert tu._use_triton(torch.device("cpu")) is True
    compact_loss, compact_grads = loss_and_grads()
    assert torch.allclose(full_loss, compact_loss, atol=1e-6)
    assert len(full_grads) == len(compact_grads) > 0
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(full_grads, compact_grads))


def test_inference_copy_runs_its_own_weights_not_a_patched_forward():
    """A forward patched onto the instance (TRL's fused head, accelerate's autocast wrapper) closes over the original
    model: the copy must not run through it, or the engine would decode the training weights."""
    from trl.trainer.utils import add_fused_lm_head

    model = _llama()
    add_fused_lm_head(model)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    copy = inference_copy(model, "fp32")
    with torch.no_grad():
        before = copy(input_ids=ids).logits
        for p in model.parameters():
            p.zero_()  # the original changes; the copy must not see it
        after = copy(input_ids=ids).logits
    assert "forward" not in copy.__dict__
    assert torch.equal(before, after) and before.abs().sum() > 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_inference_copy_merges_lora_exactly_as_peft_and_leaves_the_original(dtype, monkeypatch):
    """The copy is made in its dtype as it is copied (no full-precision copy first), LoRA merged per layer: every
    weight equals peft's `merge_and_unload` followed by the cast, the tied embedding stays tied, the original keeps
    its adapter and its weights. (Packing off: the packed layers have no dense weights to compare; their products
    are tests/test_packed_linears.py's.)"""
    import copy as copylib

    monkeypatch.setenv("MIMESIS_CPU_PACK", "0")

    from peft import get_peft_model

    from generator.model import lora_config

    model = get_peft_model(_llama(), lora_config(4, 8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)  # lora_B starts at zero: a merge of nothing would pass trivially
    before = {k: v.clone() for k, v in model.state_dict().items()}
    frozen = inference_copy(model, dtype)
    want = copylib.deepcopy(model).merge_and_unload().to(frozen.dtype)
    got, ref = frozen.state_dict(), want.state_dict()
    assert frozen.dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
    assert got.keys() == ref.keys() and not any("lora_" in k for k in got)
    assert all(torch.equal(got[k], ref[k]) for k in got)
    assert any(not torch.equal(got[k].float(), before["base_model.model." + k.replace(".weight", ".base_layer.weight")].float())
               for k in got if k.endswith("q_proj.weight"))  # the adapter was merged in
    assert frozen.get_output_embeddings().weight is frozen.get_input_embeddings().weight
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any(p.requires_grad for p in frozen.parameters())


def test_inference_copy_of_a_dora_adapter_merges_through_peft(monkeypatch):
    """Not plain LoRA (DoRA's magnitude vector): the copy falls back to peft's own merge, then the cast."""
    import copy as copylib

    monkeypatch.setenv("MIMESIS_CPU_PACK", "0")  # dense weights to compare

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    frozen = inference_copy(model, "bf16")
    want = copylib.deepcopy(model).merge_and_unload().to(torch.bfloat16).state_dict()
    got = frozen.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_prepare_training_on_a_cpu_trains_with_eager_and_the_engine_decodes_with_sdpa(tiny_lm_path):
    model, tok = load_generator(tiny_lm_path)
    assert model.config._attn_implementation == "sdpa"
    prepare_training(model, "cpu", max_length=4096)  # long sequences: eager's (B, H, T, T) scores would not pay
    assert model.config._attn_implementation == "sdpa"
    prepare_training(model, "cpu", max_length=256)
    assert model.config._attn_implementation == "eager"
    seen = []
    model.model.layers[0].register_forward_hook(lambda m, a, o: seen.append(model.config._attn_implementation))
    rows = [tok("hello there", add_special_tokens=False)["input_ids"]] * 2
    Engine(model, tok, batch_size=2).complete(rows, SamplingSettings(max_new_tokens=3, temperature=0))
    assert seen and set(seen) == {"sdpa"}
    assert model.config._attn_implementation == "eager"  # restored for training
    assert inference_copy(model).config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == "eager"


def test_prepare_training_leaves_a_gpu_model_alone():
    model = _llama()
    prepare_training(model, "cuda:0", max_length=128)
    assert model.config._attn_implementation != "eager"


def test_engine_rollout_settings_follow_the_grpo_config():
    from trl import GRPOConfig

    args = GRPOConfig(output_dir="/tmp/unused", max_completion_length=40, temperature=0.8, top_p=0.9, top_k=5,
                      generation_kwargs={"min_new_tokens": 3}, use_cpu=True, report_to="none")
    s = EngineRollout.settings_from(args)
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.min_new_tokens) == (40, 0.8, 0.9, 5, 3)
    args.repetition_penalty = 1.2
    with pytest.raises(ConfigError, match="grpo_rollout: trl"):
        EngineRollout.settings_from(args)


def test_engine_rollout_returns_one_completion_per_prompt_and_widens_the_stops(tiny_lm_path):
    """A GRPO step of TRL with the engine's rollout: every repeated prompt gets its own completion, tokenized as TRL
    tokenizes plain-text prompts, and the trainer reads every engine stop token as an end of turn."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from generator.engine import stop_token_ids

    model, tok = load_generator(tiny_lm_path)
    args = GRPOConfig(output_dir="/tmp/engine_rollout_test", max_steps=1, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=5, use_cpu=True, report_to="none", logging_steps=1,
                      save_strategy="no", disable_tqdm=True)
    rollout = EngineRollout(tok, EngineRollout.settings_from(args), precision="fp32", batch_size=8, seed=0)
    data = Dataset.from_list([{"prompt": "hello there"}, {"prompt": "book a table"}])
    seen = {}

    def reward(prompts, completions, **k):
        seen["n"] = len(completions)
        return [float(len(c)) for c in completions]

    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=data, processing_class=tok,
                          rollout_func=rollout)
    rollout.widen_stops(trainer)
    assert set(stop_token_ids(tok, model)) <= set(trainer.eos_token_ids)
    out = rollout(["hello there"] * 2 + ["book a table"] * 2, trainer)
    assert out["prompt_ids"] == tok(text=["hello there"] * 2 + ["book a table"] * 2)["input_ids"]
    assert len(out["completion_ids"]) == 4 and all(1 <= len(c) <= 5 for c in out["completion_ids"])
    assert out["logprobs"] is None
    trainer.train()
    assert seen["n"] == 4
