"""A region's S3 credentials as a Prefect block: prefect-aws's `AwsCredentials`.

A learner deployment names the block (`credentials` parameter), so each region's learners sign
their requests with that region's keys, and an S3-compatible store's address travels with them
(`aws_client_parameters.endpoint_url`), whatever the worker's environment holds. The block is
read in the learner's own flow run; the keys never pass through the driver or the run's config.
"""

from __future__ import annotations

from prefect_aws import AwsCredentials


class CredentialsError(ValueError):
    pass


def storage_options(block: str) -> dict:
    """The s3fs options the named AwsCredentials block holds (an empty block: the usual chain)."""
    try:
        creds = AwsCredentials.load(block)
    except ValueError as exc:
        raise CredentialsError(
            f"credentials: no AwsCredentials block named {block!r} on the Prefect API ({exc}); "
            "create it (prefect block register -m prefect_aws, then in the UI or AwsCredentials(...).save) "
            "or drop the learner deployment's credentials parameter"
        ) from None
    options: dict = {}
    if creds.aws_access_key_id:
        options["key"] = creds.aws_access_key_id
    if creds.aws_secret_access_key is not None:
        options["secret"] = creds.aws_secret_access_key.get_secret_value()
    if creds.aws_session_token:
        options["token"] = creds.aws_session_token
    if creds.profile_name:
        options["profile"] = creds.profile_name
    client_kwargs = {}
    if creds.region_name:
        client_kwargs["region_name"] = creds.region_name
    endpoint = creds.aws_client_parameters.endpoint_url
    if endpoint:
        options["endpoint_url"] = endpoint
    if client_kwargs:
        options["client_kwargs"] = client_kwargs
    return options
