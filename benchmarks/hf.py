"""A Hugging Face model at the built-in model's bars: a Llama-config model with tied embeddings,
written by transformers' LlamaConfig, trained by the decoupled pipeline against synchronous
DiLoCo at equal tokens (benchmarks.quality's bar, on the same data, seeds and held-out batches),
and its learners' tokens/s in the pipeline against the bare inner loop of the same model with
the same floor on a step's time (benchmarks.utilization's bar). No second-class path: the
pipeline, the baselines and the evaluation build it through islands.core.model.build_model like
the presets.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from benchmarks import bare, heldout, pipeline, quality
from benchmarks.faults import CAP, specs
from benchmarks.inprocess import sync_diloco_from_seed
from benchmarks.llama import llama_config
from benchmarks.report import Result, at_least, at_most, standalone
from benchmarks.utilization import UTILIZATION_BAR, UTILIZATION_LIMIT, against_bare

FOLDER = Path(".islands/bench/hf-llama")


def llama(quick: bool) -> str:
    """The model's folder (config.json only: built from the seed), as an absolute path every
    process of the run reads. Bytes are the corpus's tokens, so its vocabulary is 256; its
    context is the tiny preset's, and its width too at full size."""
    width, layers = (64, 2) if quick else (128, 4)
    folder = (FOLDER.with_name(f"{FOLDER.name}-{'quick' if quick else 'full'}")).resolve()
    llama_config(width, layers, heldout.context(), heads=4, intermediate=3 * width, tied=True).save_pretrained(folder)
    return str(folder)


def step_floor_s(model: str, quick: bool) -> float:
    """A capped learner's least seconds per step of `model`: a step at full speed, one thread,
    divided by the faults part's cap, so every learner's rate is the floor's, whatever else the
    two cores run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = bare.train(
            index=0, learners=len(pipeline.REGIONS), steps=10 if quick else 30, inner_steps=10, model=model
        )
    finally:
        torch.set_num_threads(threads)
    return one["seconds"] / one["steps"] / CAP


def run(quick: bool) -> Result:
    torch.set_num_threads(2)
    model = llama(quick)
    b = replace(quality.budget(quick), model=model)
    h = quality.hs(quick)[0]
    sync = heldout.loss(sync_diloco_from_seed(b, 0, h, quality.SYNC_RULE), model)
    dec, facts = quality.at_budget(replace(quality.decoupled_spec(quick, h, model=model), name=f"hf{h}"), b.tokens)
    floor = step_floor_s(model, quick)
    capped = replace(
        specs(quick)[0],
        name="hfu",
        model=model,
        min_step_s=tuple((r, floor) for r in pipeline.REGIONS),
        target_loss=None,
        rounds=3 if quick else 12,
    )
    ratio, raw = against_bare(capped, floor)
    res = Result(
        "hf",
        settings={
            "model": Path(model, "config.json").read_text(),
            "budget": b.__dict__,
            "H": h,
            "sync_rule": quality.SYNC_RULE.__dict__,
            "utilization_spec": capped.config(),
            "min_step_s": floor,
        },
        raw={"sync": sync, "decoupled": {"loss": dec, **facts}, "utilization": raw},
    )
    res.rows.append(
        at_most(
            f"hf: decoupled / sync DiLoCo, H={h}, Llama config (held-out loss)",
            dec / sync,
            quality.DECOUPLED_BAR,
            quality.DECOUPLED_LIMIT,
        )
    )
    res.rows.append(
        at_least("hf: learner tokens/s in the pipeline / bare, Llama config", ratio, UTILIZATION_BAR, UTILIZATION_LIMIT)
    )
    return res


if __name__ == "__main__":
    standalone(run)
