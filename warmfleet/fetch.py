"""`warmfleet fetch-model SOURCE --dest DIR`: download an hf:// or s3:// model into a (node-local) cache directory.

Resumable (a partial file survives a killed process and is continued with an HTTP Range request),
verified (sha256 of LFS files and git blob ids as the hub lists them; MD5 ETags and sizes for S3),
idempotent (a complete directory costs one listing request and no transfer) and safe to run from
several pods at once (an flock per model directory). Also reads config.json summaries for the
operator. Needs the `fetch` extra (huggingface_hub, boto3), imported lazily; no paddle, no kopf.

`warmfleet fetch-model --adapters FILE --adapters-dir DIR [--watch-s SECONDS]` fetches the LoRA adapters the
operator lists (docs/lora.md "On Kubernetes") the same way, one directory each, adapter_config.json required; with
--watch-s it also deletes the directories the list has not named for --gc-after-s.

Directory layout under DEST (the model directory the server is started on):

    config.json, *.safetensors, tokenizer files, ...    the model, as the engine reads it
    .warmfleet/state.json                               files verified so far (size, digest, inode, ctime), revision
    .warmfleet/partial/<id>.part                        downloads in progress (resumed by the next run)
    .warmfleet/config-summary.json                      what config.json says (hidden size, dtype, ...)
    .warmfleet/lock                                     flock held while one process fetches
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

from warmfleet.source import (MODEL_PATTERNS, TOKENIZER_PATTERNS, ConfigSummary, ModelSource, parse_source,
                              summarize_config)

log = logging.getLogger("warmfleet.fetch")

META_DIR = ".warmfleet"
CONFIG_FILE = "config.json"
CHUNK_BYTES = 1 << 20
PROGRESS_EVERY_S = 5.0
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_RETRIES = 5
HUB_ENDPOINT = "https://huggingface.co"
CONFIG_MAX_BYTES = 1 << 20  # config.json as the operator reads it: a few KiB (multimodal ones ~100 KiB)


class FetchError(Exception):
    """One readable failure. `reason` is CamelCase (Unauthorized, NotFound, Unreachable, Integrity,
    NoSpace, NotWritable, BadConfig) and becomes the operator's condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class _Transient(Exception):
    """A failure worth retrying (connection lost, 5xx, short read); `restart` drops the partial file."""

    def __init__(self, message: str, restart: bool = False) -> None:
        super().__init__(message)
        self.restart = restart


@dataclass(frozen=True)
class RemoteFile:
    """One file to fetch: `digest` says how it is verified (sha256:, gitsha1:, md5: or size: for size only)."""

    name: str  # path relative to the model directory, '/'-separated
    size: int
    digest: str
    locator: str  # hf: resolve URL; s3: object key
    etag: str = ""  # s3: the ETag a ranged GET must still match


@dataclass(frozen=True)
class Listing:
    """A source's files at one revision (hf: commit; s3: a digest of the keys and ETags)."""

    revision: str
    files: list[RemoteFile]


@dataclass
class Body:
    """An open download: chunks from `start`; `start` is 0 when the server ignored the Range asked for."""

    chunks: Iterator[bytes]
    start: int
    trust_digest: bool = True  # False: the server says the digest does not describe the content (S3 SSE-KMS)


class Remote(Protocol):
    """A place files come from: the Hugging Face Hub or an S3-compatible store."""

    anonymous: bool

    def listing(self) -> Listing: ...

    def open(self, f: RemoteFile, start: int) -> contextlib.AbstractContextManager[Body]: ...

    def close(self) -> None: ...


# ---- the Hugging Face Hub (huggingface_hub for the API, URLs, auth headers and errors) ----

def _hub_error(exc: BaseException, what: str) -> FetchError:
    """Map huggingface_hub's and httpx's errors to one readable FetchError."""
    from huggingface_hub import errors as e

    chain: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in chain:
        chain.append(cur)
        cur = cur.__cause__ or cur.__context__
    for err in chain:
        status = getattr(getattr(err, "response", None), "status_code", None)
        if isinstance(err, e.GatedRepoError):
            return FetchError("Unauthorized", f"{what}: gated repository: the token (HF_TOKEN) must belong to an account that accepted its terms")
        if isinstance(err, e.RevisionNotFoundError):
            return FetchError("NotFound", f"{what}: revision not found")
        if isinstance(err, e.RemoteEntryNotFoundError if hasattr(e, "RemoteEntryNotFoundError") else e.EntryNotFoundError):
            return FetchError("NotFound", f"{what}: file not found")
        if isinstance(err, e.RepositoryNotFoundError):
            return FetchError("NotFound", f"{what}: repository not found, or private and HF_TOKEN is missing or lacks access")
        if status in (401, 403):
            detail = err.response.headers.get("X-Error-Message") or ("invalid credentials" if status == 401 else "forbidden")
            return FetchError("Unauthorized", f"{what}: the hub refused the credentials (HTTP {status}: {detail}); check HF_TOKEN")
        if isinstance(err, e.HfHubHTTPError) and status is not None:
            return FetchError("Unreachable", f"{what}: HTTP {status} from the hub")
        if type(err).__name__ in ("ConnectError", "ConnectTimeout", "ReadTimeout", "TimeoutException", "RemoteProtocolError"):
            return FetchError("Unreachable", f"{what}: cannot reach the hub ({type(err).__name__}: {err})")
    return FetchError("Unreachable", f"{what}: {type(exc).__name__}: {exc}")


