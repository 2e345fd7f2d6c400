"""Conditional writes on Google Cloud Storage and Azure Blob through each cloud's own client (gcsfs
and adlfs carry every other byte, but take no replace precondition): ``objects_for``.

GCS (``gs://``, ``gcs://``): the tag is the generation. Azure (``az://``, ``abfs://``,
``abfss://``): the tag is the ETag. A refused precondition is a ``Conflict`` (by exception type);
any other failed write is ``Uncertain``, retried by the client for about 15 s first. One client per
process.
"""

from __future__ import annotations

import logging
import os

from spill.errors import StoreError
from spill.store.cas.store import Conflict, Uncertain
from spill.store.location import CLOUD_HINT, BackendMissing

log = logging.getLogger(__name__)

GCS = frozenset({"gs", "gcs"})
AZURE = frozenset({"az", "abfs", "abfss"})

_clients: dict[tuple[int, str], object] = {}


def _split(path: str) -> tuple[str, str]:
    """``bucket/key`` (fsspec's path of an object) -> ``(bucket, key)``."""
    bucket, _, key = path.partition("/")
    return bucket, key


class Objects:
    """Read with its tag, create or replace conditionally: one cloud's answers."""

    def read(self, path: str) -> tuple[bytes | None, str | None]:
        raise NotImplementedError

    def write(self, path: str, data: bytes, tag: str | None) -> str:
        """Create (``tag`` None) or replace the object whose tag is ``tag``; the new tag."""
        raise NotImplementedError


# ``ifGenerationMatch`` (0 to create). Application default credentials; ``STORAGE_EMULATOR_HOST``
# for an emulator.
class GcsObjects(Objects):
    def __init__(self) -> None:
        try:
            from google.api_core import exceptions  # lazy: the cloud extra
            from google.cloud import storage
        except ImportError:
            raise BackendMissing(f"gs:// needs google-cloud-storage; {CLOUD_HINT}") from None
        from google.cloud.storage.retry import DEFAULT_RETRY  # lazy: the cloud extra

        self.exceptions = exceptions
        # retried after about 1, 2, 4 and 8 s, then uncertain (the default keeps on for 120 s:
        # a transition that loses its answers would give up only after ATTEMPTS x 2 minutes)
        self.retry = DEFAULT_RETRY.with_timeout(15.0)
        key = (os.getpid(), "gs")
        if key not in _clients:
            try:
                _clients[key] = storage.Client()
            except Exception as e:  # no application default credentials, mostly
                raise StoreError(
                    f"gs://: cannot make a Cloud Storage client ({type(e).__name__}: {e}); set up "
                    "application default credentials (gcloud auth application-default login)"
                ) from None
        self.client = _clients[key]

    def _blob(self, path: str):
        bucket, key = _split(path)
        return self.client.bucket(bucket).blob(key)

    def read(self, path: str) -> tuple[bytes | None, str | None]:
        # a fresh Blob per read: one that was read asks for that generation again (404 once
        # replaced; tests/func/test_gcs_emulator.py)
        blob = self._blob(path)
        try:
            data = blob.download_as_bytes()  # sets blob.generation from the same answer
        except self.exceptions.NotFound:
            return None, None
        return data, str(blob.generation)

    def write(self, path: str, data: bytes, tag: str | None) -> str:
        blob = self._blob(path)
        want = 0 if tag is None else int(tag)
        try:
            blob.upload_from_string(data, if_generation_match=want, retry=self.retry)
        except self.exceptions.PreconditionFailed:
            raise Conflict() from None
        except self.exceptions.NotFound:  # the bucket went (the probe names a missing one)
            raise Conflict() from None
        except Exception as e:
            log.info(
                "uncertain write of gs://%s (%s: %s); reading it back", path, type(e).__name__, e
            )
            raise Uncertain() from None
        return str(blob.generation)


def _azure_service():
    from azure.storage.blob import BlobServiceClient, ExponentialRetry  # lazy: the cloud extra

    # a lost answer retried after about 1, 3 and 9 s, not the default 15, 18 and 24: a control
    # transition that waits a minute for one dropped connection eats half a lease
    retry = {"retry_policy": ExponentialRetry(initial_backoff=1, increment_base=2, retry_total=3)}
    conn = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
    if conn:
        return BlobServiceClient.from_connection_string(conn, **retry)
    account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME")
    if not account:
        raise StoreError(
            "az://: no Azure storage account given; set AZURE_STORAGE_CONNECTION_STRING, or "
            "AZURE_STORAGE_ACCOUNT_NAME (with AZURE_STORAGE_ACCOUNT_KEY or an Azure login)"
        )
    credential = os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
    if not credential:
        from azure.identity import DefaultAzureCredential  # lazy: the cloud extra

        credential = DefaultAzureCredential()
    url = f"https://{account}.blob.core.windows.net"
    return BlobServiceClient(url, credential=credential, **retry)


# ``If-None-Match: *`` / ``If-Match``. ``AZURE_STORAGE_CONNECTION_STRING``, else
# ``AZURE_STORAGE_ACCOUNT_NAME`` with ``AZURE_STORAGE_ACCOUNT_KEY`` or ``DefaultAzureCredential``
# (as adlfs reads them).
class AzureObjects(Objects):
    def __init__(self) -> None:
        try:
            from azure.core import MatchConditions, exceptions  # lazy: the cloud extra
        except ImportError:
            raise BackendMissing(f"az:// needs azure-storage-blob; {CLOUD_HINT}") from None
        self.exceptions, self.if_not_modified = exceptions, MatchConditions.IfNotModified
        key = (os.getpid(), "az")
        if key not in _clients:
            try:
                _clients[key] = _azure_service()
            except ImportError:
                raise BackendMissing(f"az:// needs azure-storage-blob; {CLOUD_HINT}") from None
            except ValueError as e:  # a malformed connection string
                raise StoreError(
                    f"az://: AZURE_STORAGE_CONNECTION_STRING cannot be used ({e}); fix it"
                ) from None
        self.service = _clients[key]

    def _blob(self, path: str):
        container, key = _split(path)
        return self.service.get_blob_client(container, key)

    def read(self, path: str) -> tuple[bytes | None, str | None]:
        try:
            got = self._blob(path).download_blob()
            data = got.readall()
        except self.exceptions.ResourceNotFoundError:
            return None, None
        return data, got.properties.etag.strip('"')

    def write(self, path: str, data: bytes, tag: str | None) -> str:
        blob, x = self._blob(path), self.exceptions
        try:
            if tag is None:  # overwrite=False is If-None-Match: *
                done = blob.upload_blob(data, overwrite=False)
            else:
                done = blob.upload_blob(
                    data, overwrite=True, etag=f'"{tag}"', match_condition=self.if_not_modified
                )
        except (x.ResourceExistsError, x.ResourceModifiedError, x.ResourceNotFoundError):
            raise Conflict() from None  # 409 a second create, 412 a stale tag, 404 no container
        except Exception as e:
            log.info(
                "uncertain write of az://%s (%s: %s); reading it back", path, type(e).__name__, e
            )
            raise Uncertain() from None
        return done["etag"].strip('"')


def objects_for(scheme: str) -> Objects | None:
    """The conditional writer of a cloud scheme; None for one fsspec writes (s3://, memory://)."""
    if scheme in GCS:
        return GcsObjects()
    if scheme in AZURE:
        return AzureObjects()
    return None
