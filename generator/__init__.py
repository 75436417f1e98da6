"""The user simulator: a causal LM that writes the next user turn (prompt format: docs/prompt-format.md).

- `generator.prompts`: role-flipped prompts, `END_MARKER`, `render_prompt`, `target_text`, `strip_end_marker`.
- `generator.model.load_generator(name_or_path, lora=None, ...)`: model and left-padding tokenizer.
- `generator.engine`: the one generation engine (`Engine`, `SamplingSettings`, `NucleusSampler`).
- `generator.sample`: `user_turns` and `simulate_records` (one turn per context, batched on the engine).
- `generator.dialogue.simulate_conversations`: whole conversations against an assistant (`generator.assistants`:
  `LocalAssistant`, `OpenAIAssistant`, `ReplayAssistant`).
- `generator.sft`: SFT warm start on real user turns (`run_sft`, `heldout_perplexity`); CLI `python -m generator.sft`.
- `generator.diagnostics.realism_diagnostics(sim, real)`; per-turn `assistant_likeness_score`, `copy_score`.
- `generator.data`: turn records with end labels that hold across ShareGPT's conversation parts.
- CLI `python -m generator.simulate`: simulated turn records paired with the real ones.

Names are imported lazily, so `import generator.prompts` or `generator.diagnostics` never loads torch.
"""

from __future__ import annotations

from conversations.lazy import lazy_exports

_EXPORTS = {
    "END_MARKER": "generator.prompts",
    "PROMPT_FORMAT_VERSION": "generator.prompts",
    "render_prompt": "generator.prompts",
    "simulator_messages": "generator.prompts",
    "strip_end_marker": "generator.prompts",
    "target_text": "generator.prompts",
    "LoraSettings": "generator.model",
    "load_generator": "generator.model",
    "Engine": "generator.engine",
    "SamplingSettings": "generator.engine",
    "user_turns": "generator.sample",
    "simulate_records": "generator.sample",
    "simulate_conversations": "generator.dialogue",
    "LocalAssistant": "generator.assistants",
    "OpenAIAssistant": "generator.assistants",
    "ReplayAssistant": "generator.assistants",
    "SFTArgs": "generator.sft",
    "run_sft": "generator.sft",
    "heldout_perplexity": "generator.sft",
    "realism_diagnostics": "generator.diagnostics",
}

__all__ = list(_EXPORTS)

__getattr__ = lazy_exports("generator", _EXPORTS)
