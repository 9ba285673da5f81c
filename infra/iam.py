"""IAM policy documents for the two roles, rendered from the templates in infra/iam/.

A learner may write only its own region's bucket, under its run (deltas and its saved state), and
read the published rounds; the synchronizer (and the driver, which shares its credentials) reads
every regional bucket and writes the global one. Templates name `${GlobalBucket}`,
`${RegionBucket}` and `${Run}`; a resource naming `${RegionBucket}` becomes one resource per
region, and `--run '*'` grants every run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from storage.store import bucket_url

ROLES = ("learner", "synchronizer")
TEMPLATES = Path(__file__).with_name("iam")


def bucket_name(template: str, bucket: str) -> str:
    """The S3 bucket a store template gives, e.g. islands-north for s3://islands-{bucket}."""
    url = bucket_url(template, bucket)
    if not url.startswith("s3://"):
        raise ValueError(f"IAM policies apply to s3:// stores, not {template!r}")
    return url.removeprefix("s3://").split("/", 1)[0]


def policy(role: str, run: str, template: str, regions: list[str]) -> dict:
    """The policy document of `role` for `run`; a learner's `regions` is its one region."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
    if role == "learner" and len(regions) != 1:
        raise ValueError(f"a learner's policy names exactly one region, got {regions}")
    doc = json.loads((TEMPLATES / f"{role}-policy.json").read_text())
    fixed = {"${GlobalBucket}": bucket_name(template, "global"), "${Run}": run}

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
    p = argparse.ArgumentParser(prog="python -m infra.iam", description=main.__doc__)
    p.add_argument("role", choices=ROLES)
    p.add_argument("--run", required=True, help="run id, or '*' for every run")
    p.add_argument("--regions", required=True, help="the learner's region, or every region for the synchronizer")
    p.add_argument("--store", default="s3://islands-{bucket}", help="bucket URL template")
    args = p.parse_args(argv)
    print(json.dumps(policy(args.role, args.run, args.store, args.regions.split(",")), indent=2))


if __name__ == "__main__":
    main()
