"""`warmfleet fetch-model` against local servers only: a fake Hugging Face Hub (tests/fakehub.py) and moto's S3 server.

Download, resume after a partial file, cache hits that transfer nothing, verification, readable
errors (bad credentials, missing repo or file), progress lines, config.json summaries; plus the
source grammar shared with the CRD.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fakehub import FakeHub
from warmfleet import fetch as f
from warmfleet.source import (DOTDOT_PATTERN, MODEL_PATTERNS, SOURCE_PATTERN, TOKENIZER_PATTERNS, ConfigSummary,
                              check_source, parse_source, summarize_config)

CONFIG = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "hidden_size": 1536,
          "torch_dtype": "bfloat16", "vision_config": {"embed_dim": 1280, "hidden_size": 1536}}
WEIGHTS = hashlib.sha256(b"weights").digest() * 40_000  # 1.28 MB: several chunks


def files(**extra: bytes) -> dict[str, bytes]:
    return {"config.json": json.dumps(CONFIG).encode(), "model.safetensors": WEIGHTS, "tokenizer.json": b'{"v": 1}',
            "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}', "chat_template.jinja": b"{{ messages }}",
            "pytorch_model.bin": b"pickle" * 100, "README.md": b"# tiny", **extra}


@pytest.fixture()
def hub():
    with FakeHub() as h:
        h.add("acme/tiny-vl", files())
        h.add("acme/private", files(), token="hf_good")
        yield h


def remote(hub: FakeHub, source: str = "hf://acme/tiny-vl", token: str | None = None) -> f.HubRemote:
    return f.HubRemote(parse_source(source), token=token, endpoint=hub.url, timeout_s=5)


def run_fetch(hub: FakeHub, dest: Path, source: str = "hf://acme/tiny-vl", token: str | None = None, **kw) -> f.Result:
    return f.fetch(remote(hub, source, token), dest, retry_delay_s=0.01, **kw)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "WARMFLEET_LOG_FORMAT": "json", **(env or {})}
    full_env.pop("HF_TOKEN", None) if "HF_TOKEN" not in (env or {}) else None
    return subprocess.run([sys.executable, "-P", "-m", "warmfleet.cli", "fetch-model", *args], capture_output=True,
                          text=True, timeout=120, env=full_env)


# ---- the hub ----

def test_download_fetches_model_files_only_verified_with_a_summary(hub, tmp_path):
    dest = tmp_path / "hf/acme/tiny-vl/main"
    r = run_fetch(hub, dest)
    repo = hub.repos["acme/tiny-vl"]
    assert sorted(r.files) == ["chat_template.jinja", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    for name in r.files:
        assert (dest / name).read_bytes() == repo.files[name]
    assert not (dest / "pytorch_model.bin").exists() and not (dest / "README.md").exists()  # not in MODEL_PATTERNS
    assert r.revision == repo.commit and hub.gets() and all(f"/resolve/{repo.commit}/" in q.path for q in hub.gets())
    summary = json.loads((dest / ".warmfleet/config-summary.json").read_text())
    assert summary == {"architecture": "Qwen2VLForConditionalGeneration", "modelType": "qwen2_vl", "hiddenSize": 1536,
                       "dtype": "bfloat16", "vision": True, "visionHiddenSize": 1280}
    state = json.loads((dest / ".warmfleet/state.json").read_text())
    assert state["complete"] and state["revision"] == repo.commit and state["anonymous"]
    assert state["files"]["model.safetensors"]["digest"] == "sha256:" + hashlib.sha256(WEIGHTS).hexdigest()
    assert state["files"]["config.json"]["digest"].startswith("gitsha1:")
    assert list((dest / ".warmfleet/partial").iterdir()) == []
    assert r.progress.transferred_bytes == r.progress.total_bytes == sum(len(repo.files[n]) for n in r.files)


def test_a_complete_directory_is_a_cache_hit_one_listing_no_transfer(hub, tmp_path):
    dest = tmp_path / "m"
    run_fetch(hub, dest)
    hub.reset_counts()
    r = run_fetch(hub, dest)
    assert [q.path for q in hub.requests] == ["/api/models/acme/tiny-vl/revision/main"]
    assert hub.gets() == [] and hub.served_bytes == {}
    assert r.progress.cached_files == r.progress.files == 5 and r.progress.transferred_bytes == 0


def test_an_interrupted_download_resumes_from_its_partial_file_in_the_next_run(hub, tmp_path):
    dest = tmp_path / "m"
    hub.cut_after[("acme/tiny-vl", "model.safetensors")] = 300_000
    with pytest.raises(f.FetchError) as err:
        run_fetch(hub, dest, retries=0)  # the connection drops mid-file; no retry in this run
    assert err.value.reason == "Unreachable" and "the next run resumes it" in err.value.message
    (part,) = (dest / ".warmfleet/partial").iterdir()
    assert part.stat().st_size == 300_000 and not (dest / "model.safetensors").exists()

    hub.reset_counts()
    r = run_fetch(hub, dest)
    (get,) = hub.gets("model.safetensors")
    assert get.range == "bytes=300000-"
    assert hub.served_bytes["model.safetensors"] == len(WEIGHTS) - 300_000
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS and r.progress.resumed_files == 1
    assert not part.exists()


def test_a_dropped_connection_is_retried_in_process_with_a_range_request(hub, tmp_path):
    hub.cut_after[("acme/tiny-vl", "model.safetensors")] = 500_000
    r = run_fetch(hub, tmp_path / "m", retries=2)
    ranges = [q.range for q in hub.gets("model.safetensors")]
    assert ranges == [None, "bytes=500000-"]
    assert (tmp_path / "m/model.safetensors").read_bytes() == WEIGHTS and r.progress.transferred_bytes == r.progress.total_bytes


def test_content_that_does_not_match_the_published_sha256_is_refused(hub, tmp_path):
    hub.tamper[("acme/tiny-vl", "model.safetensors")] = b"x" * len(WEIGHTS)  # right size, wrong bytes
    with pytest.raises(f.FetchError) as err:
        run_fetch(hub, tmp_path / "m")
    assert err.value.reason == "Integrity" and "model.safetensors" in err.value.message
    assert len(hub.gets("model.safetensors")) == 2  # one fresh download, then it gives up
    assert not (tmp_path / "m/model.safetensors").exists()


def test_a_corrupt_partial_file_is_caught_and_downloaded_again(hub, tmp_path):
    dest = tmp_path / "m"
    hub.cut_after[("acme/tiny-vl", "model.safetensors")] = 200_000
    with pytest.raises(f.FetchError):
        run_fetch(hub, dest, retries=0)
    (part,) = (dest / ".warmfleet/partial").iterdir()
    part.write_bytes(b"\0" * 200_000)  # bit rot in the partial file
    r = run_fetch(hub, dest)
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS
    assert [q.range for q in hub.gets("model.safetensors")][-2:] == ["bytes=200000-", None]
    assert r.progress.files == 5


def test_an_upstream_change_fetches_only_the_changed_files(hub, tmp_path):
    dest = tmp_path / "m"
    run_fetch(hub, dest)
    hub.repos["acme/tiny-vl"].files["tokenizer.json"] = b'{"v": 2}'  # a new commit on main
    hub.reset_counts()
    r = run_fetch(hub, dest)
    assert [q.path.rsplit("/", 1)[1] for q in hub.gets()] == ["tokenizer.json"]
    assert (dest / "tokenizer.json").read_bytes() == b'{"v": 2}' and r.revision == hub.repos["acme/tiny-vl"].commit


def test_a_file_already_in_place_without_state_is_verified_not_downloaded(hub, tmp_path):
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "model.safetensors").write_bytes(WEIGHTS)  # e.g. copied by hand
    run_fetch(hub, dest)
    assert hub.gets("model.safetensors") == []


def test_an_empty_file_is_fetched_too(hub, tmp_path):
    hub.add("acme/with-empty", files(**{"added_tokens.json": b""}))
    r = run_fetch(hub, tmp_path / "m", source="hf://acme/with-empty")
    assert "added_tokens.json" in r.files and (tmp_path / "m/added_tokens.json").read_bytes() == b""


def test_tokenizer_only_skips_weights(hub, tmp_path):
    r = run_fetch(hub, tmp_path / "m", patterns=TOKENIZER_PATTERNS)
    assert "model.safetensors" not in r.files and "tokenizer.json" in r.files and "chat_template.jinja" in r.files


def test_private_repo_needs_the_token(hub, tmp_path):
    run_fetch(hub, tmp_path / "ok", source="hf://acme/private", token="hf_good")
    assert all(q.authorization == "Bearer hf_good" for q in hub.requests if "private" in q.path)
    with pytest.raises(f.FetchError) as err:
        run_fetch(hub, tmp_path / "anon", source="hf://acme/private")
    assert err.value.reason == "NotFound" and "private and HF_TOKEN is missing" in err.value.message
    with pytest.raises(f.FetchError) as err:
        run_fetch(hub, tmp_path / "bad", source="hf://acme/private", token="hf_bad")
    assert err.value.reason == "Unauthorized" and "Invalid credentials in Authorization header" in err.value.message


@pytest.mark.parametrize("source,setup,reason,needle", [
    ("hf://acme/nope", None, "NotFound", "repository not found"),
    ("hf://acme/tiny-vl@v9", None, "NotFound", "revision not found"),
    ("hf://acme/tiny-vl", ("missing", "model.safetensors"), "NotFound", "model.safetensors not found at commit"),
    ("hf://acme/no-config", None, "NotFound", "no config.json at revision"),
])
def test_missing_repo_revision_or_file_is_a_readable_error(hub, tmp_path, source, setup, reason, needle):
    hub.add("acme/no-config", {"model.safetensors": WEIGHTS})
    if setup:
        hub.missing.add(("acme/tiny-vl", setup[1]))
    with pytest.raises(f.FetchError) as err:
        run_fetch(hub, tmp_path / "m", source=source)
    assert err.value.reason == reason and needle in err.value.message, err.value.message


def test_unreachable_hub_uses_a_complete_public_copy_but_never_a_private_one(hub, tmp_path):
    run_fetch(hub, tmp_path / "pub")
    run_fetch(hub, tmp_path / "priv", source="hf://acme/private", token="hf_good")
    down = "http://127.0.0.1:9"  # nothing listens on the discard port
    r = f.fetch(f.HubRemote(parse_source("hf://acme/tiny-vl"), token=None, endpoint=down, timeout_s=2), tmp_path / "pub")
    assert r.offline and r.summary.hidden_size == 1536
    with pytest.raises(f.FetchError) as err:
        f.fetch(f.HubRemote(parse_source("hf://acme/private"), token="hf_good", endpoint=down, timeout_s=2), tmp_path / "priv")
    assert err.value.reason == "Unreachable"


def test_an_unwritable_cache_says_how_to_prepare_it(hub, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(f.FetchError) as err:
        run_fetch(hub, tmp_path / "file" / "m")
    assert err.value.reason == "NotWritable" and "install -d -o" in err.value.message and "docs/models.md" in err.value.message


def test_cli_logs_structured_progress_and_fails_with_one_readable_line(hub, tmp_path):
    ok = cli("hf://acme/tiny-vl", "--dest", str(tmp_path / "m"), env={"HF_ENDPOINT": hub.url})
    assert ok.returncode == 0, ok.stderr
    lines = [json.loads(ln) for ln in ok.stderr.splitlines() if ln.startswith("{")]
    by_msg = {ln["msg"]: ln for ln in lines}
    assert by_msg["start"]["files"] == 5 and by_msg["start"]["bytes"] > len(WEIGHTS)
    assert {ln["file"] for ln in lines if ln["msg"] == "file"} == {"config.json", "model.safetensors", "tokenizer.json",
                                                                   "tokenizer_config.json", "chat_template.jinja"}
    done = by_msg["done"]
    assert done["files_done"] == 5 and done["transferred_bytes"] == done["bytes"] and done["seconds"] >= 0
    assert done["hiddenSize"] == 1536

    term = tmp_path / "termination-log"
    bad = cli("hf://acme/private", "--dest", str(tmp_path / "p"), "--termination-log", str(term),
              env={"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_wrong"})
    assert bad.returncode == 1
    last = bad.stderr.strip().splitlines()[-1]
    assert last == ("warmfleet fetch-model: error: Unauthorized: hf://acme/private: the hub refused the credentials "
                    "(HTTP 401: Invalid credentials in Authorization header); check HF_TOKEN"), bad.stderr
    assert term.read_text().strip() == last
    assert "Traceback" not in bad.stderr


def test_cli_refuses_a_bad_source_with_exit_2():
    r = cli("hf://just-a-name", "--dest", "/tmp/x")
    assert r.returncode == 2 and "model source must be hf://ORG/NAME[@REVISION]" in r.stderr.strip().splitlines()[-1]


def test_read_config_for_the_operator(hub):
    summary, revision = f.read_config(parse_source("hf://acme/private"), hf_token="hf_good", hub_endpoint=hub.url, anonymous=True)
    assert (summary.hidden_size, summary.dtype, summary.architecture, summary.vision) == (1536, "bfloat16", "Qwen2VLForConditionalGeneration", True)
    assert revision == hub.repos["acme/private"].commit
    assert [(q.method, q.path.rsplit("/", 1)[1]) for q in hub.requests] == [("GET", "config.json")]  # one request
    with pytest.raises(f.FetchError) as err:
        f.read_config(parse_source("hf://acme/private"), hf_token="hf_bad", hub_endpoint=hub.url, anonymous=True)
    assert err.value.reason == "Unauthorized"


def test_the_fake_hub_speaks_the_protocol_huggingface_hub_expects(hub, tmp_path):
    """Fidelity check of the fake: huggingface_hub's own snapshot_download (tree API, HEAD metadata) works against it."""
    from huggingface_hub import snapshot_download

    snapshot_download("acme/tiny-vl", local_dir=tmp_path / "snap", endpoint=hub.url, token=False,
                      allow_patterns=list(MODEL_PATTERNS))
    assert (tmp_path / "snap/model.safetensors").read_bytes() == WEIGHTS
    heads = [q for q in hub.requests if q.method == "HEAD"]
    assert heads and any(q.path.endswith("/model.safetensors") for q in heads)


