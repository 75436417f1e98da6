"""python -m conversations check FILE | export-turns SOURCE --out turns.jsonl

`check` prints counts (conversations, user turns, invalid records with locations) and exits 2 when a record is invalid
unless --skip-invalid is given. SOURCE is a file, a `datasets` folder or `hf:NAME`, or `sharegpt` (embedded corpus).
"""

from __future__ import annotations

import argparse
import json
import sys

from conversations.clean import clean_conversations
from conversations.cli_util import EXIT_BAD_INPUT, friendly_errors
from conversations.loaders import FORMATS, LoadReport, iter_conversations, write_jsonl
from conversations.split import SPLITS, split_conversations
from conversations.turns import extract_turns


def _load(args):
    report = LoadReport(args.source)
    if args.source == "sharegpt" and not args.no_clean:
        from conversations.embedded import load_corpus

        convs, info = load_corpus("sharegpt", max_chars=args.max_chars)
        return convs, None, info
    convs = list(iter_conversations(args.source, args.format, skip_invalid=args.skip_invalid, report=report))
    return convs, report, None


def cmd_check(args) -> int:
    convs, report, info = _load(args)
    out = {"source": args.source}
    if info is not None:
        out.update(records=info.records, invalid=info.invalid, invalid_reasons=info.invalid_reasons, clean=info.clean)
    else:
        out.update(records=report.records, invalid=report.n_invalid)
        if report.invalid:
            out["invalid_records"] = [{"where": w, "reason": r} for w, r in report.invalid[:50]]
        if not args.no_clean:
            convs, clean = clean_conversations(convs, max_chars=args.max_chars)
            out["clean"] = clean.as_dict()
    out["conversations"] = len(convs)
    out["user_turns"] = sum(len(c.user_turn_indices()) for c in convs)
    print(json.dumps(out, indent=2, ensure_ascii=False))
    if report is not None and report.invalid:
        for w, r in report.invalid[:20]:
            print(f"invalid: {w}: {r}", file=sys.stderr)
        print(f"skipped {report.n_invalid} invalid record(s) (--skip-invalid)", file=sys.stderr)
    return 0


def cmd_export_turns(args) -> int:
    convs, report, _ = _load(args)
    if not args.no_clean and args.source != "sharegpt":
        convs, _ = clean_conversations(convs, max_chars=args.max_chars)
    if args.split != "all":
        convs = split_conversations(convs, args.val_frac, args.test_frac)[args.split]
    turns = extract_turns(convs, max_context_messages=args.max_context_messages)
    if args.limit:
        turns = turns[: args.limit]
    n = write_jsonl(args.out, turns)
    print(json.dumps({"out": args.out, "turn_records": n, "conversations": len(convs), "split": args.split}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m conversations", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("source", help="file (JSON/JSONL), datasets folder, hf:NAME, or 'sharegpt' (embedded)")
        sp.add_argument("--format", default="auto", choices=FORMATS)
        sp.add_argument("--skip-invalid", action="store_true", help="count and report invalid records instead of stopping")
        sp.add_argument("--max-chars", type=int, default=4000, help="cleaning: drop conversations with a longer user turn")
        sp.add_argument("--no-clean", action="store_true", help="skip the cleaning rules")

    c = sub.add_parser("check", help="validate and count")
    common(c)
    c.set_defaults(func=cmd_check)
    e = sub.add_parser("export-turns", help="write turn records {id, context, user_turn} as JSONL")
    common(e)
    e.add_argument("--out", required=True)
    e.add_argument("--split", default="all", choices=SPLITS + ("all",))
    e.add_argument("--val-frac", type=float, default=0.05)
    e.add_argument("--test-frac", type=float, default=0.05)
    e.add_argument("--max-context-messages", type=int, default=None)
    e.add_argument("--limit", type=int, default=None)
    e.set_defaults(func=cmd_export_turns)
    return p


@friendly_errors
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
