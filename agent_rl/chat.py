"""Talk to a simulator yourself: you play the assistant, the simulator plays the user.

    python -m agent_rl.chat runs/demo/frozen [--goal TEXT] [--persona TEXT] [--greeting TEXT] [--out chat.jsonl]
    printf 'Hello! How can I help?\\nSure, here it is.\\n/end\\n' | python -m agent_rl.chat runs/demo/frozen --out t.jsonl

SIMULATOR is any spec `agent_rl.users.load_simulator` takes (a frozen export, `hf:MODEL`, `openai:MODEL@URL`); a
frozen export samples as it was exported, its guide on (`#guidance=1` turns it off). The simulated user writes the
first turn (after `--greeting`, the assistant's opening, when given); then each line you type is one assistant
message (`\\n` inside a line becomes a line break). The conversation ends when the simulator ends it (it wrote its
end-of-conversation marker, or its export's calibrated end decision said so), on `/end` (or `/quit`), at the end of
standard input, or after `--max-turns` user turns. The transcript is appended to `--out` as one messages record
(`{"messages": [...], "meta": {...}}`, the format `python -m conversations check` reads), in the simulator's point of
view as in the data: `user` = the simulator, `assistant` = you.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from conversations.cli_util import friendly_errors

END_COMMANDS = ("/end", "/quit", "/exit")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m agent_rl.chat", description=__doc__.split("\n")[0])
    p.add_argument("simulator", help="frozen:DIR (or DIR), hf:MODEL or openai:MODEL@URL")
    p.add_argument("--goal", default="", help="what the simulated user wants (hidden from you; in its system prompt)")
    p.add_argument("--persona", default=None, help="who the simulated user is (in its system prompt)")
    p.add_argument("--greeting", default=None, help="the assistant's opening message, before the user's first turn")
    p.add_argument("--max-turns", type=int, default=20, help="user turns at most")
    p.add_argument("--seed", type=int, default=0, help="the simulator's sampling seed")
    p.add_argument("--out", default=None, help="append the transcript to this JSONL file")
    return p


def next_user_turn(user, messages: list[dict], goal: str, persona: str | None):
    from agent_rl.gyms import UserRequest

    return user.turns([UserRequest(context=list(messages), goal=goal, gym="chat", task=None, persona=persona,
                                   episode=None)])[0]


@friendly_errors
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from conversations import DataError

    if args.max_turns < 1:
        raise DataError(f"--max-turns must be >= 1, got {args.max_turns}")
    from agent_rl.users import check_simulator_spec, load_simulator

    check_simulator_spec(args.simulator)
    from conversations.cli_util import start_process

    start_process()
    user = load_simulator(args.simulator, seed=args.seed)
    if not hasattr(user, "turns"):
        raise DataError(f"simulator '{args.simulator}': chat needs a language-model simulator (frozen:, hf:)")
    interactive = sys.stdin.isatty()
    say = print if interactive else (lambda *a, **k: print(*a, **{**k, "file": sys.stderr}))
    say(f"you are the assistant; {user.spec} is the user. One line a message; /end to stop.", flush=True)
    messages: list[dict] = []
    if args.greeting:
        messages.append({"role": "assistant", "content": args.greeting})
        print(f"assistant> {args.greeting}", flush=True)
    ended_by, t0 = "max_turns", time.time()
    for k in range(args.max_turns):
        turn = next_user_turn(user, messages, args.goal, args.persona)
        messages.append({"role": "user", "content": turn.text})
        print(f"user> {turn.text}", flush=True)
        if turn.ended:
            ended_by = "simulator"
            print("[the user ended the conversation]", flush=True)
            break
        if k == args.max_turns - 1:  # no assistant message that no user turn would answer
            break
        if interactive:
            print("assistant> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            ended_by = "end_of_input"
            break
        text = line.rstrip("\n").replace("\\n", "\n")
        if text.strip().lower() in END_COMMANDS:
            ended_by = "command"
            break
        if not interactive:
            print(f"assistant> {text}", flush=True)
        messages.append({"role": "assistant", "content": text})
    record = {"messages": messages, "meta": {"simulator": user.spec, "goal": args.goal, "persona": args.persona,
                                             "seed": args.seed, "ended_by": ended_by,
                                             "user_turns": sum(m["role"] == "user" for m in messages),
                                             "seconds": round(time.time() - t0, 1),
                                             "date": time.strftime("%Y-%m-%dT%H:%M:%S")}}
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        say(f"transcript: {out} ({record['meta']['user_turns']} user turns, ended by {ended_by})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
