"""The buckets a run writes must exist before its first write.

A run started from the UI of the embedded stack may name regions `islands up` never created a
bucket for; on that loopback endpoint the missing buckets are created. Anywhere else buckets are
the operator's (IAM, region, retention), so a missing one fails the run at once, by name.
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

from storage.store import Stores
from tasks.core.config import RunConfig

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def embedded_endpoint() -> str | None:
    """AWS_ENDPOINT_URL when it is a loopback S3 endpoint (the embedded stack's), else None."""
    url = os.environ.get("AWS_ENDPOINT_URL")
    return url if url and urlparse(url).hostname in LOOPBACK else None


def prepare_buckets(config: RunConfig, stores: Stores) -> None:
    """Create the run's missing buckets on the embedded endpoint; elsewhere check they answer."""
    endpoint = embedded_endpoint()
    if config.store is None and endpoint:
        from infra.s3_server import create_buckets

        create_buckets(endpoint, [urlparse(s.url).netloc for s in stores.all()])
    for store in stores.all():
        store.check_reachable()
