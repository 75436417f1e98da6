"""The real embedded model (SmolLM2-135M-Instruct) simulating users: a few turns, checked for format."""

import pytest

from generator.prompts import END_MARKER

pytestmark = pytest.mark.slow

SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def _is_user_turn(text: str) -> bool:
    t = text.strip()
    return bool(t) and not any(s in t for s in SPECIAL) and END_MARKER not in t and not t.lower().startswith(("user\n", "assistant\n"))


def test_smollm2_simulates_user_turns_and_conversations():
    from conversations.precision import inference_dtype, resolve_precision
    from generator.assistants import LocalAssistant
    from generator.data import load_turns, sample_records
    from generator.dialogue import simulate_conversations
    from generator.engine import Engine, SamplingSettings
    from generator.model import load_generator
    from generator.sample import simulate_records

    precision = resolve_precision("auto")  # bf16 weights where this CPU is fast at bf16: what users get
    model, tok = load_generator("smollm2-135m-instruct", dtype=inference_dtype(precision))
    engine = Engine(model, tok, batch_size=8, precision=precision)
    s = SamplingSettings(max_new_tokens=32, max_prompt_tokens=256)

    real = sample_records(load_turns("sharegpt", "test", max_context_messages=2, max_turn_chars=300), 4, seed=0)
    sim = simulate_records(engine, real, s, seed=0)
    assert [s.id for s in sim] == [r.id for r in real] and [s.context for s in sim] == [r.context for r in real]
    assert all(_is_user_turn(s.user_turn) for s in sim), [s.user_turn for s in sim]

    assistant = LocalAssistant(engine, settings=SamplingSettings(max_new_tokens=32, temperature=0.7),
                               system_prompt="You are a helpful assistant.")
    convs = simulate_conversations(engine, assistant, s, n=2, goals=["find a vegetarian pasta recipe", None], max_turns=2)
    for c in convs:
        assert c.user_turns >= 1 and isinstance(c.ended, bool)
        roles = [m["role"] for m in c.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        assert all(_is_user_turn(m["content"]) for m in c.messages if m["role"] == "user"), c.messages
