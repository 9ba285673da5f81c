"""The data plane at size: the synchronizer's critical path on a ~100M-parameter model's tensors
(random values with a 100M GPT's shapes; nothing is trained) against moto's S3 server, then the
same against SeaweedFS, the embedded stack's endpoint, for what keeping objects on disk costs.

The path is the synchronizer's own code: tasks.collect.inspect_all reads, hashes, decodes and
validates the K deltas, two at a time as collect does; tasks.merge_step.apply_merge merges them,
takes the outer step and encodes the update; tasks.publish.write_objects writes the model, the
update and the outer state exactly as the publish task does (side by side). It runs in a child
process per K, so its peak resident memory (VmHWM) is the synchronizer's alone; the same child
then moves the same bytes with plain boto3 calls, one after another and with botocore's default
checksums, for the throughput baseline. Each step's CPU seconds, user and kernel, are reported
for the child and for moto's server: on a VM whose new pages are slow to find, the kernel's
share is where the copies into fresh memory show.

Each K runs three times (a child each time) and the row is the median ratio: a single run here
varies by ±0.5.

`run_memory`, the suite's `merge_memory` part, is the merge's memory at two model sizes (100M and
1B parameters; `--quick`: 20M and 80M, int8 alone): synthetic θ, outer state and K = 4 deltas (fp32 and int8) in a file:// store, written a
chunk at a time; a child process reads, validates and merges them as the synchronizer does
(RoundState.read_parent, collect.inspect_all, merge_step.apply_merge, publish.write_objects) and
reports its peak resident memory over its resident memory before it began (VmHWM − VmRSS). The
merge streams (synchronizer.chunk_mb at a time), so the figure is the same at every size: the
ratio between sizes is a row too. At 1B the inputs and outputs take ~55 GB of the temporary
folder's disk. `python -m benchmarks.dataplane --sizes 100M 1B` prints its rows alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import fsspec
import torch

from benchmarks.report import Result, Row, at_least, at_most, figure, standalone, table, within
from islands.core.config import EMBEDDED_STORE, GLOBAL_BUCKET, RunConfig, embedded_buckets
from islands.core.model import GPT, GPTConfig
from islands.infra.memory import return_freed_memory
from islands.storage import layout
from islands.storage.codec import encode
from islands.storage.manifest import ObjectRef
from islands.storage.rounds import put_tensors
from islands.storage.store import Stores, bucket_url

STORE = EMBEDDED_STORE
REGIONS = ["east", "west"]
FULL = GPTConfig(vocab_size=256, block_size=1024, n_layer=14, n_head=12, n_embd=768)
QUICK = GPTConfig(vocab_size=256, block_size=256, n_layer=2, n_head=4, n_embd=256)


def shapes(cfg: GPTConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        return {k: v.shape for k, v in GPT(cfg).state_dict().items()}


def config(k: int) -> RunConfig:
    return RunConfig(run_id=f"dataplane-k{k}", regions=REGIONS, learners_per_region=k // len(REGIONS), speed={})


def write_inputs(cfg: GPTConfig, k: int, stores: Stores) -> dict:
    """θ, momentum and K deltas in storage, as the synchronizer finds them at a round's start."""
    conf, run = config(k), f"dataplane-k{k}"
    g = torch.Generator().manual_seed(k)
    rand = lambda scale: {n: torch.randn(s, generator=g) * scale for n, s in shapes(cfg).items()}  # noqa: E731
    refs = {
        "model": put_tensors(stores.global_, lambda sha: layout.model_key(run, 0, sha), rand(0.02), {}).model_dump(),
        "outer": put_tensors(stores.global_, lambda sha: layout.outer_key(run, 0, sha), rand(1e-3), {}).model_dump(),
        "deltas": [],
    }
    for learner, region, _ in conf.learners():
        meta = {
            "run": run,
            "learner": learner,
            "region": region,
            "phase": 0,
            "base_round": 0,
            "inner_steps": 50,
            "tokens": 102400,
            "loss": 3.0,
            "seconds": 1.0,
            "finished_at": time.time(),
        }
        data = encode(rand(1e-3), meta, "fp32")
        key = layout.delta_key(run, learner, 0)
        stores.region(region).put_if_absent(key, data)
        refs["deltas"].append([region, key, len(data)])
    return refs