# ---- S3 (moto's server on loopback, IAM authentication enforced) ----

@pytest.fixture(scope="module")
def s3():
    import logging

    import boto3
    import httpx
    from botocore.config import Config
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"

    def client(service: str, key: str = "setup", secret: str = "setup"):
        return boto3.client(service, endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=key,
                            aws_secret_access_key=secret, config=Config(s3={"addressing_style": "path"}))

    iam = client("iam")
    iam.create_user(UserName="reader")
    iam.put_user_policy(UserName="reader", PolicyName="s3", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    store = client("s3")
    store.create_bucket(Bucket="models")
    for name, data in files().items():
        store.put_object(Bucket="models", Key=f"qwen/tiny-vl/{name}", Body=data)
    store.put_object(Bucket="models", Key="qwen/tiny-vl-2/config.json", Body=b"{}")  # a sibling prefix, not ours
    assert httpx.post(f"{endpoint}/moto-api/reset-auth", content=b"0").status_code == 200  # from now on keys are checked
    try:
        yield {"endpoint": endpoint, "creds": f.S3Credentials(key["AccessKeyId"], key["SecretAccessKey"])}
    finally:
        httpx.post(f"{endpoint}/moto-api/reset-auth", content=b"inf")
        server.stop()


def s3_remote(s3, source: str = "s3://models/qwen/tiny-vl", creds=None) -> f.S3Remote:
    return f.S3Remote(parse_source(source), creds=creds or s3["creds"], endpoint=s3["endpoint"], region="us-east-1", timeout_s=5)


def test_s3_download_verifies_md5_etags_and_a_second_run_transfers_nothing(s3, tmp_path):
    dest = tmp_path / "s3/models/qwen/tiny-vl"
    r = f.fetch(s3_remote(s3), dest, retry_delay_s=0.01)
    assert sorted(r.files) == ["chat_template.jinja", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS and r.summary.hidden_size == 1536
    state = json.loads((dest / ".warmfleet/state.json").read_text())
    assert state["files"]["model.safetensors"]["digest"] == "md5:" + hashlib.md5(WEIGHTS).hexdigest()
    r2 = f.fetch(s3_remote(s3), dest)
    assert r2.progress.transferred_bytes == 0 and r2.progress.cached_files == 5


def test_s3_resumes_a_partial_file_with_a_range_request(s3, tmp_path):
    dest = tmp_path / "m"
    remote = s3_remote(s3)
    listing = remote.listing()
    weights = next(x for x in listing.files if x.name == "model.safetensors")
    meta = f._prepare(dest)
    f._partial_path(meta, weights).write_bytes(WEIGHTS[:400_000])  # left by a killed init container
    ranges: list[str] = []
    remote.client.meta.events.register("before-call.s3.GetObject", lambda params, **_: ranges.append(params.get("headers", {}).get("Range", "")))
    r = f.fetch(remote, dest)
    assert "bytes=400000-" in ranges
    assert (dest / "model.safetensors").read_bytes() == WEIGHTS
    assert r.progress.resumed_files == 1 and r.progress.transferred_bytes == r.progress.total_bytes - 400_000


@pytest.mark.parametrize("source,creds,reason,needle", [
    ("s3://models/qwen/tiny-vl", f.S3Credentials("AKIAWRONG", "wrong"), "Unauthorized", "InvalidAccessKeyId"),
    ("s3://nobucket/x", None, "NotFound", "NoSuchBucket"),
    ("s3://models/qwen/none", None, "NotFound", "no config.json"),
])
def test_s3_errors_are_readable(s3, tmp_path, source, creds, reason, needle):
    with pytest.raises(f.FetchError) as err:
        f.fetch(s3_remote(s3, source, creds), tmp_path / "m")
    assert err.value.reason == reason and needle in err.value.message, err.value.message


def test_s3_read_config_and_wrong_secret(s3):
    summary, etag = f.read_config(parse_source("s3://models/qwen/tiny-vl"), s3_creds=s3["creds"], s3_endpoint=s3["endpoint"])
    assert summary.hidden_size == 1536 and re.fullmatch("[0-9a-f]{32}", etag)
    with pytest.raises(f.FetchError) as err:
        f.read_config(parse_source("s3://models/qwen/tiny-vl"), s3_creds=f.S3Credentials(s3["creds"].access_key_id, "wrong"),
                      s3_endpoint=s3["endpoint"])
    assert err.value.reason == "Unauthorized" and "SignatureDoesNotMatch" in err.value.message


# ---- the source grammar and config.json summaries (pure) ----

@pytest.mark.parametrize("value,ok", [
    ("hf://Qwen/Qwen2-VL-7B-Instruct", True), ("hf://Qwen/Qwen2-VL-7B-Instruct@a1b2c3d", True), ("hf://a/b@refs/pr/1", True),
    ("s3://models", True), ("s3://models/qwen/7b/", True), ("pvc://model-store/Qwen2-VL", True), ("pvc://store", True),
    ("/models/qwen", True), ("hf://just-a-name", False), ("s3://UPPER/x", False), ("pvc://Bad_Claim/x", False),
    ("models/relative", False), ("/models/../etc", False), ("hf://a/b@x/../y", False), ("/with space", False), ("", False),
])
def test_source_grammar(value, ok):
    assert (check_source(value) is None) == ok
    # the CEL rule uses these patterns verbatim: keep them RE2-safe (no backslashes, no look-arounds)
    assert "\\" not in SOURCE_PATTERN + DOTDOT_PATTERN and "(?" not in SOURCE_PATTERN + DOTDOT_PATTERN


def test_cache_layout():
    assert parse_source("hf://Qwen/Qwen2-VL-7B-Instruct").cache_subdir() == "hf/Qwen/Qwen2-VL-7B-Instruct/main"
    assert parse_source("hf://a/b@refs/pr/1").cache_subdir() == "hf/a/b/refs--pr--1"
    assert parse_source("s3://models/qwen/7b/").cache_subdir() == "s3/models/qwen/7b"
    assert parse_source("s3://models").cache_subdir() == "s3/models"


@pytest.mark.parametrize("cfg,want", [
    (CONFIG, (1536, "bfloat16", True, "Qwen2VLForConditionalGeneration")),
    ({"architectures": ["LlavaForConditionalGeneration"], "text_config": {"hidden_size": 4096, "torch_dtype": "float16"},
      "vision_config": {"hidden_size": 1024}}, (4096, "float16", True, "LlavaForConditionalGeneration")),
    ({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "dtype": "bfloat16"}, (896, "bfloat16", False, "Qwen2ForCausalLM")),
    ({"n_embd": 768, "torch_dtype": "float32"}, (768, "float32", False, "")),
    ({"hidden_size": 64, "torch_dtype": "auto"}, (64, None, False, "")),
    ({"hidden_size": 64, "torch_dtype": "float8_e4m3fn"}, (64, "float8_e4m3fn", False, "")),
])
def test_summarize_config(cfg, want):
    s = summarize_config(cfg)
    assert (s.hidden_size, s.dtype, s.vision, s.architecture) == want
    assert ConfigSummary.from_dict(s.as_dict()) == s
