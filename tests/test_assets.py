import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from conversations.assets import is_asset, resolve_model


def test_tiny_random_loads_and_generates(tiny_lm_path):
    tok = AutoTokenizer.from_pretrained(tiny_lm_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_path)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3


def test_tiny_encoder_loads(tiny_encoder_path):
    model = AutoModel.from_pretrained(tiny_encoder_path)
    assert model.config.hidden_size == 32


def test_unknown_names_pass_through():
    assert not is_asset("Qwen/Qwen3-8B")
    assert resolve_model("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"
    assert resolve_model("/some/path") == "/some/path"


@pytest.mark.slow
def test_real_assets_load_offline():
    path = resolve_model("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert "<|im_start|>" in tok.chat_template
    enc = AutoModel.from_pretrained(resolve_model("minilm-l6"))
    assert enc.config.hidden_size == 384
    with torch.inference_mode():
        x = AutoTokenizer.from_pretrained(resolve_model("minilm-l6"))(["hello world"], return_tensors="pt")
        assert torch.isfinite(enc(**x).last_hidden_state).all()
