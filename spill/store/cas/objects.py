"""Conditional writes on an object store (s3://, gs://, az://), refused unless ``probe`` accepts it.

S3: create with ``If-None-Match: *``, replace with ``If-Match: <etag>``, read body and ETag in
one GET; GCS and Azure through their own clients (``cloud``). A 412 (409 for a racing create)
is a ``Conflict``, told by the store's answer, never by "412" in an error's text; any other
failed write is ``Uncertain`` (it may have landed). ``probe`` creates twice and replaces with a
wrong and a stale tag under a scratch key, once per bucket and process: a store that accepts
any of them is refused in one line before anything is published. Nothing here deletes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import secrets

from spill.errors import StoreError
from spill.store.cas.cloud import objects_for
from spill.store.cas.store import ATTEMPTS, Conflict, Layout, Store, Uncertain, Unsupported
from spill.store.fs import filesystem
from spill.store.location import Location

log = logging.getLogger(__name__)


def _precondition_failed(e: BaseException | None) -> bool:
    """The store refused a conditional write (S3: 412 PreconditionFailed, 409 for a racing one),
    told by the error or its causes, never by "412" in the text (a bucket's name may hold it)."""
    while e is not None:
        answer = getattr(e, "response", None)
        answer = answer if isinstance(answer, dict) else {}
        said = f"{answer.get('Error', {}).get('Code', '')} {type(e).__name__} {e}"
        status = answer.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status == 412 or "PreconditionFailed" in said or "ConditionalRequestConflict" in said:
            return True
        e = e.__cause__ or e.__context__
    return False


class ObjectStore(Store):
    """An fsspec object store (s3://, gs://, az://; each if ``probe`` accepts it); on GCS and
    Azure its control objects are read and written by the cloud's own client (``cloud``)."""

    def __init__(self, state: Location | str, layout: Layout):
        super().__init__(state, layout)
        self.fs, _ = filesystem(self.state)  # parsed by Store
        self.cloud = objects_for(self.state.scheme)

    def _path(self, key: str) -> str:
        return filesystem(self.uri(key))[1]

    def read(self, key: str) -> tuple[bytes | None, str | None]:
        path = self._path(key)
        if self.cloud is not None:  # GCS, Azure: the body and its tag in one GET
            try:
                return self.cloud.read(path)
            except StoreError:
                raise
            except Exception as e:
                raise self._unreadable(key, e) from e
        if hasattr(self.fs, "_call_s3"):  # S3: the body and its ETag in one GET
            try:
                data, etag = self._get_s3(path)
            except FileNotFoundError:
                return None, None
            except Exception as e:
                raise self._unreadable(key, e) from e
            if etag:
                return data, etag.strip('"')
        for _ in range(ATTEMPTS):  # elsewhere: the ETag before and after the body must agree
            try:
                self.fs.invalidate_cache(path)
                before = self.fs.info(path).get("ETag")
                data = self.fs.cat_file(path)
                self.fs.invalidate_cache(path)
                after = self.fs.info(path).get("ETag")
            except FileNotFoundError:
                return None, None
            except Exception as e:
                raise self._unreadable(key, e) from e
            if before and before == after:
                return data, before.strip('"')
            if not before and not after:  # no ETag at all: nothing to make a write conditional on
                raise Unsupported(
                    f"{self.uri(key)}: this object store reports no ETag, so its writes cannot be "
                    "made conditional; use s3://, gs://, az:// (or a local disk) for the state"
                )
        raise StoreError(f"{self.uri(key)} changes faster than it can be read; try again")

    def _unreadable(self, key: str, e: Exception) -> StoreError:
        return StoreError(
            f"{self.uri(key)}: cannot read ({type(e).__name__}: {e}); check the location and "
            "its credentials"
        )

    def _get_s3(self, path: str) -> tuple[bytes, str | None]:
        from fsspec.asyn import sync  # lazy: fsspec, only for a remote location

        bucket, key, _ = self.fs.split_path(path)

        async def get() -> tuple[bytes, str | None]:
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            try:
                return await resp["Body"].read(), resp.get("ETag")
            finally:
                resp["Body"].close()

        return sync(self.fs.loop, get)

    def tag_of(self, data: bytes) -> str:
        # S3's ETag of a single PUT is the body's MD5 (not with SSE-KMS: there a replace with
        # this tag fails once with 412, and the transition reads the real one)
        return hashlib.md5(data, usedforsecurity=False).hexdigest()

    def write(self, key: str, data: bytes, tag: str | None) -> str | None:
        path = self._path(key)
        if self.cloud is not None:
            return self.cloud.write(path, data, tag)  # its tag: a generation, an Azure ETag
        try:
            if tag is None:
                self.fs.pipe_file(path, data, mode="create")
            else:
                self.fs.pipe_file(path, data, IfMatch=f'"{tag}"')
        except (FileExistsError, FileNotFoundError):  # the key is there / not (If-Match)
            raise Conflict() from None
        except Exception as e:
            if _precondition_failed(e):  # s3fs: OSError(EINVAL) from a 412 ClientError
                raise Conflict() from None
            log.info("uncertain write of %s (%s: %s); reading it back", path, type(e).__name__, e)
            raise Uncertain() from None
        finally:
            self.fs.invalidate_cache(path)


_probed: set[str] = set()


def _bucket_there(store: ObjectStore, bucket: str) -> bool:
    try:
        return store.fs.exists(bucket)
    except Exception:  # a store that cannot say: the probe's writes will
        return True


def _wrong(tag: str | None) -> str:
    """A tag of the same form (an MD5, a generation, an Azure ETag) that is not ``tag``."""
    tag = tag or "0"
    return tag[:-1] + ("1" if tag[-1] != "1" else "2")


def probe(store: ObjectStore) -> None:
    """Refuse a store that does not refuse stale writes: under a scratch key, create twice,
    replace with a wrong and a stale tag; those three must fail, the good replace must land."""
    where = store.state.split("://", 1)[0] + "://" + filesystem(store.state)[1].split("/")[0]
    if where in _probed:
        return
    key = f".probe-{secrets.token_hex(8)}"
    bucket = where.split("://", 1)[1]
    if not _bucket_there(store, bucket):
        raise StoreError(
            f"{store.state}: bucket {bucket!r} does not exist (or these credentials cannot see "
            "it); create it, or fix the URI"
        )
    why = ""
    try:
        store.write(key, b"1", None)
        _, tag = store.read(key)
        try:
            store.write(key, b"2", None)
            why = "a second create of one key succeeded"
        except Conflict:
            try:
                store.write(key, b"5", _wrong(tag))
                why = "a replace with a wrong tag succeeded"
            except Conflict:
                store.write(key, b"3", tag)
                try:
                    store.write(key, b"4", tag)
                    why = "a replace with a stale tag succeeded"
                except Conflict:
                    pass
    except (Conflict, Uncertain) as e:
        why = f"a conditional write failed ({type(e).__name__.lower()})"
    except (TypeError, ValueError, NotImplementedError) as e:
        why = f"its backend takes no preconditions ({type(e).__name__}: {e})"
    except Unsupported:
        why = "it reports no ETag"
    finally:
        with contextlib.suppress(Exception):
            store.fs.rm(store._path(key))  # a scratch key, not a control object
    if why:
        raise Unsupported(
            f"{store.state}: this object store cannot make conditional writes ({why}), so two "
            "writers could not be kept apart; use s3://, gs://, az:// (or a local disk) for the state"
        )
    _probed.add(where)
