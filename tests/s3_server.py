"""A real S3 server on 127.0.0.1 (moto's server mode) for the object-storage tests: the test
process and every rank it forks or launches reach it through the standard AWS variables."""

import contextlib
import os

ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")


def forget_clients() -> None:
    """fsspec keeps one S3 file system per set of arguments: a changed endpoint or credential
    is seen only by a new one."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()


@contextlib.contextmanager
def s3_server(*buckets: str):
    """Start the server with `buckets`; yields a boto3 client of it. The AWS variables point
    at it while it runs (restored after)."""
    import boto3
    import s3fs
    from moto.server import ThreadedMotoServer

    # held here: a module fixture's teardown runs under its module's last test, which may
    # not be marked as needing s3fs (the suite fails an unmarked import)
    forget = s3fs.S3FileSystem.clear_instance_cache
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(
        AWS_ACCESS_KEY_ID="titan-test",
        AWS_SECRET_ACCESS_KEY="titan-test",
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_DEFAULT_REGION="us-east-1",
    )
    forget()
    try:
        client = boto3.client("s3")
        for bucket in buckets:
            client.create_bucket(Bucket=bucket)
        yield client
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        forget()


def keys(client, bucket: str, prefix: str = "") -> list[str]:
    """Every object key under `prefix`, sorted."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))