class HubRemote:
    """hf://ORG/NAME@REVISION: the file list with sizes and hashes from one API call, files by ranged GET."""

    def __init__(self, src: ModelSource, *, token: str | None, endpoint: str | None, timeout_s: float) -> None:
        self.src = src
        self.token = token or None
        self.anonymous = self.token is None
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or HUB_ENDPOINT).rstrip("/")
        self.timeout_s = timeout_s
        self._client: Any = None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def listing(self) -> Listing:
        from huggingface_hub import HfApi, hf_hub_url

        api = HfApi(endpoint=self.endpoint, token=self.token or False)
        try:
            info = api.model_info(self.src.repo, revision=self.src.revision, files_metadata=True, timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - every failure becomes one readable line
            raise _hub_error(exc, f"{self.src.raw}") from exc
        if not info.sha or info.siblings is None:
            raise FetchError("BadConfig", f"{self.src.raw}: the hub's answer has no commit or file list ({self.endpoint})")
        files = []
        for s in info.siblings:
            if s.lfs is not None:
                size, digest = s.lfs.size, f"sha256:{s.lfs.sha256}"
            elif s.size is not None:
                size, digest = s.size, (f"gitsha1:{s.blob_id}" if s.blob_id else f"size:{s.size}")
            else:
                raise FetchError("BadConfig", f"{self.src.raw}: the hub lists {s.rfilename} without a size")
            url = hf_hub_url(self.src.repo, s.rfilename, revision=info.sha, endpoint=self.endpoint)
            files.append(RemoteFile(s.rfilename, size, digest, url))
        return Listing(info.sha, files)

    @contextlib.contextmanager
    def open(self, f: RemoteFile, start: int) -> Iterator[Body]:
        import httpx
        from huggingface_hub.utils import build_hf_headers

        headers = build_hf_headers(token=self.token or False)
        headers["Accept-Encoding"] = "identity"  # byte offsets must be offsets into the file
        if start:
            headers["Range"] = f"bytes={start}-"
        if self._client is None:
            # httpx drops Authorization when a redirect leaves the hub's origin (a CDN with a signed URL).
            self._client = httpx.Client(follow_redirects=True, timeout=httpx.Timeout(self.timeout_s, read=max(self.timeout_s, 60.0)))
        try:
            with self._client.stream("GET", f.locator, headers=headers) as resp:
                if resp.status_code in (401, 403):
                    detail = resp.headers.get("X-Error-Message") or resp.reason_phrase
                    raise FetchError("Unauthorized", f"{self.src.raw}: {f.name}: the hub refused the credentials (HTTP {resp.status_code}: {detail}); check HF_TOKEN")
                if resp.status_code == 404:
                    raise FetchError("NotFound", f"{self.src.raw}: {f.name} not found at commit {f.locator.split('/resolve/')[-1].split('/')[0]}")
                if resp.status_code == 416:
                    raise _Transient(f"{f.name}: range {start}- not satisfiable", restart=True)
                if resp.status_code >= 400:
                    raise _Transient(f"{f.name}: HTTP {resp.status_code}")
                got = start if resp.status_code == 206 else 0
                yield Body(resp.iter_bytes(), got)  # as received: a dropped connection loses nothing already sent
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise _Transient(f"{f.name}: {type(exc).__name__}: {exc}") from exc


# ---- S3-compatible stores (boto3) ----

_S3_AUTH = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "InvalidToken",
            "AuthorizationHeaderMalformed", "InvalidClientTokenId", "AllAccessDisabled"}
_S3_MISSING = {"NoSuchBucket", "NoSuchKey", "404", "NotFound"}


@dataclass(frozen=True)
class S3Credentials:
    """Static keys (from the credentials Secret); None fields fall back to boto3's default chain unless anonymous."""

    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None