def parent_of(refs: dict) -> SimpleNamespace:
    """Round 0 as much of a manifest as the synchronizer reads from it: its model, its outer
    state, nothing merged."""
    return SimpleNamespace(
        round=0,
        model=ObjectRef(**refs["model"]),
        outer=ObjectRef(**refs["outer"]),
        contributions=[],
        excluded=[],
        consumed=set,
    )


def vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def cpu_s(server_pid: int) -> dict[str, float]:
    """CPU seconds so far, user and kernel, of this process (all its threads) and of the server."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    fields = Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return {
        "user": me.ru_utime,
        "sys": me.ru_stime,
        "server_user": int(fields[11]) / tick,
        "server_sys": int(fields[12]) / tick,
    }


def spent(marks: list[tuple[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """CPU seconds of each step between consecutive marks, by whose and which kind."""
    return {
        name: {kind: round(now[kind] - before[kind], 2) for kind in now}
        for (_, before), (name, now) in zip(marks, marks[1:])
    }


def measure(k: int, refs: dict, s3_url: str, server_pid: int) -> dict:
    """In the child: the synchronizer's critical path, then the same bytes through boto3."""
    from islands.infra.s3_server import client
    from islands.tasks.collect import Arrival, inspect_all
    from islands.tasks.merge_step import Merged, apply_merge
    from islands.tasks.publish import write_objects
    from islands.tasks.round_state import RoundState

    torch.set_num_threads(2)
    return_freed_memory()  # as every islands command does at its start
    baseline = vm("VmRSS")
    stores = Stores(STORE, REGIONS)
    run = f"dataplane-k{k}"
    t0 = time.perf_counter()
    state = RoundState(config(k), run, 1, stores, [(parent_of(refs), "0" * 64)], {}, None)
    state.read_parent()  # θ and the momentum spooled to local files, read a chunk at a time
    t1 = time.perf_counter()
    ours = [("start", cpu_s(server_pid))]
    arrivals = inspect_all(state, [tuple(d) for d in refs["deltas"]])
    bad = [a.reason for a in arrivals if not isinstance(a, Arrival)]
    if bad:
        raise RuntimeError(f"the synthetic deltas were refused: {bad[:2]}")
    t_read = time.perf_counter()
    ours.append(("read_and_validate", cpu_s(server_pid)))
    model_object, update, outer, _, _ = apply_merge(state, arrivals, state.config.merge)
    t_merge = time.perf_counter()
    ours.append(("merge", cpu_s(server_pid)))
    written = write_objects(state, Merged(None, model_object, update, outer, [], []))
    state.drop_spool()
    t2 = time.perf_counter()
    ours.append(("write", cpu_s(server_pid)))
    peak = vm("VmHWM")
    bodies = [stores.global_.get(w.key) for w in written]
    s3 = client(s3_url)
    t3 = time.perf_counter()
    raw = [("start", cpu_s(server_pid))]
    for region, key, _ in refs["deltas"]:
        s3.get_object(Bucket=bucket_url(STORE, region).removeprefix("s3://"), Key=key)["Body"].read()
    t_raw_read = time.perf_counter()
    raw.append(("raw_read", cpu_s(server_pid)))
    for i, body in enumerate(bodies):
        s3.put_object(Bucket=bucket_url(STORE, GLOBAL_BUCKET).removeprefix("s3://"), Key=f"raw/{run}/{i}", Body=body)
    t4 = time.perf_counter()
    raw.append(("raw_write", cpu_s(server_pid)))
    moved = sum(size for _, _, size in refs["deltas"]) + sum(w.bytes for w in written)
    for w in written:  # the next repetition writes them afresh
        stores.global_.delete(w.key)
    for i in range(len(bodies)):
        s3.delete_object(Bucket=bucket_url(STORE, GLOBAL_BUCKET).removeprefix("s3://"), Key=f"raw/{run}/{i}")
    return {
        "k": k,
        "bytes_moved": moved,
        "load_s": t1 - t0,
        "critical_path_s": t2 - t1,
        "raw_boto3_s": t4 - t3,
        "read_and_validate_s": t_read - t1,
        "merge_s": t_merge - t_read,
        "write_s": t2 - t_merge,
        "raw_read_s": t_raw_read - t3,
        "raw_write_s": t4 - t_raw_read,
        "peak_rss_over_baseline": peak - baseline,
        "baseline_rss": baseline,
        "cpu_s": spent(ours) | spent(raw),
    }


