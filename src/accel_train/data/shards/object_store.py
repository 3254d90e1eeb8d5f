"""The object store behind a shard set: s3:// URLs, the endpoint and the boto3 client, and
botocore's failures as one paragraph each. Kept apart from the shard format so that the
writer (`accel-data shard`) and every streaming option share one place that knows S3, and
the rest never touches boto3 or credentials.
"""

from __future__ import annotations

import os
import re

from accel_train.errors import UserError


def is_s3(url: str) -> bool:
    return str(url).startswith("s3://")


_BUCKET = re.compile(r"^[a-zA-Z0-9.\-_]{1,255}$")  # botocore's own check of a bucket name


def check_url(url: str, key: str) -> None:
    """A URL that is not a well-formed s3://bucket/prefix would reach botocore as a raw
    validation dump, or (`s3:/b`, `s3://`) become a local folder named `s3:`."""
    text = str(url)
    scheme = text.split("://")[0] if "://" in text else None
    if scheme is None and not text.lower().startswith("s3:"):
        return  # a local folder
    example = f"`{key}=s3://my-bucket/imagenette`"
    if scheme != "s3":
        raise UserError(
            f"{key}={url}: shard sets live in a local folder or at an s3://bucket/prefix URL, "
            f"and this is neither. Write e.g. {example}."
        )
    bucket = split_url(text)[0]
    if not _BUCKET.match(bucket):
        what = f"{bucket!r} is not a bucket name" if bucket else "it names no bucket"
        raise UserError(
            f"{key}={url}: {what} (a bucket name is letters, digits, dots and hyphens). Write "
            f"{key}=s3://<bucket>/<prefix>, e.g. {example}."
        )


def endpoint_url() -> str | None:
    """The S3 endpoint from the standard places: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL
    (boto3 reads both, and ~/.aws/config's endpoint_url), else S3_ENDPOINT_URL (s3cmd's and
    MinIO's spelling, which boto3 ignores); None = AWS itself."""
    for key in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL"):
        if os.environ.get(key):
            return os.environ[key]
    return None


def storage_options() -> dict[str, str]:
    """What LitData's boto3 client is built with: only the endpoint when boto3 would not find
    it by itself. Credentials are never passed: boto3 reads them from the environment and
    ~/.aws/, so they never reach a config, a log or a checkpoint."""
    url = os.environ.get("S3_ENDPOINT_URL")
    if url and not (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")):
        return {"endpoint_url": url}
    return {}


def allow_plain_http() -> None:
    """The shim for plain-http endpoints (on-prem MinIO, moto): LitData 0.2.76 builds obstore
    stores with fixed client options that lack `allow_http`, so every chunk GET/PUT to an
    http:// endpoint fails with obstore's `BadScheme` builder error (obstore issue 159). Adding
    the option to LitData's module-level options is what an upstream fix would do; https
    endpoints are left alone. Called in every process that reads (spawned workers too)."""
    url = endpoint_url() or _configured_endpoint()
    if not url or not url.lower().startswith("http://"):
        return
    try:
        from litdata.streaming import downloader
    except ImportError:  # pragma: no cover - litdata is a dependency
        return
    options = getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", None)
    if isinstance(options, dict):
        options["allow_http"] = "true"


def _configured_endpoint() -> str | None:
    """endpoint_url from ~/.aws/config (the profile boto3 uses), if any."""
    try:
        import botocore.session

        return botocore.session.Session().get_scoped_config().get("endpoint_url")
    except Exception:  # noqa: BLE001 - an unreadable profile is boto3's error to report later
        return None


def s3_client():
    """A boto3 S3 client as LitData builds one, with standard retries: transient errors
    (throttling, 5xx, dropped connections) are retried with exponential back-off."""
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "standard"}, connect_timeout=10, read_timeout=60)
    return boto3.client("s3", config=config, **storage_options())


def split_url(url: str) -> tuple[str, str]:
    """s3://bucket/a/b -> (bucket, "a/b")."""
    rest = url[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    return bucket, prefix.strip("/")


def s3_error(err: Exception, url: str, key: str) -> UserError:
    """A boto3/botocore failure on ``url`` as one paragraph that says what to check."""
    from botocore.exceptions import (
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    where = endpoint_url() or "AWS's default endpoint"
    if isinstance(err, EndpointConnectionError | ConnectionError) or "Could not connect" in str(
        err
    ):
        return UserError(
            f"{key}={url}: cannot reach the S3 endpoint {where} (after retries). Check that the "
            "server is up and that AWS_ENDPOINT_URL (or S3_ENDPOINT_URL, or endpoint_url in "
            "~/.aws/config) points at it."
        )
    if isinstance(err, NoCredentialsError | PartialCredentialsError):
        return UserError(
            f"{key}={url}: no S3 credentials found. Set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY in the environment, or a profile in ~/.aws/credentials "
            "(AWS_PROFILE); accel-train never reads them from its config."
        )
    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", ""))
        bucket = split_url(url)[0]
        if code == "NoSuchBucket":
            return UserError(
                f"{key}={url}: the bucket {bucket!r} does not exist at {where}. Check the "
                "bucket name and the endpoint (AWS_ENDPOINT_URL)."
            )
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
            return UserError(
                f"{key}={url}: the S3 endpoint {where} refused the credentials ({code}). Check "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the ~/.aws/ profile) and the "
                "bucket's permissions."
            )
        return UserError(f"{key}={url}: the S3 endpoint {where} answered {code}: {err}.")
    return UserError(f"{key}={url}: {type(err).__name__}: {err}")