class S3Remote:
    """s3://BUCKET/PREFIX on AWS or any S3-compatible endpoint (MinIO, Ceph, R2, ...): path-style when an endpoint is set."""

    def __init__(self, src: ModelSource, *, creds: S3Credentials | None, endpoint: str | None, region: str | None,
                 timeout_s: float, anonymous: bool = False) -> None:
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config

        self.src = src
        self.anonymous = anonymous
        self.endpoint = endpoint or None
        cfg = Config(connect_timeout=timeout_s, read_timeout=max(timeout_s, 60.0),
                     retries={"max_attempts": 3, "mode": "standard"},
                     s3={"addressing_style": "path"} if self.endpoint else None,
                     signature_version=UNSIGNED if anonymous else None)
        c = creds or S3Credentials()
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, region_name=region or os.environ.get("AWS_REGION") or "us-east-1",
            aws_access_key_id=c.access_key_id, aws_secret_access_key=c.secret_access_key,
            aws_session_token=c.session_token, config=cfg)
        self.key_prefix = f"{src.prefix}/" if src.prefix else ""

    def close(self) -> None:
        self.client.close()

    def _error(self, exc: BaseException, what: str) -> Exception:
        from botocore import exceptions as be

        where = f" at {self.endpoint}" if self.endpoint else ""
        if isinstance(exc, be.NoCredentialsError):
            return FetchError("Unauthorized", f"{what}: no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                                              "(spec.model.credentialsSecret)")
        if isinstance(exc, be.ClientError):
            err = exc.response.get("Error", {})
            code, msg = str(err.get("Code", "")), err.get("Message") or ""
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in _S3_AUTH or status in (401, 403):
                return FetchError("Unauthorized", f"{what}: the store refused the credentials ({code or status}: {msg}){where}; "
                                                  "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
            if code in _S3_MISSING or status == 404:
                return FetchError("NotFound", f"{what}: {code or 'not found'}{where}")
            if code in ("PreconditionFailed", "412"):
                return _Transient(f"{what}: the object changed while it was downloaded", restart=True)
            if code in ("InvalidRange", "416"):
                return _Transient(f"{what}: range not satisfiable", restart=True)
            return _Transient(f"{what}: {code or status}: {msg}")
        if isinstance(exc, (be.EndpointConnectionError, be.ConnectTimeoutError, be.ReadTimeoutError,
                            be.ConnectionClosedError, be.ResponseStreamingError)):
            return _Transient(f"{what}: cannot reach the store{where} ({type(exc).__name__})")
        return FetchError("Unreachable", f"{what}: {type(exc).__name__}: {exc}")

    def listing(self) -> Listing:
        files: list[RemoteFile] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.src.bucket, Prefix=self.key_prefix):
                for obj in page.get("Contents", []):
                    key, size, etag = obj["Key"], int(obj["Size"]), str(obj.get("ETag", "")).strip('"')
                    name = key[len(self.key_prefix):]
                    if not name or name.endswith("/"):
                        continue  # the prefix itself, or a "directory" marker
                    # A single-part upload's ETag is the MD5 of the bytes; a multipart one ("...-N") is not.
                    digest = f"md5:{etag}" if re.fullmatch("[0-9a-f]{32}", etag) else f"size:{size}"
                    files.append(RemoteFile(name, size, digest, key, etag))
        except Exception as exc:  # noqa: BLE001
            err = self._error(exc, self.src.raw)
            raise (err if isinstance(err, FetchError) else FetchError("Unreachable", str(err))) from exc
        revision = hashlib.sha256("\n".join(sorted(f"{f.name} {f.etag}" for f in files)).encode()).hexdigest()[:16]
        return Listing(revision, files)

    @contextlib.contextmanager
    def open(self, f: RemoteFile, start: int) -> Iterator[Body]:
        kw: dict[str, Any] = {"Bucket": self.src.bucket, "Key": f.locator}
        if f.etag:
            kw["IfMatch"] = f'"{f.etag}"'
        if start:
            kw["Range"] = f"bytes={start}-"
        try:
            resp = self.client.get_object(**kw)
        except Exception as exc:  # noqa: BLE001
            raise self._error(exc, f"{self.src.raw}: {f.name}") from exc
        body = resp["Body"]
        # SSE-KMS and SSE-C objects carry an ETag that is not the MD5 of their bytes: verify their size only.
        trust = resp.get("ServerSideEncryption") not in ("aws:kms", "aws:kms:dsse") and not resp.get("SSECustomerAlgorithm")
        got = start if resp.get("ContentRange") else 0

        def chunks() -> Iterator[bytes]:
            try:
                yield from body.iter_chunks(CHUNK_BYTES)
            except Exception as exc:  # noqa: BLE001
                raise self._error(exc, f"{self.src.raw}: {f.name}") from exc

        try:
            yield Body(chunks(), got, trust)
        finally:
            body.close()


# ---- the transfer: state, partial files, verification, progress ----

def _hasher(digest: str, size: int) -> Any:
    kind = digest.split(":", 1)[0]
    if kind == "sha256":
        return hashlib.sha256()
    if kind == "gitsha1":  # git's blob id: sha1 over "blob <size>\0" + content
        h = hashlib.sha1()
        h.update(b"blob %d\0" % size)
        return h
    if kind == "md5":
        return hashlib.md5()
    return None


def _matches(hasher: Any, digest: str) -> bool:
    return hasher is None or hasher.hexdigest() == digest.split(":", 1)[1].lower()


def _hash_file(path: Path, digest: str, size: int) -> bool:
    """Whether the file at `path` has `size` bytes and `digest` (read once)."""
    if path.stat().st_size != size:
        return False
    h = _hasher(digest, size)
    if h is None:
        return True
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(CHUNK_BYTES), b""):
            h.update(block)
    return _matches(h, digest)