def throughput(m: dict) -> float:
    return m["raw_boto3_s"] / m["critical_path_s"]


def throughput_row(k: int, m: dict) -> Row:
    """The synchronizer's critical path against boto3 moving the same bytes, at K deltas (the
    median of the repetitions, each measured side by side in one process), with where each
    side's time went in that repetition."""
    cpu = m["cpu_s"]
    return at_least(
        f"dataplane: synchronizer / raw boto3 throughput, K={k}, median of {len(m['ratios'])}",
        throughput(m),
        0.9,
        f"ratios {', '.join(f'{r:.2f}' for r in m['ratios'])}; the three objects a round writes are "
        "named by their sha256, so each is hashed, then uploaded, once merged: its upload cannot "
        "overlap the merge (checkpoints made of parts, each uploaded once hashed, would); "
        f"of its {m['critical_path_s']:.1f} s, reading and validating the deltas took "
        f"{m['read_and_validate_s']:.1f} s against boto3's {m['raw_read_s']:.1f} s (each delta is spooled "
        "to local disk, into new page cache, hashed twice and its norms taken, two deltas at a time; "
        f"{cpu['read_and_validate']['sys']:.1f} s of kernel CPU in the synchronizer against "
        f"{cpu['raw_read']['sys']:.1f} s in boto3's reads), the float64 merge and the hashes of the three "
        f"objects it makes {m['merge_s']:.1f} s, which boto3 does not do, and writing the model, update "
        f"and outer state side by side, each PUT naming its sha256, {m['write_s']:.1f} s against boto3's "
        f"{m['raw_write_s']:.1f} s, one PUT after another with botocore's own checksums (moto's server "
        f"spent {cpu['write']['server_sys']:.1f} s and {cpu['raw_write']['server_sys']:.1f} s of kernel "
        "CPU storing them); all on the 2 cores moto's server also uses",
    )


def endpoints(tmp: Path) -> dict:
    """The servers compared, by name: moto's S3 server (objects in memory) and SeaweedFS, the
    embedded stack's endpoint (objects on disk, each fsynced before it is acknowledged)."""
    from islands.infra.s3_server import MotoServer
    from islands.infra.seaweed import SeaweedServer

    return {"moto": MotoServer(tmp / "moto.log"), "seaweedfs": SeaweedServer(tmp / "seaweedfs", tmp / "weed.log")}


