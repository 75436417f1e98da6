"""Re-pin tests/data/smoke_curves.csv: the smoke run of the main job, as tests/test_adversary_e2e.py launches it.

    python tests/data/pin_smoke_curves.py

Only after a deliberate behaviour change (the pinned rows are how the test tells a refactor from one)."""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from test_adversary_e2e import launch, pin_fingerprint  # noqa: E402
import json  # noqa: E402

out = Path(tempfile.mkdtemp(prefix="pin_smoke.")) / "smoke"
r = launch(out, "--eval_base_model", "true")
if r.returncode:
    sys.exit(r.stdout[-2000:] + r.stderr[-2000:])
shutil.copy(out / "curves.csv", ROOT / "tests" / "data" / "smoke_curves.csv")
(ROOT / "tests" / "data" / "smoke_curves.cpu.json").write_text(json.dumps(pin_fingerprint()) + "\n")
print(subprocess.run(["git", "diff", "--stat", "--", "tests/data/smoke_curves.csv"], cwd=ROOT, capture_output=True,
                     text=True).stdout or "pinned (unchanged or new)")
