"""End to end on the CPU: a tiny Llama config and a BPE tokenizer (vocabulary 512) written by the
test; `islands prepare` tokenizes a few stdlib files with it into token shards on S3; the model
trains on them for three rounds in two regions through Prefect and S3, is exported with that
tokenizer, and is loaded with it by transformers alone (no project code importable) in another
process, which gets the run's held-out loss and generates text the tokenizer decodes. The same
for a python: factory model on the text itself (bytes), loaded by safetensors and its own code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import CORPORA, STACK_REGIONS
from hf_models import train_bpe, write_llama
from safetensors.torch import save_file

from islands.storage.text import stdlib_files
from islands.tasks.round_state import held_out_batches

TESTS = Path(__file__).parent
ROUNDS, BATCH, EVAL_BATCHES = 3, 4, 2
DATASET = f"s3://{CORPORA}/stdlib-bpe"

# Run with -I -S and only site-packages on sys.path, without its .pth files: the editable
# install's finder is not loaded, so nothing of the project can be imported.
ALONE = """
import json, sys
sys.path[:] = [p for p in sys.path if "site-packages" not in p] + [sys.argv[1]] + sys.argv[4:]
import importlib.util
assert importlib.util.find_spec("islands") is None
import torch
from safetensors.torch import load_file
from torch.nn import functional as F
out, batches = sys.argv[2], load_file(sys.argv[3])
n = len([k for k in batches if k.startswith("x")])
if sys.argv[4:]:
    import hf_models
    model = hf_models.bigram()
    model.load_state_dict(load_file(out + "/model.safetensors"), strict=False)
    loss = lambda x, y: model(x, y)
    text, new = "", 0
else:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert model.lm_head.weight is model.model.embed_tokens.weight and len(tok) == 512
    code = "def main():\\n    return 1"
    assert tok.decode(tok(code).input_ids) == code
    def loss(x, y):
        logits = model(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    prompt = tok("def main", return_tensors="pt").input_ids
    ids = model.generate(prompt, max_new_tokens=24, do_sample=False, pad_token_id=0)
    text, new = tok.decode(ids[0, prompt.shape[1]:]), ids.shape[1] - prompt.shape[1]
model.eval()
with torch.no_grad():
    losses = [loss(batches[f"x{i}"], batches[f"y{i}"]).item() for i in range(n)]
print(json.dumps({"loss": sum(losses) / n, "text": text, "new_tokens": new}))
"""


def islands(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "islands.flows.cli", *args], env=env, capture_output=True, text=True, timeout=600
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def env(on_stack):
    """This process and the commands it runs, on the session stack (the test reads the shards too)."""
    return {**os.environ, **on_stack, "PYTHONPATH": str(TESTS)}


@pytest.fixture(scope="module")
def data(env, tmp_path_factory) -> tuple[Path, str, Path, str]:
    """(the model folder, a BPE tokenizer.json trained on a few stdlib files, those files as a text
    folder, the token shards `islands prepare` made of them with the tokenizer on S3). The model
    folder has no tokenizer: the export takes the run's."""
    root = tmp_path_factory.mktemp("hf")
    folder = write_llama(root / "llama")
    src = root / "src"
    src.mkdir()
    for i, path in enumerate(stdlib_files()[:40]):
        shutil.copy(path, src / f"{i:04d}.txt")
    tokenizer = train_bpe([str(p) for p in sorted(src.iterdir())], root / "tokenizer.json", 512)
    done = islands(env, "prepare", str(src), DATASET, "--tokenizer", str(tokenizer), "--shard-mb", "0.25")
    assert "uint16 tokens" in done.stdout and "(vocabulary 512)" in done.stdout, done.stdout
    return folder, str(tokenizer), src, DATASET


def train(
    env: dict, tmp: Path, run_id: str, model: str, corpus: str, context: int, vocab: int, tokenizer: str | None = None
) -> dict:
    """Three rounds of `model`. A learner waits for each new round before its next phase, and
    each inner step takes at least 0.1 s: learners of a model whose steps take microseconds would
    otherwise run hundreds of phases (task runs) a round, more than the Prefect server's SQLite
    takes on a loaded machine."""
    config = tmp / f"{run_id}.toml"
    named = f'tokenizer = "{tokenizer}"\n' if tokenizer else ""
    floor = ", ".join(f'"{r}" = 0.1' for r in STACK_REGIONS)
    config.write_text(
        f'run_id = "{run_id}"\nmodel = "{model}"\ncorpus = "{corpus}"\n{named}regions = {json.dumps(STACK_REGIONS)}\n'
        f"rounds = {ROUNDS}\ninner_steps = 4\neval_batches = {EVAL_BATCHES}\nmin_step_s = {{ {floor} }}\nlearner_wait_s = 30\n"
        f"[inner]\nbatch_size = {BATCH}\nwarmup_steps = 2\ntotal_steps = 40\nlr = 0.003\n"
    )
    summary = json.loads(islands(env, "run", "--config", str(config), "--json").stdout.strip().splitlines()[-1])
    assert summary["rounds_published"] == ROUNDS and set(summary["learners"].values()) == {"Completed"}
    batches = held_out_batches(corpus, BATCH, context, EVAL_BATCHES, tokenizer=tokenizer, vocab_size=vocab)
    save_file(
        {f"{xy}{i}": t.contiguous() for i, b in enumerate(batches) for xy, t in zip("xy", b)}, tmp / f"{run_id}.bin"
    )
    return summary


def alone(out: Path, batches: Path, *extra_path: str) -> dict:
    site = sysconfig.get_paths()["purelib"]
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", ALONE, site, str(out), str(batches), *extra_path],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_hf_model_trains_exports_and_loads_in_transformers_alone(env, data, tmp_path):
    folder, tokenizer, _, shards = data
    summary = train(env, tmp_path, "hf-llama", str(folder), shards, 64, 512, tokenizer)
    assert summary["eval_loss_final"] < summary["eval_loss_round0"]
    refused = islands(env, "export", "hf-llama", "s3://no-such-bucket/x", check=False)
    assert refused.returncode == 2 and refused.stderr.strip().startswith("islands: OUT: ")
    islands(env, "export", "hf-llama", f"s3://{CORPORA}/exports/hf-llama")  # to S3, outside the store
    out = tmp_path / "export"
    done = islands(env, "export", "hf-llama", str(out))
    assert f"round {ROUNDS} of hf-llama" in done.stdout
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    seen = alone(out, tmp_path / "hf-llama.bin")
    assert abs(seen["loss"] - summary["eval_loss_final"]) < 1e-4, (seen, summary["eval_loss_final"])
    assert seen["new_tokens"] == 24 and seen["text"]  # greedy from a model this young: mostly spaces


def test_a_factory_model_trains_and_exports(env, data, tmp_path):
    _, _, src, _ = data
    summary = train(env, tmp_path, "factory-bigram", "python:hf_models:bigram", f"file://{src}", 32, 256)
    out = tmp_path / "export"
    islands(env, "export", "factory-bigram", str(out), "--round", str(ROUNDS))
    assert json.loads((out / "config.json").read_text())["model"] == "python:hf_models:bigram"
    seen = alone(out, tmp_path / "factory-bigram.bin", str(TESTS))
    assert abs(seen["loss"] - summary["eval_loss_final"]) < 1e-4, (seen, summary["eval_loss_final"])
    (tmp_path / "a-file").write_text("")
    refused = islands(env, "export", "factory-bigram", str(tmp_path / "a-file"), check=False)
    assert refused.returncode == 2 and "OUT: " in refused.stderr