@dataclass
class Progress:
    """Counts what a fetch did; logs a structured line at most every PROGRESS_EVERY_S and per file."""

    files: int
    total_bytes: int
    started: float = field(default_factory=time.monotonic)
    done_files: int = 0
    done_bytes: int = 0  # bytes in place (cached + resumed + transferred)
    transferred_bytes: int = 0  # bytes received in this run
    cached_files: int = 0
    resumed_files: int = 0
    _last_log: float = 0.0

    def fields(self) -> dict[str, Any]:
        secs = time.monotonic() - self.started
        return {"files": self.files, "files_done": self.done_files, "bytes": self.total_bytes, "bytes_done": self.done_bytes,
                "transferred_bytes": self.transferred_bytes, "cached_files": self.cached_files,
                "resumed_files": self.resumed_files, "seconds": round(secs, 3),
                "mib_per_s": round(self.transferred_bytes / (1 << 20) / secs, 2) if secs > 0 else 0.0}

    def add(self, n: int) -> None:
        self.done_bytes += n
        self.transferred_bytes += n
        now = time.monotonic()
        if now - self._last_log >= PROGRESS_EVERY_S:
            self._last_log = now
            log.info("progress", extra={"fields": self.fields()})


@dataclass
class Result:
    """What `fetch` left in `dest`."""

    dest: Path
    revision: str
    files: list[str]
    summary: ConfigSummary | None
    progress: Progress
    offline: bool = False  # the source was unreachable and a complete earlier copy was used


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


@contextlib.contextmanager
def _locked(path: Path, what: str) -> Iterator[None]:
    """An exclusive flock on `path`: replicas on one node fetch a model once; released when the process dies."""
    with path.open("a+") as fh:
        waited = 0.0
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if waited % 30 == 0:
                    log.info("waiting for another fetch of the same model", extra={"fields": {"model": what, "seconds": waited}})
                time.sleep(1.0)
                waited += 1
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _prepare(dest: Path) -> Path:
    meta = dest / META_DIR
    try:
        (meta / "partial").mkdir(parents=True, exist_ok=True)
        probe = meta / f".probe.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise FetchError("NotWritable", (
            f"cannot write {dest} ({exc.strerror}) as uid {os.getuid()} gid {os.getgid()}: the model cache must be "
            f"writable by this user (a hostPath cache: create it on each node owned by that uid, "
            f"e.g. `install -d -o {os.getuid()} -g {os.getgid()} -m 0775 /var/cache/warmfleet/models`; see docs/models.md)")) from exc
    return meta


def _filter(files: list[RemoteFile], patterns: Sequence[str]) -> list[RemoteFile]:
    from fnmatch import fnmatch

    return [f for f in files if any(fnmatch(f.name, p) for p in patterns)]


def _partial_path(meta: Path, f: RemoteFile) -> Path:
    # Named by content: an upstream change to the file never resumes onto the old bytes.
    return meta / "partial" / (hashlib.sha256(f"{f.name}\0{f.digest}\0{f.size}".encode()).hexdigest()[:32] + ".part")


def _download(remote: Remote, f: RemoteFile, dest: Path, meta: Path, progress: Progress, retries: int,
              retry_delay_s: float) -> None:
    """Fetch `f` into `dest` through its partial file: resume it, retry transient failures, check the digest."""
    part = _partial_path(meta, f)
    restarts = 0
    attempt = 0
    resumed = False
    while True:
        have, h = _resume_point(part, f)
        if have:
            progress.done_bytes += have
            progress.resumed_files += 0 if resumed else 1
            resumed = True
            log.info("resuming", extra={"fields": {"file": f.name, "offset": have, "size": f.size}})
        try:
            trust, h = _receive(remote, f, part, have, h, progress)
        except _Transient as exc:
            _back_off(remote, f, part, progress, exc, attempt, retries, retry_delay_s)
            attempt += 1
            continue
        if trust and not _matches(h, f.digest):
            got = h.hexdigest()
            part.unlink()
            progress.done_bytes -= f.size
            if restarts == 0:  # corrupted in transit or on disk: one fresh download, then give up
                restarts += 1
                log.warning("digest mismatch, downloading again", extra={"fields": {"file": f.name, "want": f.digest, "got": got}})
                continue
            raise FetchError("Integrity", f"{remote_name(remote)}: {f.name}: content digest {got} does not match the "
                                          f"published {f.digest} (downloaded twice)")
        final = dest / f.name
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, final)
        return


def _resume_point(part: Path, f: RemoteFile) -> tuple[int, Any]:
    """Bytes of `f` already in its partial file (none if it is longer than `f`), and a hasher fed with them."""
    have = part.stat().st_size if part.exists() else 0
    if have > f.size or not part.exists():
        part.write_bytes(b"")  # also the whole of an empty file
        have = 0
    h = _hasher(f.digest, f.size)
    if have and h is not None:
        with part.open("rb") as fh:
            for block in iter(lambda: fh.read(CHUNK_BYTES), b""):
                h.update(block)
    return have, h


def _receive(remote: Remote, f: RemoteFile, part: Path, have: int, h: Any, progress: Progress) -> tuple[bool, Any]:
    """Append `f` from byte `have` to its partial file: (check its digest?, the hasher); _Transient if short."""
    trust = True
    if have < f.size:
        with remote.open(f, have) as body:
            trust = body.trust_digest
            if body.start != have:  # the server sent the whole file: start over
                progress.done_bytes -= have
                have, h = 0, _hasher(f.digest, f.size)
            with part.open("r+b") as out:
                out.seek(have)
                out.truncate()
                for chunk in body.chunks:
                    out.write(chunk)
                    if h is not None:
                        h.update(chunk)
                    progress.add(len(chunk))
                out.flush()
                os.fsync(out.fileno())
    size = part.stat().st_size if part.exists() else 0
    if size != f.size:
        raise _Transient(f"{f.name}: got {size} of {f.size} bytes")
    return trust, h


