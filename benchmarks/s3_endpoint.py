"""The embedded S3 endpoint's CPU per request: moto's S3 app served directly
(infra.s3_server.serve_s3) against moto's own server, which works out for each request which of
its services it is for, side by side.

Both endpoints run on threads of this process, so this process's CPU (boto3's side and the
server's) over the same requests is compared: HEADs of existing keys and, one in ten, a LIST
after a key, the polls the learners and the synchronizer make all run long. Alternating, each
on a fresh endpoint. The bar is ours, not the issue's: serving S3 directly must cost at least
1.1× less CPU a request, or the endpoint is not worth its own server code. An ablation beside
the suite: `--only s3_endpoint`.
"""

from __future__ import annotations

import logging
import time

from benchmarks.report import Result, at_least, standalone
from islands.infra.process import LOOPBACK
from islands.infra.s3_server import client, serve_s3, serve_wsgi

BUCKET = "bench-s3-endpoint"


def moto_server():
    """moto's own server (what `moto.server.ThreadedMotoServer` runs) on a thread of this process."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app

    return serve_wsgi(DomainDispatcherApplication(create_backend_app), LOOPBACK)


def cpu_per_request_ms(server, requests: int, keys: int) -> float:
    """This process's CPU milliseconds per request against `server`, which is shut down after."""
    try:
        s3 = client(f"http://{LOOPBACK}:{server.server_address[1]}")
        s3.create_bucket(Bucket=BUCKET)
        for i in range(keys):
            s3.put_object(Bucket=BUCKET, Key=f"k/{i:04d}", Body=b"x" * 1000)
        t0 = time.process_time()
        for i in range(requests):
            if i % 10:
                s3.head_object(Bucket=BUCKET, Key=f"k/{i % keys:04d}")
            else:
                s3.list_objects_v2(Bucket=BUCKET, Prefix="k/", StartAfter=f"k/{keys - 10:04d}")
        return (time.process_time() - t0) * 1000 / requests
    finally:
        server.shutdown()


def run(quick: bool) -> Result:
    requests, keys, repeats = (150, 20, 1) if quick else (1500, 200, 2)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # as the endpoint's process runs: no line per request
    moto, direct = [], []
    for _ in range(repeats):
        moto.append(cpu_per_request_ms(moto_server(), requests, keys))
        direct.append(cpu_per_request_ms(serve_s3(LOOPBACK), requests, keys))
    res = Result(
        "s3_endpoint",
        settings={
            "requests": requests,
            "keys": keys,
            "repeats": repeats,
            "order": "alternating, each on a fresh endpoint",
        },
        raw={"moto_server_cpu_ms_per_request": moto, "s3_served_directly_cpu_ms_per_request": direct},
    )
    res.rows.append(
        at_least(
            "S3 endpoint: CPU per request, moto's server / S3 served directly",
            sum(moto) / sum(direct),
            1.1,
            "the dispatch is a small part of a request's CPU on this machine",
        )
    )
    return res


if __name__ == "__main__":
    standalone(run)
