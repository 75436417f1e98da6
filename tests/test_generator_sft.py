"""SFT warm start with the tiny random model: dataset format, TRL masking, every LoRA weight trained, perplexity, CLI."""

import json
import math

import pytest
import torch

from conversations import TurnRecord
from conversations.config import ConfigError
from generator.model import LoraSettings, load_generator
from generator.prompts import END_MARKER, PROMPT_FORMAT_VERSION, fit_messages
from generator.sft import (
    SFTArgs,
    build_sft_dataset,
    encode_example,
    heldout_perplexity,
    main,
    make_trainer,
    sft_example,
    sft_examples,
)

CTX = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}]
RECORDS = [
    TurnRecord(id="a#0", context=[], user_turn="how do I boil an egg?", conversation_id="a"),
    TurnRecord(id="a#2", context=CTX, user_turn="thanks, that's all", conversation_id="a", is_last=True),
    TurnRecord(id="b#2", context=CTX, user_turn="can you make it shorter", conversation_id="b"),
    TurnRecord(id="c#0", context=[], user_turn="write a haiku about rain in the city at night", conversation_id="c"),
]
SMALL = dict(max_context_tokens=96, max_length=160)


def tiny_args(tmp_path, **kw):
    """(SFTArgs, SFTConfig) of a 3-step run of the tiny model, prepared as run_sft prepares them."""
    from generator.sft import prepare_config, sft_config

    args = SFTArgs(model="tiny-random", warmup_ratio=0.0, lora_r=4, lora_alpha=8, lora_dropout=0.0, eval_turns=4,
                   max_turn_chars=200, max_context_tokens=SMALL["max_context_tokens"], dtype="fp32", **kw)
    config = sft_config(output_dir=str(tmp_path / "sft"), max_steps=3, per_device_train_batch_size=2,
                        learning_rate=1e-2, logging_steps=1, max_length=SMALL["max_length"])
    prepare_config(args, config, "cpu")
    return args, config


@pytest.fixture(scope="module")
def tok(tiny_lm_path):
    from generator.model import load_tokenizer

    return load_tokenizer(tiny_lm_path)


def test_sft_example_is_the_role_flipped_prompt_and_the_user_turn(tok):
    ex = sft_example(RECORDS[1], tok, max_context_tokens=96)
    assert ex["prompt"] == fit_messages(tok, CTX, max_context_tokens=96)
    assert ex["prompt"][-1] == {"role": "user", "content": "Hello! How can I help?"}
    assert ex["completion"] == [{"role": "assistant", "content": "thanks, that's all\n" + END_MARKER}]
    ds = build_sft_dataset(RECORDS, tok, **SMALL)
    assert ds.column_names == ["prompt", "completion"] and len(ds) == 4
    assert ds[2]["completion"][0]["content"] == "can you make it shorter"


def test_long_turns_shrink_the_prompt_not_the_turn(tok):
    long_ctx = [{"role": "user", "content": "q " * 300}, {"role": "assistant", "content": "a " * 300}]
    rec = TurnRecord(id="x", context=long_ctx, user_turn="word " * 60, is_last=True)
    ids, mask = encode_example(tok, sft_example(rec, tok, max_context_tokens=150, max_length=200))
    assert len(ids) <= 200
    assert tok.decode([t for t, k in zip(ids, mask) if k]) == "word " * 59 + "word\n" + END_MARKER + "<|im_end|>\n"
    # the system prompt alone leaves no room within 110 tokens: left out, never cut
    examples, dropped = sft_examples([rec, RECORDS[0]], tok, max_context_tokens=100, max_length=110)
    assert dropped == 1 and len(examples) == 1


def test_trl_masks_the_prompt_exactly_like_encode_example(tiny_lm_path, tok, tmp_path):
    model, tokenizer = load_generator(tiny_lm_path, lora=LoraSettings(r=4, alpha=8))
    trainer = make_trainer(*tiny_args(tmp_path), model, tokenizer, RECORDS)
    for rec, row in zip(RECORDS, trainer.train_dataset):
        ids, mask = encode_example(tok, sft_example(rec, tok, **SMALL))
        assert row["input_ids"] == ids
        assert row["labels"] == [t if k else -100 for t, k in zip(ids, mask)]
        completion = tok.decode([t for t, k in zip(ids, mask) if k])
        assert completion.startswith(rec.user_turn.rstrip()) and completion.strip().endswith("<|im_end|>")
        assert (END_MARKER in completion) == rec.is_last