def _back_off(remote: Remote, f: RemoteFile, part: Path, progress: Progress, exc: _Transient, attempt: int,
              retries: int, retry_delay_s: float) -> None:
    """After failed attempt `attempt` (from 0): FetchError once `retries` are spent, else sleep (doubling, <= 30 s)."""
    progress.done_bytes -= part.stat().st_size if part.exists() else 0
    if exc.restart and part.exists():
        part.unlink()
    if attempt >= retries:
        raise FetchError("Unreachable", f"{remote_name(remote)}: {exc} (gave up after {attempt + 1} attempts; "
                                        "the partial file is kept and the next run resumes it)") from exc
    delay = min(30.0, retry_delay_s * 2 ** attempt)
    log.warning("retrying", extra={"fields": {"file": f.name, "error": str(exc), "attempt": attempt + 1, "delay_s": delay}})
    time.sleep(delay)


def remote_name(remote: Remote) -> str:
    return getattr(getattr(remote, "src", None), "raw", "source")


def _still_to_fetch(wanted: Sequence[Any], dest: Path, known: dict[str, dict[str, Any]], progress: Progress) -> list:
    """The wanted files not already in `dest` as verified; the verified ones are counted done in `progress`.

    A file is trusted without reading only if nothing touched it since it was verified (same inode, ctime: a
    write or a replacement changes them and no user can set them back); else it is verified by content again."""
    todo = []
    for f in wanted:
        entry = {"size": f.size, "digest": f.digest}
        path = dest / f.name
        if path.is_file() and (_unchanged(known.get(f.name), entry, path) or _hash_file(path, f.digest, f.size)):
            known[f.name] = {**entry, **_stamp(path)}
            progress.cached_files += 1
            progress.done_files += 1
            progress.done_bytes += f.size
        else:
            known.pop(f.name, None)
            todo.append(f)
    return todo


def fetch(remote: Remote, dest: Path, *, patterns: Sequence[str] = MODEL_PATTERNS, retries: int = DEFAULT_RETRIES,
          retry_delay_s: float = 1.0, config_file: str = CONFIG_FILE) -> Result:
    """Bring `dest` up to date with the remote's files matching `patterns`; raises FetchError.

    `config_file` must be among them (a model's config.json; a LoRA adapter's adapter_config.json)."""
    dest = Path(dest)
    meta = _prepare(dest)
    source = remote_name(remote)
    with _locked(meta / "lock", source), contextlib.closing(remote):
        state_path = meta / "state.json"
        try:
            state = json.loads(state_path.read_text()) if state_path.exists() else {}
        except (OSError, ValueError):
            state = {}
        if state.get("source") != source or state.get("patterns") != list(patterns):
            state = {"source": source, "patterns": list(patterns), "files": state.get("files", {})}
        known: dict[str, dict[str, Any]] = state.setdefault("files", {})
        try:
            listing = remote.listing()
        except FetchError as exc:
            offline = _offline_copy(dest, state, remote, exc, config_file)
            if offline is not None:
                return offline
            raise
        wanted = _filter(listing.files, patterns)
        if not any(f.name == config_file for f in wanted):
            kind = "model" if config_file == CONFIG_FILE else "PEFT adapter"
            raise FetchError("NotFound", f"{source}: no {config_file} at revision {listing.revision} "
                                         f"({len(listing.files)} files listed): not a Hugging Face-style {kind} directory")
        progress = Progress(files=len(wanted), total_bytes=sum(f.size for f in wanted))
        log.info("start", extra={"fields": {"source": source, "dest": str(dest), "revision": listing.revision,
                                            "files": progress.files, "bytes": progress.total_bytes}})
        todo = _still_to_fetch(wanted, dest, known, progress)
        need = sum(f.size - (_partial_path(meta, f).stat().st_size if _partial_path(meta, f).exists() else 0) for f in todo)
        free = shutil.disk_usage(dest).free
        if need > free:
            raise FetchError("NoSpace", f"{source}: {need} bytes still to download, {free} free in {dest}")
        for f in todo:
            t0 = time.monotonic()
            _download(remote, f, dest, meta, progress, retries, retry_delay_s)
            known[f.name] = {"size": f.size, "digest": f.digest, **_stamp(dest / f.name)}
            state.update(revision=listing.revision, complete=False)
            _write_json(state_path, state)
            progress.done_files += 1
            log.info("file", extra={"fields": {"file": f.name, "bytes": f.size, "seconds": round(time.monotonic() - t0, 3),
                                               "files_done": progress.done_files, "files": progress.files}})
        keep = {_partial_path(meta, f).name for f in todo}
        for stale in (meta / "partial").glob("*.part"):
            if stale.name not in keep:
                stale.unlink(missing_ok=True)
        summary = _summary(dest / config_file, source)
        _write_json(meta / "config-summary.json", summary.as_dict())
        state.update(revision=listing.revision, complete=True, anonymous=remote.anonymous,
                     files={f.name: known[f.name] for f in wanted})
        _write_json(state_path, state)
        log.info("done", extra={"fields": {**progress.fields(), "revision": listing.revision, **summary.as_dict()}})
        return Result(dest, listing.revision, [f.name for f in wanted], summary, progress)


