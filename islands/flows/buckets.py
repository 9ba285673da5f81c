"""The buckets a run writes must exist, and keep what it writes, before its first write.

A run started from the UI of the embedded stack may name regions `islands up` never created a
bucket for; on that loopback endpoint the missing buckets are created (the global one with S3
Object Lock when the run asks for object_lock_days). Anywhere else buckets are the operator's
(IAM, region, retention), so a missing one fails the run at once, by name. Then the global
bucket must refuse a second create-only write of one key (storage.probe), and hold objects under
retention if the run asks for it.
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

from islands.core.config import RunConfig
from islands.storage.probe import check_create_only
from islands.storage.store import Stores

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def embedded_endpoint() -> str | None:
    """AWS_ENDPOINT_URL when it is a loopback S3 endpoint (the embedded stack's), else None."""
    url = os.environ.get("AWS_ENDPOINT_URL")
    return url if url and urlparse(url).hostname in LOOPBACK else None


def prepare_buckets(config: RunConfig, stores: Stores) -> None:
    """Create the run's missing buckets on the embedded endpoint; elsewhere check they answer.
    Then check that the store keeps create-only writes and, when asked, retention."""
    endpoint = embedded_endpoint()
    if config.store is None and endpoint:
        from islands.infra.s3_server import create_buckets

        bucket = urlparse(stores.global_.url).netloc
        create_buckets(
            endpoint, [urlparse(s.url).netloc for s in stores.all()], [bucket] if config.object_lock_days else []
        )
    for store in stores.all():
        store.check_reachable()
    check_create_only(stores.global_)
    if config.object_lock_days is not None:
        stores.global_.check_retention()
