"""IAM policy documents for the two roles, rendered from the templates in islands/infra/iam/.

Least privilege, per learner: a learner reads the published rounds of its run, and in its own
region's bucket creates only its own deltas and saved state (`deltas/<learner>/`,
`learners/<learner>/`) and the region's cache copies; it deletes only its own old states and
damaged cache copies. It cannot touch a region-mate's folders, another region or the global
bucket. The synchronizer (and the driver, which shares its credentials) reads every regional
bucket and creates objects in the global one; it deletes only heartbeats and probes, never a
manifest or checkpoint.

Every PutObject is allowed only with `If-None-Match` (the `s3:if-none-match` condition key;
`s3:ObjectCreationOperation` exempts the parts of a multipart upload, whose completion carries
the header), so on AWS no credential of a run can replace an object: a plain PUT is refused and
a create-only one over an existing key fails with 412.

Templates name `${GlobalBucket}`, `${RegionBucket}`, `${Run}` and `${Learner}`; a resource naming
`${RegionBucket}` becomes one resource per region, and `--run '*'` grants every run.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from islands.core.config import EMBEDDED_STORE, GLOBAL_BUCKET
from islands.storage.store import bucket_url

ROLES = ("learner", "synchronizer")
TEMPLATES = Path(__file__).with_name("iam")


def bucket_name(template: str, bucket: str) -> str:
    """The S3 bucket a store template gives, e.g. islands-north for s3://islands-{bucket}."""
    url = bucket_url(template, bucket)
    if not url.startswith("s3://"):
        raise ValueError(f"IAM policies apply to s3:// stores, not {template!r}")
    return url.removeprefix("s3://").split("/", 1)[0]


def policy(role: str, run: str, template: str, regions: list[str], learner: str | None = None) -> dict:
    """The policy document of `role` for `run`: a learner's names its one region and the learner
    (`<region>-<index>`, as the run names its learners); the synchronizer's names every region."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
    fixed = {"${GlobalBucket}": bucket_name(template, GLOBAL_BUCKET), "${Run}": run}
    if role == "learner":
        if len(regions) != 1:
            raise ValueError(f"a learner's policy names exactly one region, got {regions}")
        if learner is None or not re.fullmatch(rf"{re.escape(regions[0])}-\d+", learner):
            raise ValueError(
                f"learner: give the learner of region {regions[0]} the policy is for, e.g. {regions[0]}-0 (got {learner!r})"
            )
        fixed["${Learner}"] = learner
    doc = json.loads((TEMPLATES / f"{role}-policy.json").read_text())

    def expand(resource: str) -> list[str]:
        for name, value in fixed.items():
            resource = resource.replace(name, value)
        if "${RegionBucket}" not in resource:
            return [resource]
        return [resource.replace("${RegionBucket}", bucket_name(template, r)) for r in regions]

    for statement in doc["Statement"]:
        statement["Resource"] = [out for res in statement["Resource"] for out in expand(res)]
    return doc


def main(argv: list[str] | None = None) -> None:
    """Print a role's policy document, ready for `aws iam create-policy --policy-document`."""
    p = argparse.ArgumentParser(prog="python -m islands.infra.iam", description=main.__doc__)
    p.add_argument("role", choices=ROLES)
    p.add_argument("--run", required=True, help="run id, or '*' for every run")
    p.add_argument("--regions", required=True, help="the learner's region, or every region for the synchronizer")
    p.add_argument("--learner", help="the learner the policy is for (learner role), e.g. us-east-0")
    p.add_argument("--store", default=EMBEDDED_STORE, help="bucket URL template")
    args = p.parse_args(argv)
    try:
        doc = policy(args.role, args.run, args.store, args.regions.split(","), args.learner)
    except ValueError as exc:
        p.error(str(exc))
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
