"""The one generation engine: every caller that samples text from a causal LM here goes through `Engine` (held-out
simulation, the discriminator's simulated turns, whole conversations, the local assistant, agent turns and the
simulator server, and GRPO's rollouts through TRL's `rollout_func`, `EngineRollout`).

What it does that `model.generate` does not, each measured on 2 CPU cores (docs/benchmarks.md):
- **a shared prefix is run once**: the tokens every prompt of a batch starts with (the simulator's system prompt) get
  one key/value cache, repeated over the batch; each row is laid out `prefix + pads + rest` with the pads masked and
  positions counted as if unpadded, so every real token sees what it would see unpadded;
- **a prompt that extends an earlier one resumes from its cache** (`complete(states=)`, `resume`): an agent's
  episode, or an LM user's side of it, prefills only what came after its last turn;
- **finished rows leave the batch**: a row that sampled a stop token (or its budget) is dropped from the cache and the
  mask at once, so a batch costs the sum of its turns' lengths, not rows x the longest turn;
- **sampling without a full sort**: `NucleusSampler` draws from exactly transformers' temperature/top-k/top-p
  distribution, finding the nucleus among the tokens above a probability floor and sorting only those (the whole
  vocabulary only for rows whose nucleus reaches below every floor; at top-p 1, one uniform number a row);
- **the precision the process runs in**: frozen bf16 weights run as they are; fp32 weights run under bf16 autocast
  when the process precision is bf16 (see `conversations.precision`); a bf16 inference copy on a CPU has its linear
  layers packed once in oneDNN's layout where a probe measures that faster (`packed`: the same products).

Sampling settings are one object, `SamplingSettings`, shared by every caller and recorded in the export.

The package's parts: `settings` (SamplingSettings, Completion, stop tokens), `sampler` (NucleusSampler), `cache` (the
growing key/value cache), `resume` (PromptCache, CacheStore: caches kept between calls), `decode` (Engine, the loop),
`packed` (pack_linears), `weights` (inference_copy, inference_model, and the one way into
the engine for a policy being trained, model or trainer: `policy_model` and `policy_engine`). The TRL rollout adapter
of GRPO lives with its caller (`adversary.rollout.EngineRollout`).
"""

from generator.engine.cache import new_cache
from generator.engine.decode import MIN_SHARED_PREFIX, PREFILL_CHUNK_TOKENS, Engine, decoding_attention
from generator.engine.sampler import NucleusSampler
from generator.engine.settings import Completion, SamplingSettings, stop_token_ids
from generator.engine.weights import inference_copy, inference_model, policy_engine, policy_model

__all__ = ["Completion", "Engine", "MIN_SHARED_PREFIX", "NucleusSampler", "PREFILL_CHUNK_TOKENS", "SamplingSettings",
           "decoding_attention", "inference_copy", "inference_model", "new_cache", "policy_engine", "policy_model",
           "stop_token_ids"]