def measure_on(server, cfg: GPTConfig, ks: tuple[int, ...], repeats: int) -> dict[str, dict]:
    """The synchronizer's critical path and the boto3 baseline at each K against one server,
    `repeats` times each (a child process each time): the repetition of the median ratio, with
    every repetition's ratio."""
    from islands.infra.s3_server import CREDENTIALS, create_buckets

    before = dict(os.environ)
    os.environ.update(CREDENTIALS)
    env = dict(os.environ)
    url = server.start(env)
    raw = {}
    try:
        create_buckets(url, embedded_buckets(REGIONS))
        env["AWS_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"] = url
        # s3fs clients are cached per process: drop those bound to another endpoint.
        fsspec.get_filesystem_class("s3").clear_instance_cache()
        for k in ks:
            refs, runs = write_inputs(cfg, k, Stores(STORE, REGIONS)), []
            for _ in range(repeats):
                out = subprocess.run(
                    [sys.executable, "-m", "benchmarks.dataplane", "--child", str(k), "--s3", url]
                    + ["--server-pid", str(server.pid)],
                    input=json.dumps(refs),
                    env=env,
                    capture_output=True,
                    text=True,
                )
                if out.returncode != 0:
                    raise RuntimeError(f"dataplane child K={k} failed:\n{out.stderr[-3000:]}")
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            runs.sort(key=throughput)
            raw[f"k{k}"] = runs[len(runs) // 2] | {"ratios": [throughput(m) for m in runs]}
    finally:
        server.stop()
        os.environ.clear()
        os.environ.update(before)  # later parts talk to their own endpoint again
        fsspec.get_filesystem_class("s3").clear_instance_cache()
    return raw


def server_cpu_s(m: dict) -> float:
    """CPU seconds the server spent, user and kernel, while the synchronizer's critical path ran."""
    return sum(
        m["cpu_s"][step][kind]
        for step in ("read_and_validate", "merge", "write")
        for kind in ("server_user", "server_sys")
    )


def endpoint_row(k: int, moto: dict, weed: dict) -> Row:
    """SeaweedFS against moto on the same bytes: the synchronizer's critical path and boto3's."""
    return figure(
        f"dataplane: SeaweedFS / moto synchronizer throughput, K={k}",
        moto["critical_path_s"] / weed["critical_path_s"],
        f"above 1 the embedded endpoint (on disk, fsynced) is faster than moto (in memory); the same "
        f"{weed['bytes_moved'] / 2**20:.0f} MiB took the synchronizer {weed['critical_path_s']:.1f} s on SeaweedFS "
        f"and {moto['critical_path_s']:.1f} s on moto, plain boto3 {weed['raw_boto3_s']:.1f} s and "
        f"{moto['raw_boto3_s']:.1f} s; the servers spent {server_cpu_s(weed):.1f} s and {server_cpu_s(moto):.1f} s "
        "of CPU on the critical path",
    )


def run(quick: bool) -> Result:
    cfg, ks, repeats = (QUICK, (2, 4), 1) if quick else (FULL, (2, 4, 8), 3)
    params = sum(s.numel() for s in shapes(cfg).values())
    model_bytes = 4 * params
    res = Result(
        "dataplane",
        settings={"model": cfg.__dict__, "params": params, "K": ks, "codec": "fp32", "repeats": repeats},
    )
    with tempfile.TemporaryDirectory() as tmp:
        on = {name: measure_on(server, cfg, ks, repeats) for name, server in endpoints(Path(tmp)).items()}
    res.raw = {**on["moto"], "seaweedfs": on["seaweedfs"]}
    for k in ks:
        res.rows.append(throughput_row(k, res.raw[f"k{k}"]))
    for k in ks:
        peak = res.raw[f"k{k}"]["peak_rss_over_baseline"]
        res.rows.append(
            at_most(
                f"dataplane: synchronizer peak memory over idle, MiB, K={k}",
                peak / 2**20,
                1024.0,
                f"{peak / model_bytes:.2f}× the model's bytes; flat in K and in the model's size: θ, the "
                "momentum and the deltas are read and the round's objects written synchronizer.chunk_mb "
                "(64) at a time, so the peak is a fixed multiple of it plus the process's own",
            )
        )
    for k in ks:
        res.rows.append(endpoint_row(k, on["moto"][f"k{k}"], on["seaweedfs"][f"k{k}"]))
    return res


def run_memory(quick: bool) -> Result:
    """The `merge_memory` part: the merge's peak memory at two model sizes."""
    sizes, codecs = (["20M", "80M"], ["int8"]) if quick else (["100M", "1B"], ["fp32", "int8"])
    return memory_result(sizes, codecs, 64)


def memory_result(sizes: list[str], codecs: list[str], chunk_mb: int) -> Result:
    got = {codec: {size: memory_at(SIZES[size], 4, codec, chunk_mb) for size in sizes} for codec in codecs}
    settings = {"sizes": sizes, "codecs": codecs, "K": 4, "chunk_mb": chunk_mb}
    return Result("merge_memory", rows=memory_rows(got), raw=got, settings=settings)


def memory_rows(got: dict[str, dict[str, dict]]) -> list[Row]:
    """The streaming merge's peak memory over idle at each size and codec (below 1 GiB), and the
    ratio between consecutive sizes (within 25% of 1: the same whatever the model's size)."""
    rows = []
    for codec, at in got.items():
        for size, m in at.items():
            rows.append(
                at_most(
                    f"merge memory: peak RSS over idle, MiB, {size} ({m['params'] / 1e6:.0f}M), K=4, {codec}",
                    m["peak_rss_over_idle"] / 2**20,
                    1024.0,
                )
            )
        for a, b in zip(at, list(at)[1:]):
            rows.append(
                within(
                    f"merge memory: peak RSS over idle, {b} / {a}, K=4, {codec}",
                    at[b]["peak_rss_over_idle"] / at[a]["peak_rss_over_idle"],
                    1.0,
                    0.25,
                    "θ, the outer state and every delta are read, merged and written synchronizer.chunk_mb "
                    "at a time, so the peak is a multiple of the chunk, not of the model",
                )
            )
    return rows


def child() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", type=int, required=True)
    p.add_argument("--s3", required=True)
    p.add_argument("--server-pid", type=int, required=True)
    args = p.parse_args()
    print(json.dumps(measure(args.child, json.loads(sys.stdin.read()), args.s3, args.server_pid)))


SIZES = {"20M": 20_000_000, "80M": 80_000_000, "100M": 100_000_000, "1B": 1_000_000_000}
VOCAB = 50_257  # a GPT-2 embedding's rows: the largest tensor, merged by chunks of rows


def synthetic_shapes(params: int) -> dict[str, tuple[int, ...]]:
    """A GPT-like model of about `params` parameters: an embedding of VOCAB rows, then (4d, d)
    matrices each with a (d,) bias, d growing with the size."""
    d = 256 if params < 50_000_000 else 1024 if params < 500_000_000 else 2048
    out: dict[str, tuple[int, ...]] = {"wte.weight": (VOCAB, d)}
    total, i = VOCAB * d, 0
    while total < params:
        out[f"h.{i}.weight"], out[f"h.{i}.bias"] = (4 * d, d), (d,)
        total, i = total + 4 * d * d + d, i + 1
    return out


def _synthetic_object(folder: Path, shapes_: dict, seed: int, scale: float, codec: str, metadata: dict):
    """An object of random tensors in `codec`'s wire form, written a chunk at a time to part
    files (never whole in memory)."""
    from islands.core.compress import quantized_wire
    from islands.storage.codec import TensorFileWriter

    writer = TensorFileWriter(folder)
    g, step = torch.Generator().manual_seed(seed), 2**22
    for name, shape in shapes_.items():
        n, streams = math.prod(shape), None
        for start in range(0, n, step):
            chunk = torch.randn(min(step, n - start), generator=g) * scale
            wire = quantized_wire({name: chunk}, codec)
            streams = streams or writer.coded(name, list(shape), wire)
            for key, stream in streams.items():
                stream.write(wire[key])
        for stream in streams.values():
            stream.close()
    return writer.finish(metadata)


def write_synthetic(folder: Path, params: int, k: int, codec: str) -> dict:
    """θ, the outer state and K deltas of `params` parameters in a file:// store under `folder`."""
    from islands.storage.rounds import put_encoded

    stores = Stores(f"file://{folder}/buckets/{{bucket}}", REGIONS)
    conf, run, shapes_ = memory_config(k, codec, 64), f"memory-k{k}", synthetic_shapes(params)
    parts = folder / "parts"
    parts.mkdir()
    refs: dict = {"deltas": []}
    for i, (what, scale) in enumerate([("model", 0.02), ("outer", 1e-3)]):
        obj = _synthetic_object(parts / what, shapes_, i, scale, "fp32", {})
        key_for = layout.model_key if what == "model" else layout.outer_key
        refs[what] = put_encoded(stores.global_, lambda sha, f=key_for: f(run, 0, sha), obj).model_dump()
    for i, (learner, region, _) in enumerate(conf.learners()):
        meta = {
            "run": run,
            "learner": learner,
            "region": region,
            "phase": "0",
            "base_round": "0",
            "inner_steps": "50",
            "tokens": "102400",
            "loss": "3.0",
            "seconds": "1.0",
            "finished_at": str(time.time()),
            "codec": codec,
        }
        obj = _synthetic_object(parts / learner, shapes_, 10 + i, 1e-3, codec, meta)
        key = layout.delta_key(run, learner, 0)
        stores.region(region).put_if_absent(key, obj)
        refs["deltas"].append([region, key, obj.size])
    shutil.rmtree(parts)
    return refs


def memory_config(k: int, codec: str, chunk_mb: int) -> RunConfig:
    return RunConfig(
        run_id=f"memory-k{k}",
        regions=REGIONS,
        learners_per_region=k // len(REGIONS),
        speed={},
        codec=codec,
        synchronizer={"chunk_mb": chunk_mb},
    )


def merge_memory(folder: Path, refs: dict, k: int, codec: str, chunk_mb: int) -> dict:
    """In a child: read θ_{r−1}, the outer state and the K deltas, validate and merge them and
    write the round's objects, as the synchronizer does; its peak memory over its memory before."""
    from islands.tasks.collect import Arrival, inspect_all
    from islands.tasks.merge_step import Merged, apply_merge
    from islands.tasks.publish import write_objects
    from islands.tasks.round_state import RoundState

    torch.set_num_threads(2)
    return_freed_memory()  # as every islands command does at its start
    stores = Stores(f"file://{folder}/buckets/{{bucket}}", REGIONS)
    state = RoundState(
        memory_config(k, codec, chunk_mb), f"memory-k{k}", 1, stores, [(parent_of(refs), "0" * 64)], {}, None
    )
    baseline = vm("VmRSS")
    t0 = time.perf_counter()
    state.read_parent()
    arrivals = inspect_all(state, [tuple(d) for d in refs["deltas"]])
    bad = [a.reason for a in arrivals if not isinstance(a, Arrival)]
    if bad:
        raise RuntimeError(f"the synthetic deltas were refused: {bad[:2]}")
    model_object, update, outer, _, _ = apply_merge(state, arrivals, state.config.merge)
    write_objects(state, Merged(None, model_object, update, outer, [], []))
    state.drop_spool()
    return {"peak_rss_over_idle": vm("VmHWM") - baseline, "idle_rss": baseline, "seconds": time.perf_counter() - t0}


def memory_at(params: int, k: int = 4, codec: str = "fp32", chunk_mb: int = 64) -> dict:
    """The merge's peak memory over its idle memory at `params` parameters, measured in a child."""
    with tempfile.TemporaryDirectory(prefix="islands-merge-memory-") as tmp:
        refs = write_synthetic(Path(tmp), params, k, codec)
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.dataplane", "--memory-child", tmp, str(k), codec, str(chunk_mb)],
            input=json.dumps(refs),
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            raise RuntimeError(f"merge memory child failed:\n{out.stderr[-3000:]}")
        return {"params": sum(math.prod(s) for s in synthetic_shapes(params).values())} | json.loads(
            out.stdout.strip().splitlines()[-1]
        )


def memory_report(sizes: list[str], codecs: list[str], chunk_mb: int) -> bool:
    """Print the merge's memory rows for these sizes and codecs; True when every row holds."""
    res = memory_result(sizes, codecs, chunk_mb)
    print(table([res]), flush=True)
    return all(row.holds for row in res.rows)


if __name__ == "__main__":
    if "--child" in sys.argv:
        child()
    elif "--memory-child" in sys.argv:
        folder, k, codec, chunk_mb = sys.argv[sys.argv.index("--memory-child") + 1 :][:4]
        print(json.dumps(merge_memory(Path(folder), json.loads(sys.stdin.read()), int(k), codec, int(chunk_mb))))
    elif "--sizes" in sys.argv:
        p = argparse.ArgumentParser()
        p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=["100M", "1B"])
        p.add_argument("--codecs", nargs="+", default=["fp32", "int8"])
        p.add_argument("--chunk-mb", type=int, default=64)
        args = p.parse_args()
        sys.exit(0 if memory_report(args.sizes, args.codecs, args.chunk_mb) else 1)
    else:
        standalone(run)
