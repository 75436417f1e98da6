"""Simulated user turns for the contexts of real turns, paired with them for the discriminator; or whole simulated
conversations against an assistant.

    python -m generator.simulate --model M --data sharegpt --split test --limit 200 --out sim.jsonl \
        [--real-out real.jsonl] [--report diagnostics.json]
    python -m generator.simulate --conversations --model M --assistant hf:smollm2-135m-instruct --max-turns 4 \
        --limit 100 --out convs.jsonl --real-out real_convs.jsonl

Conversations (`--conversations`): each starts from a real conversation of the split: with `--start opening` its
first real user turn is the seed and the simulator writes the turns after it; with `--start empty` the simulator
writes the first turn too. The assistant is a local causal LM (`hf:MODEL`), an OpenAI-compatible endpoint
(`openai:MODEL@URL`, key from OPENAI_API_KEY) or `replay`: the real conversation's own assistant replies, in order
(the conversation stops where they run out). Up to `--max-turns` simulated user turns, fewer when the simulator
writes the end marker; batched across conversations, one engine call per round. The output is the project's
conversation format (readable by `python -m conversations check`), each line with `ended`, `user_turns` and the stop
reason; `--real-out` writes the real conversations cut at the same number of user turns.

`--model` is an embedded asset, a model id or path, or a folder written by `generator.sft` (merged model or adapter).
`--data` is `sharegpt`, a conversation file or a turn-record file. `--limit N` draws N real turns at random (seeded)
from the split. Each simulated record keeps the real record's id and context, so `discriminator.evaluate` can pair
them; `--real-out` writes the matching real records. A JSON summary with realism diagnostics goes to stdout.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from typing import Optional

from conversations import write_jsonl
from conversations.cli_util import friendly_errors
from conversations.config import ConfigError, parse_config
from conversations.schema import DataError


# SmolLM2-135M decoding on 2 CPU cores (bf16): 116 tok/s at 16 rows, 490 at 64, 604 at 128, 659 at 256; 128 is
# where the rate flattens (256 costs another ~1.5 GB of cache for 9%)
DEFAULT_BATCH_SIZE = 128
# a model that is not an export: the default run's budgets (96 new tokens cover 99% of real held-out turns; the
# prompt's 128 tokens hold the system prompt and the end of the context)
DEFAULT_SAMPLING = dict(max_new_tokens=96, temperature=1.0, top_p=0.95, max_prompt_tokens=128)  # configs/demo.yaml's
EXPORT_MANIFEST = "simulator.json"  # adversary.export writes it; read here as plain JSON (data flows one way)


def recorded_sampling(model: str) -> dict | None:
    """The sampling settings an export folder records (`simulator.json` -> "sampling"), or None."""
    from pathlib import Path

    path = Path(model) / EXPORT_MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("sampling") or None
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read the export's manifest: {e}", str(path)) from None


def resolve_sampling(args) -> tuple:
    """(SamplingSettings, where they came from): the export's recorded settings or DEFAULT_SAMPLING, with every
    sampling field given on the command line applied over them."""
    from generator.engine import SamplingSettings

    recorded = recorded_sampling(args.model)
    base = SamplingSettings.from_dict(recorded) if recorded else SamplingSettings(**DEFAULT_SAMPLING)
    given = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
             "max_prompt_tokens": args.max_context_tokens}
    source = "the export's recorded settings" if recorded else "the defaults"
    if any(v is not None for v in given.values()):
        source += " with " + ", ".join(f"{k}={v}" for k, v in given.items() if v is not None) + " from the command line"
    return base.replace(**given), source


@dataclass
class SimulateArgs:
    model: str = "smollm2-135m-instruct"
    data: str = "sharegpt"
    split: str = "test"
    limit: Optional[int] = 200
    out: str = "sim.jsonl"
    real_out: Optional[str] = None
    report: Optional[str] = None
    max_context_messages: Optional[int] = None
    # sampling: None takes the settings an export recorded (simulator.json "sampling": what the gate chose on), else
    # DEFAULT_SAMPLING; a value given here overrides either
    max_context_tokens: Optional[int] = None
    max_turn_chars: Optional[int] = None
    skip_first: bool = False
    max_new_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    seed: int = 0
    batch_size: int = DEFAULT_BATCH_SIZE
    val_frac: float = 0.05
    test_frac: float = 0.05
    dtype: str = "auto"
    device: Optional[str] = None
    trust_remote_code: bool = False
    # whole conversations
    conversations: bool = False
    max_turns: int = 4
    assistant: str = "hf:smollm2-135m-instruct"
    start: str = "opening"
    assistant_max_new_tokens: int = 128
    assistant_temperature: float = 0.7
    assistant_system_prompt: Optional[str] = None

    def __post_init__(self):
        from conversations.assets import check_model_name
        from conversations.config import check_ranges
        from generator.data import SPLIT_CHOICES

        if self.split not in SPLIT_CHOICES:
            raise ConfigError(f"--split must be one of {', '.join(SPLIT_CHOICES)}, got {self.split!r}")
        check_ranges(self, {"limit": ">= 1", "max_new_tokens": ">= 1", "batch_size": ">= 1", "temperature": ">= 0",
                            "top_p": "(0, 1]", "max_context_tokens": ">= 16", "max_context_messages": ">= 0",
                            "max_turn_chars": ">= 1", "seed": ">= 0", "val_frac": "[0, 0.5)", "test_frac": "[0, 0.5)",
                            "max_turns": ">= 1", "assistant_max_new_tokens": ">= 1", "assistant_temperature": ">= 0"})
        if self.start not in ("opening", "empty"):
            raise ConfigError(f"--start must be opening or empty, got {self.start!r}")
        kind, _, rest = self.assistant.partition(":")
        if self.assistant != "replay" and not (kind == "hf" and rest) and not (kind == "openai" and "@" in rest):
            raise ConfigError(f"--assistant must be hf:MODEL, openai:MODEL@URL or replay, got {self.assistant!r}")
        if kind == "hf":
            check_model_name(rest, "--assistant")
        if not self.out:
            raise ConfigError("--out is required: where to write the simulated turn records")
        check_model_name(self.model, "model")


@friendly_errors
def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    (args,) = parse_config((SimulateArgs,), argv, prog="python -m generator.simulate")
    from conversations.cli_util import start_process

    start_process()

    from conversations.precision import inference_dtype, resolve_precision
    from generator.data import load_turns, sample_records
    from generator.diagnostics import jsonable, realism_diagnostics
    from generator.engine import Engine
    from generator.model import load_generator
    from generator.sample import simulate_records

    if args.conversations:
        return simulate_conversations_cli(args)
    real = load_turns(
        args.data,
        args.split,
        max_context_messages=args.max_context_messages,
        max_turn_chars=args.max_turn_chars,
        skip_first=args.skip_first,
        val_frac=args.val_frac,
        test_frac=args.test_frac,
    )
    if not real:
        raise DataError(f"no turns in split {args.split!r}", args.data)
    real = sample_records(real, args.limit, args.seed)

    t0 = time.time()
    precision = resolve_precision(args.dtype, args.device)
    model, tokenizer = load_generator(
        args.model, dtype=inference_dtype(precision), device=args.device, trust_remote_code=args.trust_remote_code
    )
    load_s = time.time() - t0
    t1 = time.time()
    settings, source = resolve_sampling(args)
    print(f"sampling: {settings.to_dict()} ({source}); batch {args.batch_size}", file=sys.stderr, flush=True)
    engine = Engine(model, tokenizer, batch_size=args.batch_size, precision=precision)
    sim = simulate_records(engine, real, settings, seed=args.seed)
    gen_s = time.time() - t1
    n_tokens = sum(len(tokenizer(s.user_turn, add_special_tokens=False)["input_ids"]) for s in sim)
    write_jsonl(args.out, sim)
    if args.real_out:
        write_jsonl(args.real_out, real)
    diagnostics = jsonable(realism_diagnostics(sim, real))
    summary = {
        "model": args.model,
        "data": args.data,
        "split": args.split,
        "n": len(sim),
        "out": args.out,
        "real_out": args.real_out,
        "load_s": round(load_s, 2),
        "generate_s": round(gen_s, 2),
        "turn_tokens_per_s": round(n_tokens / gen_s, 1) if gen_s > 0 else None,
        "sampling": settings.to_dict(),
        "sampling_source": source,
        "batch_size": args.batch_size,
        "diagnostics": diagnostics,
    }
    if args.report:
        from pathlib import Path

        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


def make_assistant(args, engine):
    from generator.assistants import LocalAssistant, OpenAIAssistant, ReplayAssistant
    from generator.engine import SamplingSettings

    kind, _, rest = args.assistant.partition(":")
    if args.assistant == "replay":
        return None  # built from the conversations themselves
    if kind == "openai":
        model, _, url = rest.partition("@")
        return OpenAIAssistant(url, model, system_prompt=args.assistant_system_prompt,
                               max_tokens=args.assistant_max_new_tokens, temperature=args.assistant_temperature)
    if rest == args.model:
        a_engine = engine
    else:
        from conversations.precision import inference_dtype, resolve_precision
        from generator.engine import Engine
        from generator.model import load_generator

        precision = resolve_precision(args.dtype, args.device)
        m, t = load_generator(rest, dtype=inference_dtype(precision), device=args.device)
        a_engine = Engine(m, t, batch_size=args.batch_size, precision=precision)
    return LocalAssistant(a_engine, system_prompt=args.assistant_system_prompt, seed=args.seed,
                          settings=SamplingSettings(max_new_tokens=args.assistant_max_new_tokens,
                                                    temperature=args.assistant_temperature, top_p=0.95, top_k=50,
                                                    max_prompt_tokens=1024))


def real_conversations(args):
    """The split's conversations that open with a user turn, `limit` of them drawn with the seed."""
    import random

    from conversations import split_conversations
    from generator.data import load_conversations_for

    convs = split_conversations(load_conversations_for(args.data), args.val_frac, args.test_frac)[args.split] \
        if args.split != "all" else load_conversations_for(args.data)
    convs = [c for c in convs if [m for m in c.messages if m["role"] != "system"][:1] and
             [m for m in c.messages if m["role"] != "system"][0]["role"] == "user"]
    if not convs:
        raise DataError(f"no conversations opening with a user turn in split {args.split!r}", args.data)
    if args.limit and args.limit < len(convs):
        convs = [convs[i] for i in sorted(random.Random(args.seed).sample(range(len(convs)), args.limit))]
    return convs


