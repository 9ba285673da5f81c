"""The synchronizer holds one model's bytes when it needs a whole model, never two: round 0 (built,
written and evaluated) and the evaluation of a round read from storage each peak within 1× the
model's float32 bytes plus a fixed allowance over what the process held after its imports, on a
43M-parameter Llama config (the large-model run's bar is 1× + 768 MiB for the whole `islands run`
process: benchmarks.large_run)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.learner_memory import llama

HIDDEN, LAYERS = 768, 6  # 42.9M parameters, 164 MiB in float32
ALLOWANCE = 128 << 20  # the first forward pass's workspace (~65 MiB here, more elsewhere), allocator slack

CHILD = r"""
import json, logging, sys
from pathlib import Path

from islands.core.config import RunConfig
from islands.infra.memory import return_freed_memory
from islands.storage.rounds import read_manifest
from islands.storage.store import Stores
from islands.tasks import evaluate as module
from islands.tasks.publish import publish_initial
from transformers import AutoModelForCausalLM, LlamaForCausalLM  # imported before the baseline: code, not model

module.get_run_logger = lambda: logging.getLogger("driver-memory")
return_freed_memory()  # as every `islands` command does at its start
folder, what = Path(sys.argv[1]), sys.argv[2]
config = RunConfig(
    run_id="driver-memory", model=str(folder / "model"), corpus=str(folder / "corpus.txt"),
    regions=["north", "south"], speed={}, eval_batches=2, eval_every=int(what == "initial"),
)
stores = Stores(f"file://{folder}/store/{{bucket}}", config.regions)

def vm(field):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(field + ":")) * 1024

base = vm("VmRSS")
if what in ("initial", "unevaluated"):
    publish_initial(config, config.run_id, stores)
manifest, _ = read_manifest(stores.global_, config.run_id, 0)
if what == "evaluate":
    assert manifest.eval_loss is None
    module.evaluate_round.fn(config, stores.global_, manifest)
print(json.dumps({"growth": vm("VmHWM") - base, "model_bytes": manifest.model.bytes}))
"""


def child(folder, what: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(folder), what], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("evaluated", ["initial", "from storage"])
def test_a_whole_model_is_held_once_for_round_0_and_for_an_evaluation(tmp_path, evaluated):
    llama(tmp_path / "model", HIDDEN, LAYERS)
    (tmp_path / "corpus.txt").write_bytes(bytes(range(32, 127)) * 2000)
    if evaluated == "from storage":
        child(tmp_path, "unevaluated")  # round 0 written (eval_every = 0: not evaluated)
    out = child(tmp_path, "initial" if evaluated == "initial" else "evaluate")
    growth, model_bytes = out["growth"], out["model_bytes"]  # the checkpoint's bytes: θ in float32
    print(f"\n{evaluated}: {growth / 2**20:.0f} MiB over the imports, {growth / model_bytes:.2f}× the model")
    assert growth <= model_bytes + ALLOWANCE
