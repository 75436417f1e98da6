import json
import os
import stat
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from adversary.export import ExportError, export_frozen, load_frozen, verify_export


@pytest.fixture
def exported(tmp_path, tiny_lm_path):
    tok = AutoTokenizer.from_pretrained(tiny_lm_path)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_lm_path),
                           LoraConfig(r=2, target_modules="all-linear", init_lora_weights=False))
    with torch.no_grad():
        expected = model(torch.tensor([[1, 2, 3]])).logits
    out = export_frozen(model, tok, tmp_path / "frozen", {"base_model": "tiny-random", "best_td": 3.0})
    return out, expected


def _verify_cli(path):
    return subprocess.run([sys.executable, "-m", "adversary.export", "verify", str(path)], capture_output=True, text=True)


def test_export_is_merged_readonly_and_verifies(exported):
    out, expected = exported
    assert verify_export(out) == []
    manifest = json.loads((out / "simulator.json").read_text())
    assert "model.safetensors" in manifest["files"] and manifest["best_td"] == 3.0
    assert not any(f.endswith(".bin") for f in manifest["files"])
    assert all(not (p.stat().st_mode & stat.S_IWUSR) for p in out.iterdir() if p.is_file())
    # merged: plain transformers loads it and gives the adapted model's outputs
    plain = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(plain(torch.tensor([[1, 2, 3]])).logits, expected, rtol=1e-4, atol=1e-4)
    r = _verify_cli(out)
    assert r.returncode == 0 and "OK" in r.stdout


def test_verify_fails_after_one_byte_changes(exported):
    out, _ = exported
    weights = out / "model.safetensors"
    os.chmod(weights, 0o644)
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    assert verify_export(out) == ["model.safetensors: changed (sha256 differs from the manifest)"]
    r = _verify_cli(out)
    assert r.returncode == 1 and "model.safetensors" in r.stderr
    with pytest.raises(ExportError, match="model.safetensors"):
        load_frozen(out)


def test_verify_names_missing_and_extra_files(exported):
    out, _ = exported
    os.chmod(out / "tokenizer.json", 0o644)
    os.remove(out / "tokenizer.json")
    (out / "evil.py").write_text("print(1)")
    problems = verify_export(out)
    assert "tokenizer.json: missing" in problems and "evil.py: extra file not in the manifest" in problems
    assert _verify_cli(out).returncode == 1


def test_load_frozen_returns_eval_model(exported):
    out, _ = exported
    model, tok, manifest = load_frozen(out)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert manifest["base_model"] == "tiny-random" and tok.padding_side == "left"


def test_interrupted_export_leaves_nothing_that_verifies(tmp_path, tiny_lm_path):
    tok = AutoTokenizer.from_pretrained(tiny_lm_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_path)

    class Boom(Exception):
        pass

    def broken_save(*a, **k):
        raise Boom()

    tok.save_pretrained = broken_save
    with pytest.raises(Boom):
        export_frozen(model, tok, tmp_path / "frozen", {})
    assert not (tmp_path / "frozen").exists()
    assert list(tmp_path.iterdir()) == []  # the partial folder is cleaned up
    assert verify_export(tmp_path / "frozen") != []


def test_unsealed_export_does_not_verify(exported, tmp_path):
    # a kill after the folder's rename but before the manifest's leaves the manifest under its pending name
    import shutil

    copy = tmp_path / "unsealed"
    shutil.copytree(exported[0], copy)
    os.chmod(copy, 0o755)
    os.replace(copy / "simulator.json", copy / "simulator.json.pending")
    problems = verify_export(copy)
    assert len(problems) == 1 and "interrupted before it was sealed" in problems[0]
