"""Frozen export: merged weights (safetensors), tokenizer, chat template, generation config and `simulator.json`
(base model, data fingerprint, full config, td curve, best td with CI, gate reason, prompt format version, and the
sha256 of every file). Written to a temporary folder and renamed into place, files read-only, so an interrupted export
never leaves a folder that passes `verify`.

    python -m adversary.export verify DIR      # exit 0 when every hash matches; 1 naming the file otherwise
    python -m adversary.export show DIR        # its realism report (README.md, the model card: adversary.card)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from adversary.crashpoints import crash_point
from conversations.cli_util import friendly_errors
from conversations.schema import DataError
from generator.simulate import EXPORT_MANIFEST as MANIFEST  # one name, read by generator.simulate too

PENDING = MANIFEST + ".pending"  # the manifest until the export is sealed
EXPORT_FORMAT = 1


class ExportError(DataError):
    """A frozen export that is missing, incomplete or modified."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _hash_tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST, PENDING)
    }


def export_frozen(model, tokenizer, out_dir: str | Path, manifest: dict[str, Any], extra=None) -> Path:
    """Merge LoRA adapters (if any), save everything into a temporary sibling folder, hash, make read-only, rename.

    `model` may be a peft model (merged here, on the model itself) or a plain transformers model. `extra(folder)`
    writes more files into the export before it is hashed (the guide of a guided export: `adversary.guidance`)."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if getattr(tokenizer, "chat_template", None) and not (tmp / "chat_template.jinja").exists():
            (tmp / "chat_template.jinja").write_text(tokenizer.chat_template)
        if extra is not None:
            extra(tmp)
        files = _hash_tree(tmp)
        doc = dict(manifest)
        doc.update(export_format=EXPORT_FORMAT, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), files=files)
        # written under another name and renamed last: until that rename (after the folder's own), no folder of this
        # export has a manifest, so nothing an interrupted export leaves behind passes verify
        (tmp / PENDING).write_text(json.dumps(doc, indent=2, sort_keys=True, default=str))
        for p in tmp.rglob("*"):
            if p.is_file():
                os.chmod(p, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        os.chmod(tmp, 0o755)
        crash_point("export")
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            os.replace(tmp, out)
            os.replace(out / PENDING, out / MANIFEST)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
            os.replace(out / PENDING, out / MANIFEST)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def add_files(out_dir: str | Path, write) -> Path:
    """Add files to a sealed export and reseal it: `write(folder)` writes them (the realism report of
    `adversary.card`, which can only be measured once the export exists), every hash is taken again and the manifest
    replaced atomically (written as the pending manifest, then renamed over the old one)."""
    out = Path(out_dir)
    problems = verify_export(out)
    if problems:
        raise ExportError("refusing to add files to a modified or incomplete export: " + "; ".join(problems[:3]), str(out))
    manifest = read_manifest(out)
    before = {p for p in out.rglob("*") if p.is_file()}
    write(out)
    for p in out.rglob("*"):
        if p.is_file() and p not in before:
            os.chmod(p, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    manifest["files"] = _hash_tree(out)
    (out / PENDING).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
    os.replace(out / PENDING, out / MANIFEST)
    return out


def verify_export(path: str | Path) -> list[str]:
    """Problems with an export, one line each naming the file; an empty list means every hash matches."""
    root = Path(path)
    if not root.is_dir():
        return [f"{root}: not a folder"]
    mpath = root / MANIFEST
    if not mpath.exists():
        if (root / PENDING).exists():
            return [f"{mpath}: manifest missing: the export was interrupted before it was sealed; export again"]
        return [f"{mpath}: manifest missing (incomplete or not an export)"]
    try:
        manifest = json.loads(mpath.read_text())
        expected = dict(manifest["files"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        return [f"{mpath}: unreadable manifest ({e})"]
    problems = []
    actual = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != MANIFEST}
    for name, digest in sorted(expected.items()):
        p = root / name
        if not p.exists():
            problems.append(f"{name}: missing")
        elif sha256_file(p) != digest:
            problems.append(f"{name}: changed (sha256 differs from the manifest)")
    for name in sorted(actual - set(expected)):
        problems.append(f"{name}: extra file not in the manifest")
    return problems


def read_manifest(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / MANIFEST).read_text())


def load_frozen(path: str | Path, device: str | None = None, dtype="auto"):
    """Load a frozen simulator after checking every hash: (model in eval mode, tokenizer, manifest). `dtype`: a
    torch dtype, a name, or auto (the inference dtype of this process's precision, `conversations.precision`)."""
    problems = verify_export(path)
    if problems:
        raise ExportError("refusing to load a modified or incomplete export: " + "; ".join(problems[:5]), str(path))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, torch.dtype):
        torch_dtype = dtype
    elif dtype == "auto":
        from conversations.precision import inference_dtype, resolve_precision

        torch_dtype = inference_dtype(resolve_precision("auto", device))
    else:
        torch_dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    from conversations.assets import NO_HUB_KERNELS, whole_weights

    with whole_weights():  # the frozen simulator is never wrapped by DeepSpeed: not partitioned under ZeRO-3
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype, use_safetensors=True,
                                                     **NO_HUB_KERNELS)
    if device:
        model.to(device)
    # frozen: eval mode, no grad, hashes checked at load
    model.eval().requires_grad_(False)
    return model, tok, read_manifest(path)


def load_local_simulator(kind: str, path: str, *, precision: str, batch_size: int, device: str | None = None):
    """(engine, manifest) of a local simulator: `frozen` (an export, hashes checked, its prompt format compared with
    this code's; the manifest returned) or `hf` (any causal LM prompted as a user; manifest None), its weights in the
    inference dtype of `precision`. The one loader behind `adversary.compare` and `agent_rl.users.load_simulator`."""
    import logging

    from conversations.precision import inference_dtype
    from generator.engine import Engine

    if kind == "frozen":
        from generator.prompts import PROMPT_FORMAT_VERSION

        model, tok, manifest = load_frozen(path, device=device, dtype=inference_dtype(precision))
        trained_with = manifest.get("prompt_format_version")
        if trained_with is not None and str(trained_with) != PROMPT_FORMAT_VERSION:
            logging.getLogger("adversary.export").warning(
                "%s was trained with prompt format %s but this code renders format %s: its replies may degrade",
                path, trained_with, PROMPT_FORMAT_VERSION)
    elif kind == "hf":
        from generator.model import load_generator

        if not path:
            raise DataError("hf: needs a model, e.g. hf:smollm2-135m-instruct")
        (model, tok), manifest = load_generator(path, device=device, dtype=inference_dtype(precision)), None
    else:
        raise DataError(f"a local simulator is frozen:DIR or hf:MODEL, got '{kind}:{path}'")
    return Engine(model, tok, batch_size=batch_size, precision=precision), manifest


@friendly_errors
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m adversary.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check every file's sha256 against simulator.json")
    v.add_argument("dir")
    sh = sub.add_parser("show", help="print the export's realism report (its model card, README.md)")
    sh.add_argument("dir")
    args = p.parse_args(argv)
    if args.cmd == "show":
        card = Path(args.dir) / "README.md"
        if not card.exists():
            raise ExportError("no README.md: an export written before the realism report (re-export it)", args.dir)
        print(card.read_text())
        return 0
    problems = verify_export(args.dir)
    if problems:
        for line in problems:
            print(f"FAIL {args.dir}/{line}", file=sys.stderr)
        return 1
    n = len(read_manifest(args.dir)["files"])
    print(f"OK {args.dir}: {n} files match simulator.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
