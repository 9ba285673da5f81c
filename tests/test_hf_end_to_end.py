"""End to end on the CPU: a tiny Llama config and a BPE tokenizer written by the test, trained
for three rounds in two regions through Prefect and S3, exported, and loaded by transformers
alone (no project code importable) in another process, which gets the run's held-out loss and
generates text. The same for a python: factory model, loaded by safetensors and its own code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import STACK_REGIONS
from hf_models import write_llama
from safetensors.torch import save_file

from storage.text import stdlib_files
from tasks.round_state import held_out_batches

TESTS = Path(__file__).parent
ROUNDS, BATCH, EVAL_BATCHES = 3, 4, 2

# Run with -I -S and only site-packages on sys.path, without its .pth files: the editable
# install's finder is not loaded, so nothing of the project can be imported.
ALONE = """
import json, sys
sys.path[:] = [p for p in sys.path if "site-packages" not in p] + [sys.argv[1]] + sys.argv[4:]
import importlib.util
assert importlib.util.find_spec("tasks") is None and importlib.util.find_spec("flows") is None
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
    assert model.lm_head.weight is model.model.embed_tokens.weight
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
        [sys.executable, "-m", "flows.cli", *args], env=env, capture_output=True, text=True, timeout=600
    )
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def env(islands_stack):
    s, home = islands_stack
    return {**os.environ, **s.env(), "ISLANDS_HOME": str(home), "PYTHONPATH": str(TESTS)}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, str]:
    """A BPE tokenizer trained on a few stdlib files, saved in the model folder, and those files
    tokenized into a corpus of one byte per token (its vocabulary fits a byte, until corpora of
    token shards take wider ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("hf")
    folder = write_llama(root / "llama")
    files = [str(p) for p in stdlib_files()[:40]]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train(files, trainers.BpeTrainer(vocab_size=256, special_tokens=["[UNK]"], limit_alphabet=120))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    ids = [i for f in files for i in tok.encode(Path(f).read_text()).ids]
    assert max(ids) < 256 and len(ids) > 200_000
    (root / "tokens.bin").write_bytes(bytes(ids))
    return folder, f"file://{root}/tokens.bin"


def train(env: dict, tmp: Path, run_id: str, model: str, corpus: str, context: int) -> dict:
    """Three rounds of `model`. A learner waits for each new round before its next phase, and
    each inner step takes at least 0.1 s: learners of a model whose steps take microseconds would
    otherwise run hundreds of phases (task runs) a round, more than the Prefect server's SQLite
    takes on a loaded machine."""
    config = tmp / f"{run_id}.toml"
    floor = ", ".join(f'"{r}" = 0.1' for r in STACK_REGIONS)
    config.write_text(
        f'run_id = "{run_id}"\nmodel = "{model}"\ncorpus = "{corpus}"\nregions = {json.dumps(STACK_REGIONS)}\n'
        f"rounds = {ROUNDS}\ninner_steps = 4\neval_batches = {EVAL_BATCHES}\nmin_step_s = {{ {floor} }}\nlearner_wait_s = 30\n"
        f"[inner]\nbatch_size = {BATCH}\nwarmup_steps = 2\ntotal_steps = 40\nlr = 0.003\n"
    )
    summary = json.loads(islands(env, "run", "--config", str(config), "--json").stdout.strip().splitlines()[-1])
    assert summary["rounds_published"] == ROUNDS and set(summary["learners"].values()) == {"Completed"}
    batches = held_out_batches(corpus, BATCH, context, EVAL_BATCHES)
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
    folder, corpus = data
    summary = train(env, tmp_path, "hf-llama", str(folder), corpus, context=64)
    assert summary["eval_loss_final"] < summary["eval_loss_round0"]
    refused = islands(env, "export", "hf-llama", "s3://no-such-bucket/x", check=False)
    assert refused.returncode == 2 and refused.stderr.strip().startswith("islands: OUT: ")
    islands(env, "export", "hf-llama", "s3://islands-global/exports/hf-llama")
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
    _, corpus = data
    summary = train(env, tmp_path, "factory-bigram", "python:hf_models:bigram", corpus, context=32)
    out = tmp_path / "export"
    islands(env, "export", "factory-bigram", str(out), "--round", str(ROUNDS))
    assert json.loads((out / "config.json").read_text())["model"] == "python:hf_models:bigram"
    seen = alone(out, tmp_path / "factory-bigram.bin", str(TESTS))
    assert abs(seen["loss"] - summary["eval_loss_final"]) < 1e-4, (seen, summary["eval_loss_final"])
    (tmp_path / "a-file").write_text("")
    refused = islands(env, "export", "factory-bigram", str(tmp_path / "a-file"), check=False)
    assert refused.returncode == 2 and "OUT: " in refused.stderr