def test_every_lora_parameter_changes(tiny_lm_path, tmp_path):
    torch.manual_seed(0)
    model, tokenizer = load_generator(tiny_lm_path, lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = make_trainer(*tiny_args(tmp_path), model, tokenizer, RECORDS)
    trainer.train()
    after = dict(trainer.model.named_parameters())
    trainable = [n for n, p in after.items() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    for n, p in after.items():
        changed = not torch.equal(before[n], p.detach())
        assert changed == p.requires_grad, f"{n}: changed={changed}, trainable={p.requires_grad}"


def test_heldout_perplexity_is_the_completion_loss(tiny_lm_path, tok):
    model, tokenizer = load_generator(tiny_lm_path)
    # one example: exp of the mean masked cross-entropy, as the model's own loss computes it
    ids, mask = encode_example(tok, sft_example(RECORDS[1], tok, **SMALL))
    labels = torch.tensor([[t if k else -100 for t, k in zip(ids, mask)]])
    with torch.no_grad():
        loss = model(input_ids=torch.tensor([ids]), labels=labels).loss.item()
    assert heldout_perplexity(model, tokenizer, [RECORDS[1]], **SMALL) == pytest.approx(math.exp(loss), rel=1e-4)
    # batched and left-padded: the token-weighted mean of the single-example NLLs
    singles = [heldout_perplexity(model, tokenizer, [r], **SMALL) for r in RECORDS]
    counts = [sum(encode_example(tok, sft_example(r, tok, **SMALL))[1]) for r in RECORDS]
    expected = math.exp(sum(c * math.log(p) for c, p in zip(counts, singles)) / sum(counts))
    assert heldout_perplexity(model, tokenizer, RECORDS, batch_size=3, **SMALL) == pytest.approx(expected, rel=1e-4)
    assert math.isnan(heldout_perplexity(model, tokenizer, []))


def test_sft_cli_end_to_end(tmp_path, capsys):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(
        "model: tiny-random\nmax_steps: 2\nper_device_train_batch_size: 2\nlearning_rate: 0.01\n"
        "lora_r: 4\nlora_alpha: 8\neval_turns: 4\nmax_turn_chars: 200\nmax_context_tokens: 96\nmax_length: 160\n"
    )
    metrics = main(["--config", str(cfg), "--output_dir", str(tmp_path / "out")])
    printed = json.loads(capsys.readouterr().out)  # stdout is the JSON summary and nothing else
    assert printed["ppl_after"] == pytest.approx(metrics["ppl_after"])
    assert metrics["train_steps"] == 2 and metrics["n_train"] == 4 and metrics["n_eval"] == 4
    assert math.isfinite(metrics["ppl_before"]) and math.isfinite(metrics["ppl_after"])
    info = json.loads((tmp_path / "out" / "merged" / "generator_info.json").read_text())
    assert info["prompt_format_version"] == PROMPT_FORMAT_VERSION and info["end_marker"] == END_MARKER
    # both saved forms load as a generator: the merged model, and the adapter on its base
    for d in (metrics["merged_dir"], metrics["adapter_dir"]):
        m, t = load_generator(d)
        assert t.padding_side == "left" and not any(p.requires_grad is False for p in m.parameters())
    m, _ = load_generator(metrics["adapter_dir"], lora=LoraSettings())
    assert any("lora_" in n for n, p in m.named_parameters() if p.requires_grad)


def test_sft_config_errors(tmp_path, capsys):
    from generator.sft import prepare_config, sft_config

    with pytest.raises(ConfigError, match="max_length .* must be larger than max_context_tokens"):
        prepare_config(SFTArgs(max_context_tokens=256), sft_config(max_length=200), "cpu")
    with pytest.raises(ConfigError, match="lora_r"):
        SFTArgs(lora_r=0)
    with pytest.raises(SystemExit) as e:
        main(["--learning_rate", "0", "--model", "tiny-random"])
    assert e.value.code == 2 and "learning_rate" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_stepz: 3\n")
    with pytest.raises(SystemExit) as e:
        main(["--config", str(bad)])
    assert e.value.code == 2 and "did you mean 'max_steps'" in capsys.readouterr().err


def test_sft_under_zero3_saves_the_gathered_weights_not_the_shards(tmp_path, capsys, monkeypatch):
    """Under ZeRO-3 the trained model holds shards (on an H200 the merged folder held empty weights and the next load
    failed): the saved adapter and merged model come from the gathered state dict. Stood in for on a CPU: the gather
    returns the trained weights and leaves the live model empty, as shards look from outside DeepSpeed."""
    import generator.sft as sft

    gathered = {}

    def fake_gather(trainer):
        gathered.update({k: v.detach().clone() for k, v in trainer.model_wrapped.state_dict().items()})
        for p in trainer.model.parameters():
            p.data = torch.empty(0)
        return dict(gathered)

    monkeypatch.setattr(sft, "_gathered_state", fake_gather)
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(
        "model: tiny-random\nmax_steps: 2\nper_device_train_batch_size: 2\nlearning_rate: 0.01\n"
        "lora_r: 4\nlora_alpha: 8\neval_turns: 0\nmax_turn_chars: 200\nmax_context_tokens: 96\nmax_length: 160\n"
    )
    metrics = main(["--config", str(cfg), "--output_dir", str(tmp_path / "out")])
    capsys.readouterr()
    expected, _ = load_generator("tiny-random", lora=LoraSettings(r=4, alpha=8))
    expected.load_state_dict(gathered)
    expected = expected.merge_and_unload().state_dict()
    merged, _ = load_generator(metrics["merged_dir"])
    for name, w in merged.state_dict().items():
        assert torch.equal(w, expected[name]), name
    from_adapter, _ = load_generator(metrics["adapter_dir"])  # the adapter, merged on its base at load
    for name, w in from_adapter.state_dict().items():
        assert torch.allclose(w, expected[name], atol=1e-6), name
    base, _ = load_generator("tiny-random")
    assert any(not torch.equal(w, base.state_dict()[n]) for n, w in merged.state_dict().items())  # it was trained