def simulate_conversations_cli(args) -> dict:
    from tqdm.auto import tqdm

    from conversations.precision import inference_dtype, resolve_precision
    from conversations.turns import cut_conversations
    from generator.assistants import ReplayAssistant
    from generator.diagnostics import conversation_diagnostics, jsonable
    from generator.dialogue import simulate_conversations
    from generator.engine import Engine
    from generator.model import load_generator

    real = real_conversations(args)
    seed_turns = 1 if args.start == "opening" else 0
    seeds = []
    for c in real:
        msgs = [m for m in c.messages if m["role"] != "system"]
        seeds.append([dict(m) for m in c.messages if m["role"] == "system"] + ([dict(msgs[0])] if seed_turns else []))
    t0 = time.time()
    precision = resolve_precision(args.dtype, args.device)
    model, tok = load_generator(args.model, dtype=inference_dtype(precision), device=args.device,
                                trust_remote_code=args.trust_remote_code)
    engine = Engine(model, tok, batch_size=args.batch_size, precision=precision)
    assistant = make_assistant(args, engine) or ReplayAssistant.from_conversations(real, start_user_turns=seed_turns)
    settings, source = resolve_sampling(args)
    print(f"sampling: {settings.to_dict()} ({source}); batch {args.batch_size}", file=sys.stderr, flush=True)
    bar = tqdm(total=args.max_turns, desc="rounds", unit="turn")

    def progress(turn, live):
        bar.n = turn
        bar.set_postfix(live=live)
        bar.refresh()

    sims = simulate_conversations(engine, assistant, settings, contexts=seeds, ids=[c.id for c in real],
                                  max_turns=args.max_turns, seed=args.seed, progress=progress)
    bar.n = args.max_turns
    bar.close()
    gen_s = time.time() - t0
    write_jsonl(args.out, [s.to_dict() for s in sims])
    cut = cut_conversations(real, seed_turns + args.max_turns)
    if args.real_out:
        write_jsonl(args.real_out, cut)
    summary = {"model": args.model, "assistant": args.assistant, "start": args.start, "n": len(sims), "out": args.out,
               "real_out": args.real_out, "seconds": round(gen_s, 1), "sampling": settings.to_dict(),
               "sampling_source": source,
               "diagnostics": jsonable(conversation_diagnostics(sims, cut, seed_user_turns=seed_turns))}
    if args.report:
        from pathlib import Path

        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