def _stamp(path: Path) -> dict[str, int]:
    """What changes whenever a file's bytes do: its inode and ctime (nanoseconds), with its size."""
    st = path.stat()
    return {"ino": st.st_ino, "ctime_ns": st.st_ctime_ns}


def _unchanged(known: dict[str, Any] | None, entry: dict[str, Any], path: Path) -> bool:
    """Whether `path` is the very file verified as `entry` (digest and size) and untouched since."""
    if not known or {k: known.get(k) for k in entry} != entry or "ctime_ns" not in known:
        return False
    st = path.stat()
    return st.st_size == entry["size"] and {"ino": st.st_ino, "ctime_ns": st.st_ctime_ns} == {
        "ino": known.get("ino"), "ctime_ns": known.get("ctime_ns")}


def _offline_copy(dest: Path, state: dict[str, Any], remote: Remote, exc: FetchError,
                  config_file: str = CONFIG_FILE) -> Result | None:
    """A complete earlier copy when the source is unreachable; only for copies fetched without credentials,
    so a pod without access never reads a private model another service fetched onto the node."""
    if exc.reason != "Unreachable" or not state.get("complete") or not state.get("anonymous") or not remote.anonymous:
        return None
    files = state.get("files", {})
    if not files or any(not (dest / n).is_file() or not _unchanged(e, {"size": e["size"], "digest": e["digest"]}, dest / n)
                        for n, e in files.items()):
        return None
    log.warning("source unreachable, using the complete copy fetched earlier",
                extra={"fields": {"error": exc.message, "revision": state.get("revision")}})
    progress = Progress(files=len(files), total_bytes=sum(e["size"] for e in files.values()))
    progress.done_files, progress.done_bytes, progress.cached_files = len(files), progress.total_bytes, len(files)
    return Result(dest, str(state.get("revision", "")), sorted(files), _summary(dest / config_file, remote_name(remote)),
                  progress, offline=True)


