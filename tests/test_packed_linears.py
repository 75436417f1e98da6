"""The engine's packed linear layers (generator.engine.packed): the same products to the bit, only where they apply."""

import pytest
import torch

from generator.engine import Engine, SamplingSettings, inference_copy
from generator.engine.packed import _ops_available, pack_linears, packing_helps

needs_ops = pytest.mark.skipif(not _ops_available(), reason="this torch build has no oneDNN bf16 linear")


def _llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, initializer_range=0.5, tie_word_embeddings=True, pad_token_id=0,
                      eos_token_id=1, bos_token_id=2)
    return LlamaForCausalLM(cfg)


@needs_ops
def test_a_packed_copy_gives_the_plain_copys_logits_and_tokens_to_the_bit(monkeypatch, varied_lm):
    model, tok = varied_lm
    monkeypatch.setenv("MIMESIS_CPU_PACK", "0")
    plain = inference_copy(model, "bf16")
    monkeypatch.setenv("MIMESIS_CPU_PACK", "1")
    packed = inference_copy(model, "bf16")
    linears = [n for n, m in plain.named_modules() if type(m) is torch.nn.Linear]
    assert len(linears) == 2 * 7 + 1  # every projection of both layers and the output layer
    assert all(type(packed.get_submodule(n)).__name__ == "PackedLinear" for n in linears)
    assert packed.get_output_embeddings().weight is packed.get_input_embeddings().weight  # tied: shared, not copied
    assert not hasattr(packed.model.layers[0].mlp.up_proj, "weight")  # untied: only the packed form is kept
    ids = torch.randint(3, len(tok), (3, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        a, b = plain(input_ids=ids).logits, packed(input_ids=ids).logits  # 27 rows at once, 3 x 9 at the head
        assert torch.equal(a, b) and a.abs().sum() > 0
        a1, b1 = plain(input_ids=ids[:1, :1]).logits, packed(input_ids=ids[:1, :1]).logits  # one row
        assert torch.equal(a1, b1)
    s = SamplingSettings(temperature=1.0, max_new_tokens=6)
    prompts = [tok.encode(t) for t in ("hi there", "a longer prompt than the first one", "ok")]
    want = Engine(plain, tok, batch_size=3, precision="bf16").complete(prompts, s, seed=3)
    got = Engine(packed, tok, batch_size=3, precision="bf16").complete(prompts, s, seed=3)
    assert [c.ids for c in got] == [c.ids for c in want]


def test_packing_leaves_fp32_trainable_and_declined_models_alone(monkeypatch):
    monkeypatch.setenv("MIMESIS_CPU_PACK", "1")
    fp32 = _llama().eval().requires_grad_(False)
    assert pack_linears(fp32) == 0 and type(fp32.lm_head) is torch.nn.Linear
    trainable = _llama().to(torch.bfloat16)  # parameters still require grad: a model being trained
    assert pack_linears(trainable) == 0 and type(trainable.lm_head) is torch.nn.Linear
    monkeypatch.setenv("MIMESIS_CPU_PACK", "0")
    frozen = _llama().to(torch.bfloat16).requires_grad_(False)
    assert not packing_helps() and pack_linears(frozen) == 0
    assert inference_copy(_llama(), "fp32").lm_head.__class__ is torch.nn.Linear


@needs_ops
def test_the_packing_probe_measures_when_not_told(monkeypatch):
    from generator.engine import packed as mod

    monkeypatch.delenv("MIMESIS_CPU_PACK", raising=False)
    mod._measured_gain.cache_clear()
    gain = mod._measured_gain()
    assert gain > 0 and packing_helps() == (gain >= mod.PACK_MIN_GAIN)
    assert mod._measured_gain() == gain  # once per process
