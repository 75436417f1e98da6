"""The main job's config as typed parts: every key in exactly one part, each part checked on its own, the resolved
config grouped by part and read back flat."""

import dataclasses

import pytest

from adversary.config import PARTS, AdversaryConfig, GateArgs, flat_resolved, own_fields, resolved
from conversations.config import ConfigError


def test_every_key_belongs_to_exactly_one_part():
    owned = [k for part in PARTS.values() for k in own_fields(part)] + ["lora_r", "lora_alpha", "lora_dropout"]
    assert len(owned) == len(set(owned))
    assert sorted(owned) == sorted(f.name for f in dataclasses.fields(AdversaryConfig))


def test_a_part_checks_its_own_keys_standalone_and_composed():
    with pytest.raises(ConfigError, match="gate_level must be turn or conversation"):
        GateArgs(gate_level="words")
    with pytest.raises(ConfigError, match="gate_patience must be >= 1"):
        AdversaryConfig(gate_patience=0)
    with pytest.raises(ConfigError, match="dpo_batch_size must be a multiple of dpo_micro_batch"):
        AdversaryConfig(dpo_batch_size=6, dpo_micro_batch=4)
    # a check that spans two parts belongs to the composition
    with pytest.raises(ConfigError, match="gate_level conversation needs conv_contexts"):
        AdversaryConfig(gate_level="conversation", conv_contexts=0)


def test_part_is_a_typed_copy_and_resolved_round_trips():
    cfg = AdversaryConfig(gate_patience=5, sim_top_p=0.9)
    gate = cfg.part("gate")
    assert isinstance(gate, GateArgs) and gate.gate_patience == 5
    gate.gate_patience = 7
    assert cfg.gate_patience == 5  # a copy
    doc = resolved(cfg)
    assert list(doc) == list(PARTS) and doc["sampling"]["sim_top_p"] == 0.9 and doc["model"]["lora_r"] == cfg.lora_r
    flat = flat_resolved(doc)
    assert flat == {f.name: flat[f.name] for f in dataclasses.fields(AdversaryConfig)}
    assert AdversaryConfig(**flat) == cfg
    assert flat_resolved({"sim_top_p": 0.9}) == {"sim_top_p": 0.9}  # a flat config of an older run reads as it was