def _summary(path: Path, source: str) -> ConfigSummary:
    try:
        return summarize_config(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        raise FetchError("BadConfig", f"{source}: {path.name} is not valid JSON: {exc}") from exc


# ---- config.json only (the operator, `warmfleet operator render`) ----

def read_config(src: ModelSource, *, hf_token: str | None = None, hub_endpoint: str | None = None,
                s3_creds: S3Credentials | None = None, s3_endpoint: str | None = None, s3_region: str | None = None,
                anonymous: bool = False, timeout_s: float = 10.0, follow_redirects: bool = True,
                max_bytes: int = CONFIG_MAX_BYTES) -> tuple[ConfigSummary, str]:
    """config.json of an hf:// or s3:// source, summarized, and the revision read (hub commit, S3 ETag).

    Blocking (run it in a thread); raises FetchError. `anonymous` skips ambient credentials
    (HF_TOKEN and ~/.cache/huggingface, boto3's default chain): the operator reads a source only
    with the credentials its spec names, follows no redirect (`follow_redirects` False: a tenant's endpoint
    cannot bounce it to an address it would refuse) and reads at most `max_bytes`.
    """
    what = f"{src.raw}: {CONFIG_FILE}"
    if src.kind == "hf":
        # One GET through huggingface_hub's own session, its errors mapped by hf_raise_for_status. Not
        # hf_hub_download: on a connection error it retries with backoff for ~25 s and wants a cache directory.
        from huggingface_hub import get_session, hf_hub_url, hf_raise_for_status
        from huggingface_hub.utils import build_hf_headers

        endpoint = (hub_endpoint or os.environ.get("HF_ENDPOINT") or HUB_ENDPOINT).rstrip("/")
        token: str | bool | None = hf_token or (False if anonymous else None)
        url = hf_hub_url(src.repo, CONFIG_FILE, revision=src.revision, endpoint=endpoint)
        try:
            resp = _bounded_get(get_session(), url, build_hf_headers(token=token), timeout_s, follow_redirects, max_bytes)
            if resp.is_redirect:
                raise FetchError("Unreachable", f"{what}: HTTP {resp.status_code}: the endpoint redirects, and the operator "
                                                "follows no redirect (name the final URL in hub.endpoint)")
            hf_raise_for_status(resp)
        except FetchError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _hub_error(exc, what) from exc
        raw, revision = resp.content, resp.headers.get("X-Repo-Commit") or src.revision
    elif src.kind == "s3":
        remote = S3Remote(src, creds=s3_creds, endpoint=s3_endpoint, region=s3_region, timeout_s=timeout_s,
                          anonymous=anonymous and s3_creds is None)
        key = remote.key_prefix + CONFIG_FILE
        try:
            resp = remote.client.get_object(Bucket=src.bucket, Key=key)
            raw, revision = resp["Body"].read(max_bytes + 1), str(resp.get("ETag", "")).strip('"')
        except Exception as exc:  # noqa: BLE001
            err = remote._error(exc, what)
            raise (err if isinstance(err, FetchError) else FetchError("Unreachable", str(err))) from exc
    else:
        raise ValueError(f"{src.raw}: the operator cannot read config.json of a {src.kind} source")
    if len(raw) > max_bytes:
        raise FetchError("BadConfig", f"{what}: larger than {max_bytes} bytes")
    try:
        return summarize_config(json.loads(raw)), revision
    except ValueError as exc:
        raise FetchError("BadConfig", f"{what}: not a JSON object ({exc})") from exc


def _bounded_get(session: Any, url: str, headers: dict[str, str], timeout_s: float, follow_redirects: bool,
                 max_bytes: int) -> Any:
    """GET `url` reading at most `max_bytes` of body (FetchError past it); a complete response of the session's own
    class otherwise (huggingface_hub's error mapping catches its own httpx's exceptions)."""
    with session.stream("GET", url, headers=headers, timeout=timeout_s, follow_redirects=follow_redirects) as resp:
        body = bytearray()
        for chunk in resp.iter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise FetchError("BadConfig", f"{url}: answer larger than {max_bytes} bytes")
        headers = [(k, v) for k, v in resp.headers.multi_items() if k.lower() not in ("content-encoding", "content-length")]
        return type(resp)(resp.status_code, headers=headers, content=bytes(body), request=resp.request)


# ---- the command ----

def add_arguments(p: argparse.ArgumentParser) -> None:
    """`warmfleet fetch-model` flags."""
    p.add_argument("source", nargs="?", help="hf://ORG/NAME[@REVISION] or s3://BUCKET[/PREFIX] (not with --adapters).")
    p.add_argument("--dest", help="Model directory to fill (created; resumed and verified if it exists); required with SOURCE.")
    p.add_argument("--adapters", metavar="FILE",
                   help="Instead of SOURCE: a JSON list of LoRA adapters [{name, source}] (the operator's adapters ConfigMap); "
                        "each hf:// or s3:// one is fetched into ADAPTERS_DIR/NAME. A failed adapter is logged, not fatal.")
    p.add_argument("--adapters-dir", metavar="DIR", help="With --adapters: the directory holding one directory per adapter.")
    p.add_argument("--watch-s", type=float, default=None, metavar="SECONDS",
                   help="With --adapters: never exit; read FILE again every SECONDS and fetch adapters not fetched yet.")
    p.add_argument("--gc-after-s", type=float, default=900.0, metavar="SECONDS",
                   help="With --watch-s: delete a fetched adapter's directory once FILE has not named it for SECONDS "
                        "(a removed adapter, or an old source's copy); 0 keeps every directory.")
    p.add_argument("--tokenizer-only", action="store_true",
                   help="Configs, tokenizer files and chat templates only, no weights (what the router reads).")
    p.add_argument("--allow", action="append", metavar="PATTERN",
                   help=f"Fetch only files matching this glob (repeatable; default: {' '.join(MODEL_PATTERNS)}).")
    p.add_argument("--hub-endpoint", default=None, help=f"Hub URL (default: $HF_ENDPOINT, else {HUB_ENDPOINT}). Token: $HF_TOKEN.")
    p.add_argument("--s3-endpoint", default=None, help="S3-compatible endpoint URL (default: AWS). Keys: $AWS_ACCESS_KEY_ID, $AWS_SECRET_ACCESS_KEY.")
    p.add_argument("--s3-region", default=None, help="S3 region (default: $AWS_REGION, else us-east-1).")
    p.add_argument("--retries", type=int, default=DEFAULT_RETRIES, help="Retries of a failed transfer per file (resuming).")
    p.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="Connect/read timeout per request, seconds.")
    p.add_argument("--termination-log", default=None, metavar="PATH",
                   help="Also write the error line here on failure (Kubernetes: /dev/termination-log).")


def remote_for(src: ModelSource, args: argparse.Namespace) -> Remote:
    """The remote of a source, credentials from the environment."""
    if src.kind == "hf":
        return HubRemote(src, token=os.environ.get("HF_TOKEN"), endpoint=args.hub_endpoint, timeout_s=args.timeout_s)
    if src.kind == "s3":
        creds = S3Credentials(os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY"),
                              os.environ.get("AWS_SESSION_TOKEN"))
        return S3Remote(src, creds=creds, endpoint=args.s3_endpoint, region=args.s3_region, timeout_s=args.timeout_s)
    raise ValueError(f"{src.raw}: fetch-model downloads hf:// and s3:// sources; a {src.kind} source is mounted, not fetched")


def run(args: argparse.Namespace) -> int:
    """Fetch, log progress as structured lines; on failure one readable line on stderr and exit 1."""
    from warmfleet.server.logging_setup import setup_logging

    setup_logging("info")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    if args.adapters:
        return run_adapters(args)
    if not args.source or not args.dest:
        print("warmfleet fetch-model: error: SOURCE and --dest are required (or --adapters FILE --adapters-dir DIR)",
              file=sys.stderr, flush=True)
        return 2
    try:
        src = parse_source(args.source)
        remote = remote_for(src, args)
        patterns = args.allow or (TOKENIZER_PATTERNS if args.tokenizer_only else MODEL_PATTERNS)
        fetch(remote, Path(args.dest), patterns=patterns, retries=args.retries)
    except (FetchError, OSError) as exc:  # OSError: the disk filled up or went away mid-write
        line = (f"warmfleet fetch-model: error: {exc.reason}: {exc.message}" if isinstance(exc, FetchError)
                else f"warmfleet fetch-model: error: IOError: {exc}")
        print(line, file=sys.stderr, flush=True)
        if args.termination_log:
            with contextlib.suppress(OSError):
                Path(args.termination_log).write_text(line + "\n")
        return 1
    return 0


