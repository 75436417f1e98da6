import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

from conversations.assets import is_asset, resolve_model
from conversations.schema import DataError


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


def test_hub_ids_pass_through_online_and_are_refused_offline(monkeypatch):
    import conversations.assets as assets

    monkeypatch.setattr(assets, "_in_hub_cache", lambda name: False)  # an empty local cache
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert not is_asset("Qwen/Qwen3-8B")
    assert resolve_model("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"  # the hub may still serve it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="'Qwen/Qwen3-8B' is not an embedded asset, not a local folder and not in the"):
        resolve_model("Qwen/Qwen3-8B")
    with pytest.raises(DataError, match="no such local folder"):
        resolve_model("/some/path")


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


def test_whole_weights_hides_a_zero3_config_while_loading():
    """Under ZeRO-3 transformers loads inside zero.Init; whole_weights turns that off for the block and restores it."""
    from transformers.integrations import deepspeed as hf_ds

    from conversations.assets import whole_weights

    class Zero3Config:  # stands in for HfTrainerDeepSpeedConfig (DeepSpeed is not installed on the CPU machines)
        def is_zero3(self):
            return True

    cfg = Zero3Config()
    hf_ds.set_hf_deepspeed_config(cfg)
    try:
        assert hf_ds.is_deepspeed_zero3_enabled()
        with whole_weights():
            assert not hf_ds.is_deepspeed_zero3_enabled()
        assert hf_ds.is_deepspeed_zero3_enabled()
        with pytest.raises(RuntimeError), whole_weights():  # restored on errors too
            raise RuntimeError("load failed")
        assert hf_ds.is_deepspeed_zero3_enabled()
    finally:
        hf_ds.unset_hf_deepspeed_config()


def test_models_never_wrapped_by_deepspeed_load_whole_under_zero3(tiny_lm_path):
    """With a ZeRO-3 config present, a plain from_pretrained goes through zero.Init (here: needs DeepSpeed, absent);
    the generator loader, the discriminator and the frozen-export loader load whole weights instead."""
    from transformers.integrations import deepspeed as hf_ds

    from discriminator.neural import NeuralDetector
    from generator.model import load_generator

    class Zero3Config:
        def is_zero3(self):
            return True

    cfg = Zero3Config()
    hf_ds.set_hf_deepspeed_config(cfg)
    try:
        with pytest.raises(ImportError):  # proves the config is live: zero.Init was attempted
            AutoModelForCausalLM.from_pretrained(tiny_lm_path)
        model, _ = load_generator("tiny-random")
        assert all(p.numel() > 0 for p in model.parameters())  # whole, not partitioned
        NeuralDetector("tiny-random-encoder")
    finally:
        hf_ds.unset_hf_deepspeed_config()


def test_our_loaders_never_turn_on_hub_kernels(tiny_lm_path, tiny_encoder_path):
    """transformers 5 with `kernels` installed kernelizes by default, and on a GPU `train()` then fetches kernels from
    the hub; our loaders turn that off (the plain load, the control here, has it on whenever `kernels` is installed)."""
    import importlib.util

    from discriminator.neural import NeuralDetector
    from generator.model import LoraSettings, load_generator

    if importlib.util.find_spec("kernels") is not None:
        assert AutoModelForCausalLM.from_pretrained(tiny_lm_path).use_kernels is True
    model, _ = load_generator(tiny_lm_path)
    assert model.use_kernels is False
    model.train()  # where the H200 run failed: train() re-kernelizes a model loaded with kernels on
    assert model.use_kernels is False
    peft_model, _ = load_generator(tiny_lm_path, lora=LoraSettings(r=4, alpha=8))
    assert peft_model.get_base_model().use_kernels is False
    assert NeuralDetector(tiny_encoder_path, device="cpu").model.use_kernels is False


def test_before_another_trainer_clears_only_a_deepspeed_accelerator_state():
    """Under DeepSpeed accelerate refuses a second Accelerator made with a plugin (every Trainer brings its own): the
    shared AcceleratorState is cleared before the next trainer, the PartialState (the process group) kept; under any
    other engine nothing is touched."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    from conversations.assets import before_another_trainer

    saved, saved_partial = dict(AcceleratorState._shared_state), dict(PartialState._shared_state)
    try:
        AcceleratorState._shared_state.clear()
        other = {"distributed_type": DistributedType.MULTI_CPU, "mixed_precision": "no"}
        AcceleratorState._shared_state.update(other)
        before_another_trainer()
        assert AcceleratorState._shared_state == other
        AcceleratorState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
        PartialState._shared_state["marker"] = "kept"
        before_another_trainer()
        assert AcceleratorState._shared_state == {}
        assert PartialState._shared_state["marker"] == "kept"
    finally:
        AcceleratorState._shared_state.clear()
        AcceleratorState._shared_state.update(saved)
        PartialState._shared_state.clear()
        PartialState._shared_state.update(saved_partial)


def test_tiny_gemma3_renders_gemma_turns_and_its_engine_stops_on_end_of_turn():
    """The second model family: Gemma's turn format from the asset's template, and `<end_of_turn>` (the turn end the
    template writes) is a stop token, so a sampled turn ends where the template's turns end."""
    from generator.engine import Engine
    from generator.engine.settings import SamplingSettings, stop_token_ids
    from generator.model import load_generator

    model, tok = load_generator("tiny-random-gemma3")
    assert type(model).__name__ == "Gemma3ForCausalLM"
    text = tok.apply_chat_template([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "ok"}], tokenize=False, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe terse.\n\nhi<end_of_turn>\n<start_of_turn>model\nok<end_of_turn>\n"
                    "<start_of_turn>model\n")
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    assert tok.eos_token_id == end and end in stop_token_ids(tok, model)
    word = tok("ok", add_special_tokens=False)["input_ids"][0]
    head = torch.nn.Linear(model.config.hidden_size, len(tok), bias=True)  # <end_of_turn> the likeliest, then "ok"
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[end], head.bias[word] = 10.0, 5.0
    model.lm_head = head
    # the first token cannot stop (min_new_tokens 1), the second does
    out = Engine(model, tok).complete_texts([text], SamplingSettings(max_new_tokens=5, temperature=0))[0]
    assert out.ids == [word, end] and out.stopped and out.stop_id == end and out.text == "ok"
