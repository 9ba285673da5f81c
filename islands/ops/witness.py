"""The chain head's second witness: each round's manifest sha256 as its Prefect artifact recorded it.

The hash chain proves every round from the newest manifest down, but nothing vouches for the
newest one itself: whoever can write the global bucket can re-hash the whole chain consistently.
The synchronizer records each committed manifest's sha256 in the Prefect API too
(flows.artifacts), where storage credentials do not reach, and `islands audit` compares the two
when that API is configured and answers.
"""

from __future__ import annotations

import itertools
import json
import re
from collections import defaultdict
from dataclasses import dataclass

from islands.infra.prefect_server import api_healthy
from islands.storage import layout

PAGE = 200  # artifacts asked for at once (the API's default page limit)


@dataclass(frozen=True)
class Witness:
    api: str  # the Prefect API the records were read from
    shas: dict[int, set[str]]  # round → every sha256 recorded for its manifest


def read_witness(run: str, global_url: str) -> Witness | None:
    """The manifest sha256s recorded for `run`'s rounds in `global_url`, or None when no Prefect
    API is configured or it does not answer (the audit then says it checked storage alone)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    if not api or not api_healthy(api):
        return None
    key = re.compile(rf"{re.escape(run)}-round-(\d+)-sha256")
    shas: dict[int, set[str]] = defaultdict(set)
    keys = ArtifactFilter(key=ArtifactFilterKey(like_=f"{run}-round-%-sha256"))
    with get_client(sync_client=True) as client:
        for offset in itertools.count(0, PAGE):  # ends at the first page that is not full
            page = client.read_artifacts(artifact_filter=keys, limit=PAGE, offset=offset)
            for artifact in page:
                if (m := key.fullmatch(artifact.key or "")) is None:
                    continue
                r = int(m.group(1))
                rows = json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data
                for row in rows:
                    if row.get("manifest") == f"{global_url}/{layout.manifest_key(run, r)}":
                        shas[r].add(str(row.get("sha256")))
            if len(page) < PAGE:
                break
    return Witness(api, dict(shas))