# ---- LoRA adapters (the operator's adapters ConfigMap: init step and sidecar) ----

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_PATTERNS = ("adapter_config.json", "adapter_model.safetensors", "*.jinja", "tokenizer*")


def read_adapters(path: Path) -> list[tuple[str, str]]:
    """(directory, source) of each hf:// or s3:// adapter in an adapters file ({name, source, dir}; dir defaults to
    name); other sources are mounted, not fetched."""
    entries = json.loads(Path(path).read_text() or "[]")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path}: not a JSON list of objects")
    out = []
    for e in entries:
        name, source = str(e.get("dir") or e.get("name") or ""), str(e.get("source") or "")
        if name and "/" not in name and name not in (".", "..") and source.startswith(("hf://", "s3://")):
            out.append((name, source))
    return out


def fetch_adapters(args: argparse.Namespace, done: dict[str, str],
                   fetch_one: Any = None) -> dict[str, str]:
    """Fetch every adapter of the file not in `done` (name → source fetched); failures are logged and left for the
    next pass. Returns the failures (name → error line)."""
    root = Path(args.adapters_dir)
    root.mkdir(parents=True, exist_ok=True)
    failed: dict[str, str] = {}
    try:
        wanted = read_adapters(Path(args.adapters))
    except (OSError, ValueError) as exc:
        log.error("adapters file unreadable", extra={"fields": {"file": args.adapters, "error": str(exc)}})
        return {"": str(exc)}
    for name, source in wanted:
        if done.get(name) == source:
            continue
        try:
            if fetch_one is not None:
                fetch_one(name, source, root / name)
            else:
                fetch(remote_for(parse_source(source), args), root / name, patterns=ADAPTER_PATTERNS,
                      retries=args.retries, config_file=ADAPTER_CONFIG_FILE)
            done[name] = source
        except Exception as exc:  # noqa: BLE001 (one adapter's failure, whatever it is, must not stop the others)
            line = f"{exc.reason}: {exc.message}" if isinstance(exc, FetchError) else f"{type(exc).__name__}: {exc}"
            log.error("adapter not fetched", extra={"fields": {"adapter": name, "source": source, "error": line}})
            failed[name] = line
    return failed


def sweep_adapters(root: Path, wanted: set[str], unlisted: dict[str, float], now: float, after_s: float) -> list[str]:
    """Delete the fetched adapter directories under `root` that the list has not named for `after_s` seconds
    (`unlisted`: directory -> when this process first saw it unlisted), so a removed adapter or an old source's
    directory does not stay on the node for ever. Only directories `fetch` made (they hold .warmfleet/) and whose
    lock no fetch holds. The grace outlasts the kubelet's ConfigMap refresh, so a pod whose list is a minute
    older than another's never deletes what the other has just fetched. Returns the directories removed."""
    removed = []
    present = {d.name for d in root.iterdir() if d.is_dir() and (d / META_DIR).is_dir()} - wanted
    for name in list(unlisted):
        if name not in present:
            del unlisted[name]
    for name in sorted(present):
        since = unlisted.setdefault(name, now)
        if now - since < after_s:
            continue
        lock = root / name / META_DIR / "lock"
        with lock.open("a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being fetched right now: the list names it again somewhere
            trash = root / f".removed-{name}-{os.getpid()}"
            os.replace(root / name, trash)
        shutil.rmtree(trash, ignore_errors=True)
        del unlisted[name]
        removed.append(name)
        log.info("adapter files removed", extra={"fields": {"dir": name, "unlisted_s": round(now - since)}})
    return removed


def run_adapters(args: argparse.Namespace) -> int:
    """--adapters: one pass (the init step: exits 0 even if an adapter failed, so one bad adapter never keeps a replica
    from starting; the operator reports adapters it cannot load), or with --watch-s a pass every SECONDS (the sidecar),
    which also deletes directories unlisted for --gc-after-s."""
    if not args.adapters_dir:
        print("warmfleet fetch-model: error: --adapters needs --adapters-dir", file=sys.stderr, flush=True)
        return 2
    done: dict[str, str] = {}
    unlisted: dict[str, float] = {}
    while True:
        fetch_adapters(args, done)
        if args.watch_s is None:
            return 0
        if args.gc_after_s > 0:
            try:  # an unreadable list says nothing is unlisted
                wanted = {name for name, _ in read_adapters(Path(args.adapters))}
                sweep_adapters(Path(args.adapters_dir), wanted, unlisted, time.monotonic(), args.gc_after_s)
            except (OSError, ValueError) as exc:
                log.error("adapter files not swept", extra={"fields": {"dir": args.adapters_dir, "error": str(exc)}})
        time.sleep(args.watch_s)
