"""Simulated user turns for the contexts of real turns, paired with them for the discriminator.

    python -m generator.simulate --model M --data sharegpt --split test --limit 200 --out sim.jsonl \
        [--real-out real.jsonl] [--report diagnostics.json]

`--model` is an embedded asset, a model id or path, or a folder written by `generator.sft` (merged model or adapter).
`--data` is `sharegpt`, a conversation file or a turn-record file. `--limit N` draws N real turns at random (seeded)
from the split. Each simulated record keeps the real record's id and context, so `discriminator.evaluate` can pair
them; `--real-out` writes the matching real records. A JSON summary with realism diagnostics goes to stdout.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Optional

from conversations import write_jsonl
from conversations.cli_util import friendly_errors
from conversations.config import ConfigError, parse_config
from conversations.schema import DataError


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
    max_context_tokens: int = 384
    max_turn_chars: Optional[int] = None
    skip_first: bool = False
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0
    batch_size: int = 16
    val_frac: float = 0.05
    test_frac: float = 0.05
    dtype: str = "auto"
    device: Optional[str] = None
    trust_remote_code: bool = False

    def __post_init__(self):
        from generator.data import SPLIT_CHOICES

        if self.split not in SPLIT_CHOICES:
            raise ConfigError(f"--split must be one of {', '.join(SPLIT_CHOICES)}, got {self.split!r}")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1 (or omitted for the whole split), got {self.limit}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top-p must be in (0, 1], got {self.top_p}")
        if not self.out:
            raise ConfigError("--out is required: where to write the simulated turn records")


@friendly_errors
def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    (args,) = parse_config((SimulateArgs,), argv, prog="python -m generator.simulate")

    from conversations.precision import inference_dtype, resolve_precision
    from generator.data import load_turns, sample_records
    from generator.diagnostics import jsonable, realism_diagnostics
    from generator.engine import Engine, SamplingSettings
    from generator.model import load_generator
    from generator.sample import simulate_records

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
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                                max_prompt_tokens=args.max_context_tokens)
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
        "diagnostics": diagnostics,
    }
    if args.report:
        from pathlib import Path

        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
