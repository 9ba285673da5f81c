"""Does the store really refuse a second create-only write of one key?

Every commit of this system rests on it: two synchronizers racing on a round must not both
publish a manifest, two drivers must not share an epoch. S3 refuses with 412 when the write
carries `If-None-Match: *`; an S3-compatible server that ignores the header (rclone's
`serve s3`, for one) answers 200 and replaces the object, and everything would look fine until
a race. So before a run writes anything, the driver writes one probe key twice.
"""

from __future__ import annotations

import secrets

from islands.storage import layout
from islands.storage.store import ObjectStore, StoreError


def check_create_only(store: ObjectStore) -> None:
    """Raise StoreError (one line) unless `store` keeps the first of two create-only writes of one
    key and refuses the second. The probe object is deleted again."""
    key = layout.probe_key(secrets.token_hex(8))
    try:
        first = store.put_if_absent(key, b"first")
        second = store.put_if_absent(key, b"second")
        kept = store.get(key)
    finally:
        store.delete(key)
    if first and not second and kept == b"first":
        return
    what = "replaced the first" if kept != b"first" else "was reported as written"
    raise StoreError(
        f"{store.url}: a second create-only write of one key {what}: this endpoint ignores If-None-Match, "
        "so two writers could both commit a round; use an S3 endpoint that honours conditional writes "
        "(AWS S3, SeaweedFS)"
    )
