"""The object-store contract, on a local folder and on the real S3 API (moto's server on 127.0.0.1)."""

import base64
import hashlib
import multiprocessing
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import boto3
import fsspec.asyn
import pytest
import s3fs
import torch
from botocore.exceptions import ResponseStreamingError

import islands.storage.encoded as encoded_module
import islands.storage.s3 as s3_module
import islands.storage.store as store_module
from islands.storage import layout
from islands.storage.encoded import EncodedObject
from islands.storage.rounds import newest_round_from
from islands.storage.spool import spool
from islands.storage.store import (
    IntegrityError,
    ObjectMissing,
    ObjectStore,
    StoreError,
    Stores,
    bucket_url,
    sha256_hex,
)


@pytest.fixture(params=["file", "s3"])
def store_url(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path / 'bucket'}"
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}"


@pytest.fixture
def store(store_url):
    return ObjectStore(store_url)


# -- writes -------------------------------------------------------------------------------------


def test_put_if_absent_writes_once_and_keeps_the_first_bytes(store):
    assert store.put_if_absent("runs/r/config.json", b"first") is True
    assert store.put_if_absent("runs/r/config.json", b"second, longer") is False
    assert store.get("runs/r/config.json") == b"first"
    assert store.size("runs/r/config.json") == 5


@pytest.mark.parametrize("single_put_max", [None, 1000], ids=["one PUT", "in parts"])
def test_a_stream_is_put_once_and_the_first_bytes_stay(store, tmp_path, monkeypatch, single_put_max):
    """An object made of a header, a part file and memory goes up as it is read, never assembled."""
    if single_put_max:  # three parts of S3's smallest part size
        monkeypatch.setattr(s3_module, "SINGLE_PUT_MAX", single_put_max)
        monkeypatch.setattr(s3_module, "PART_BYTES", 5 * 2**20)
    part = tmp_path / "part"
    part.write_bytes(bytes(range(256)) * (11 * 2**12))  # 11 MiB
    body = torch.arange(2**18, dtype=torch.float32).numpy()  # 1 MiB of a tensor's memory
    whole = b"head" + part.read_bytes() + body.tobytes()
    first = EncodedObject((b"head", part, body), sha256_hex(whole))
    second = EncodedObject((b"other" * 2**20,), sha256_hex(b"other" * 2**20))
    assert store.put_if_absent("obj", first) is True
    assert store.put_if_absent("obj", second) is False
    assert store.get("obj") == whole and store.size("obj") == first.size == len(whole)
    assert store.put_or_verify("obj", first) is False
    with pytest.raises(IntegrityError, match="different content"):
        store.put_or_verify("obj", second)


def test_a_streamed_put_names_its_sha256_and_is_read_for_no_other_checksum(s3_bucket, monkeypatch):
    """The PUT carries the object's sha256 for S3 to check, so botocore adds no checksum of its
    own, which would read the whole stream once more before sending it: read twice in all over
    plain HTTP (botocore hashes the body to sign it, then sends it), three times without."""
    store = ObjectStore(f"s3://{s3_bucket}")
    data = bytes(range(256)) * 2**14  # 4 MiB
    read, sent = [], []
    readinto = encoded_module._Reader.readinto

    def counted(self, buffer):
        n = readinto(self, buffer)
        read.append(n)
        return n

    monkeypatch.setattr(encoded_module._Reader, "readinto", counted)
    fsspec.asyn.sync(store.fs.loop, store.fs.set_session)
    client = fsspec.asyn.sync(store.fs.loop, store.fs.get_s3, s3_bucket)
    client.meta.events.register(
        "before-send.s3.PutObject",
        lambda request, **_: sent.append(
            {k: v.decode() if isinstance(v, bytes) else v for k, v in request.headers.items()}
        ),
    )
    assert store.put_if_absent("streamed", EncodedObject((data,), sha256_hex(data))) is True
    assert sum(read) == 2 * len(data)
    assert [h.get("x-amz-checksum-sha256") for h in sent] == [base64.b64encode(hashlib.sha256(data).digest()).decode()]
    assert not any(k.startswith("x-amz-checksum-") and k != "x-amz-checksum-sha256" for k in sent[0]), sent[0]
    assert store.get("streamed", sha256=sha256_hex(data)) == data


def test_put_or_verify_is_idempotent_for_the_same_bytes(store):
    assert store.put_or_verify("a/b.bin", b"payload") is True
    assert store.put_or_verify("a/b.bin", b"payload") is False
    assert store.get("a/b.bin") == b"payload"


def test_put_or_verify_refuses_different_bytes(store):
    store.put_or_verify("a/b.bin", b"payload")
    with pytest.raises(IntegrityError, match="different content"):
        store.put_or_verify("a/b.bin", b"other")
    assert store.get("a/b.bin") == b"payload"


def test_delete_removes_an_object(store):
    store.put_if_absent("gc/old.bin", b"x")
    store.delete("gc/old.bin")
    assert store.size("gc/old.bin") is None
    assert store.put_if_absent("gc/old.bin", b"y") is True


# -- reads --------------------------------------------------------------------------------------


def test_get_checks_sha256(store):
    data = b"the bytes that were named"
    store.put_if_absent("obj", data)
    assert store.get("obj", sha256=sha256_hex(data)) == data
    with pytest.raises(IntegrityError, match="sha256"):
        store.get("obj", sha256=sha256_hex(b"something else"))


def test_get_refuses_objects_over_max_bytes(store):
    store.put_if_absent("big", b"x" * 100)
    assert store.get("big", max_bytes=100) == b"x" * 100
    with pytest.raises(IntegrityError, match="100 bytes, over the 99 limit"):
        store.get("big", max_bytes=99)


def test_get_chunks_streams_an_object_in_full_chunks(store, monkeypatch):
    monkeypatch.setattr(store_module, "READ_BYTES", 1000)
    data = bytes(range(256)) * 14  # 3,584 bytes
    store.put_if_absent("obj", data)
    chunks = list(store.get_chunks("obj"))
    assert [len(c) for c in chunks] == [1000, 1000, 1000, 584] and b"".join(chunks) == data
    with pytest.raises(ObjectMissing, match="does not exist"):
        list(store.get_chunks("nope"))


def _break_once(monkeypatch, after_calls: int, before_break=lambda: None):
    """Make the S3 download break (as a reset connection does) on read number `after_calls` + 1."""
    real, calls = s3_module._read_up_to, [0]

    async def flaky(body, n):
        calls[0] += 1
        if calls[0] == after_calls + 1:
            before_break()
            raise ResponseStreamingError(error="connection reset by peer")
        return await real(body, n)

    monkeypatch.setattr(store_module, "READ_BYTES", 1000)
    monkeypatch.setattr(s3_module, "_read_up_to", flaky)


def test_a_broken_s3_download_goes_on_where_it_stopped(s3_bucket, monkeypatch):
    store = ObjectStore(f"s3://{s3_bucket}")
    data = bytes(range(256)) * 14
    store.put_if_absent("obj", data)
    _break_once(monkeypatch, after_calls=2)
    gets = store.io.gets
    assert b"".join(store.get_chunks("obj")) == data
    assert store.io.gets == gets + 1  # one object read, whatever it took


def test_a_download_that_breaks_does_not_go_on_into_other_bytes(s3_bucket, s3_endpoint, monkeypatch):
    store = ObjectStore(f"s3://{s3_bucket}")
    store.put_if_absent("obj", b"a" * 3000)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")

    def replace_object():  # another writer, while the download is broken
        s3.put_object(Bucket=s3_bucket, Key="obj", Body=b"b" * 3000)

    _break_once(monkeypatch, after_calls=1, before_break=replace_object)
    with pytest.raises(IntegrityError, match="changed while being read"):
        b"".join(store.get_chunks("obj"))


def test_get_range(store):
    store.put_if_absent("r", bytes(range(20)))
    assert store.get_range("r", 0, 8) == bytes(range(8))
    assert store.get_range("r", 5, 9) == bytes([5, 6, 7, 8])
    assert store.get_range("r", 18, 20) == bytes([18, 19])


def test_missing_objects(store):
    assert store.size("nope") is None
    assert store.exists("nope") is False
    with pytest.raises(ObjectMissing, match="does not exist"):
        store.get("nope")
    with pytest.raises(ObjectMissing):
        store.get("nope", max_bytes=10)
    with pytest.raises(ObjectMissing):
        store.get_range("nope", 0, 8)
    assert store.list("runs/nothing/") == {}


def test_size_and_exists(store):
    store.put_if_absent("d/e/f", b"12345")
    assert store.size("d/e/f") == 5
    assert store.exists("d/e/f") is True


def test_list_returns_keys_relative_to_the_bucket_with_sizes(store):
    objects = {
        "runs/a/config.json": b"{}",
        "runs/a/rounds/000000/manifest.json": b"m" * 7,
        "runs/a/rounds/000001/manifest.json": b"m" * 9,
        "runs/a/deltas/us-east-0/000003.safetensors": b"d" * 11,
        "runs/ab/config.json": b"sibling",
        "top.txt": b"t",
    }
    for key, data in objects.items():
        assert store.put_if_absent(key, data)
    assert store.list("runs/a/rounds/") == {
        "runs/a/rounds/000000/manifest.json": 7,
        "runs/a/rounds/000001/manifest.json": 9,
    }
    assert store.list("runs/a/") == {k: len(v) for k, v in objects.items() if k.startswith("runs/a/")}
    assert store.list("runs/") == {k: len(v) for k, v in objects.items() if k.startswith("runs/")}
    assert "runs/ab/config.json" not in store.list("runs/a")
    assert store.list("") == {k: len(v) for k, v in objects.items()}


def test_a_follower_finds_new_rounds_by_key_without_listing(store):
    for r in range(3):
        store.put_if_absent(layout.manifest_key("a", r), b"m")
    store.put_if_absent(layout.model_key("a", 3, "0" * 64), b"model")  # round 3 half-written: no manifest yet
    assert newest_round_from(store, "a", None) == 2  # nothing held yet: one listing
    lists = store.io.lists
    assert newest_round_from(store, "a", 2) == 2
    store.put_if_absent(layout.manifest_key("a", 3), b"m")
    store.put_if_absent(layout.manifest_key("a", 4), b"m")
    assert newest_round_from(store, "a", 2) == 4  # two rounds published since the last poll
    assert store.io.lists == lists


def test_list_sees_objects_written_after_an_earlier_list(store):
    store.put_if_absent("runs/r/deltas/x/000000.safetensors", b"1")
    assert set(store.list("runs/r/deltas/")) == {"runs/r/deltas/x/000000.safetensors"}
    other = ObjectStore(store.url)
    other.put_if_absent("runs/r/deltas/x/000001.safetensors", b"22")
    assert store.list("runs/r/deltas/") == {
        "runs/r/deltas/x/000000.safetensors": 1,
        "runs/r/deltas/x/000001.safetensors": 2,
    }


def test_store_below_a_bucket_lists_relative_to_its_root(store_url):
    outer = ObjectStore(store_url)
    inner = ObjectStore(store_url + "/base/")
    assert inner.url == store_url + "/base"
    outer.put_if_absent("elsewhere/x", b"no")
    inner.put_if_absent("k/v", b"yes")
    assert inner.list("") == {"k/v": 3}
    assert outer.get("base/k/v") == b"yes"
    assert outer.list("") == {"elsewhere/x": 2, "base/k/v": 3}


def test_file_list_ignores_unfinished_temporary_files(tmp_path):
    store = ObjectStore(f"file://{tmp_path}/bucket")
    store.put_if_absent("runs/r/a.bin", b"abc")
    (tmp_path / "bucket" / "runs" / "r" / ".tmp-crashed").write_bytes(b"partial")
    assert store.list("runs/") == {"runs/r/a.bin": 3}


# s3fs caches listings; a later HEAD or GET must still see what other processes wrote since.


def test_s3_get_after_a_list_sees_an_object_another_process_wrote(s3_endpoint, s3_bucket):
    store = ObjectStore(f"s3://{s3_bucket}")
    store.put_if_absent("runs/r/a", b"1")
    assert store.list("runs/") == {"runs/r/a": 1}
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=s3_bucket, Key="runs/r/b", Body=b"22")
    assert store.get("runs/r/b") == b"22"


def test_s3_size_and_exists_after_a_list_see_an_object_another_process_wrote(s3_endpoint, s3_bucket):
    store = ObjectStore(f"s3://{s3_bucket}")
    store.put_if_absent("runs/r/a", b"1")
    store.list("runs/")
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=s3_bucket, Key="runs/r/b", Body=b"22")
    assert store.size("runs/r/b") == 2
    assert store.exists("runs/r/b") is True


def test_s3_get_after_a_list_sees_an_object_another_thread_wrote(s3_bucket):
    # one s3fs instance (and directory cache) per process: a write from any thread invalidates it
    store = ObjectStore(f"s3://{s3_bucket}")
    store.put_if_absent("runs/r/a", b"1")
    store.list("runs/")
    writer = threading.Thread(target=lambda: ObjectStore(store.url).put_if_absent("runs/r/b", b"22"))
    writer.start()
    writer.join(30)
    assert ObjectStore(store.url).size("runs/r/b") == 2  # a fresh look from this thread
    assert store.get("runs/r/b") == b"22"


def test_s3_get_without_an_earlier_list_sees_an_object_another_process_wrote(s3_endpoint, s3_bucket):
    store = ObjectStore(f"s3://{s3_bucket}")
    store.put_if_absent("runs/r/a", b"1")
    boto3.client("s3", endpoint_url=s3_endpoint).put_object(Bucket=s3_bucket, Key="runs/r/b", Body=b"22")
    assert store.get("runs/r/b") == b"22"
    assert store.size("runs/r/b") == 2


# -- racing writers -----------------------------------------------------------------------------


def test_eight_threads_racing_on_one_key_exactly_one_wins(store_url):
    n = 8
    barrier = threading.Barrier(n)
    results: dict[int, bool] = {}
    errors: list[BaseException] = []
    stores = [ObjectStore(store_url) for _ in range(n)]
    payloads = [f"writer {i} ".encode() * (i + 1) for i in range(n)]

    def write(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            results[i] = stores[i].put_if_absent("race/manifest.json", payloads[i])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(results) == n
    winners = [i for i, won in results.items() if won]
    assert len(winners) == 1
    assert ObjectStore(store_url).get("race/manifest.json") == payloads[winners[0]]
    assert set(ObjectStore(store_url).list("race/")) == {"race/manifest.json"}


def _race_in_process(url: str, index: int, barrier, queue) -> None:
    """One racing writer in its own process, with its own ObjectStore."""
    try:
        store = ObjectStore(url)
        store.exists("race/warm-up")  # open connections before the start line
        barrier.wait(timeout=60)
        queue.put((index, store.put_if_absent("race/manifest.json", f"process {index}".encode() * (index + 1))))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put((index, repr(exc)))


def test_four_processes_racing_on_one_key_exactly_one_wins(store_url):
    n = 4
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(n)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_race_in_process, args=(store_url, i, barrier, queue)) for i in range(n)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=90) for _ in range(n))
    finally:
        for p in procs:
            p.join(30)
    assert all(isinstance(v, bool) for v in results.values()), results
    winners = [i for i, won in results.items() if won]
    assert len(winners) == 1, results
    s3fs.S3FileSystem.clear_instance_cache()
    assert ObjectStore(store_url).get("race/manifest.json") == f"process {winners[0]}".encode() * (winners[0] + 1)


# -- reachability -------------------------------------------------------------------------------


def test_check_reachable_existing_bucket(s3_bucket):
    ObjectStore(f"s3://{s3_bucket}").check_reachable()


def test_check_reachable_missing_bucket_says_what_to_do(s3_endpoint):
    url = f"s3://missing-{uuid.uuid4().hex[:12]}"
    with pytest.raises(StoreError) as info:
        ObjectStore(url).check_reachable()
    message = str(info.value)
    assert url in message
    assert "does not exist" in message
    assert "create it" in message


def test_check_reachable_closed_endpoint_says_what_to_do(s3_endpoint, closed_port):
    endpoint = f"http://127.0.0.1:{closed_port}"
    options = {"endpoint_url": endpoint, "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
    with pytest.raises(StoreError) as info:
        ObjectStore("s3://islands-global", options).check_reachable()
    message = str(info.value)
    assert "s3://islands-global" in message
    assert "not reachable" in message
    assert "AWS_ENDPOINT_URL" in message
    assert f"127.0.0.1:{closed_port}" in message


def test_check_reachable_creates_a_local_folder(tmp_path):
    target = tmp_path / "deep" / "islands-global"
    ObjectStore(f"file://{target}").check_reachable()
    assert target.is_dir()


def test_check_reachable_refuses_a_local_folder_under_a_file(tmp_path):
    (tmp_path / "plain-file").write_text("x")
    url = f"file://{tmp_path}/plain-file/bucket"
    with pytest.raises(StoreError, match="plain-file/bucket"):
        ObjectStore(url).check_reachable()


@pytest.fixture
def closed_port():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s3fs.S3FileSystem.clear_instance_cache()
    yield port
    s3fs.S3FileSystem.clear_instance_cache()


# -- counters -----------------------------------------------------------------------------------


def test_io_counters_count_bytes_and_are_shared_per_url(store_url):
    a = ObjectStore(store_url)
    b = ObjectStore(store_url + "/")
    assert a.io is b.io
    assert a.io.as_dict() == {"bytes_read": 0, "bytes_written": 0, "gets": 0, "puts": 0, "lists": 0}
    assert a.put_if_absent("k1", b"0123456789")
    assert not b.put_if_absent("k1", b"abc")  # refused: nothing crossed as written
    assert b.put_if_absent("k2", b"xyz")
    assert a.get("k1") == b"0123456789"
    assert b.get_range("k1", 2, 6) == b"2345"
    a.list("")
    assert b.io.as_dict() == {"bytes_read": 14, "bytes_written": 13, "gets": 2, "puts": 3, "lists": 1}
    other = ObjectStore(store_url + "/elsewhere")
    assert other.io is not a.io
    assert other.io.bytes_written == 0


def test_io_counters_lose_no_count_when_threads_read_one_bucket(tmp_path):
    store = ObjectStore(f"file://{tmp_path / 'threads'}")
    store.put_if_absent("k", b"x" * 100)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: [store.get("k") for _ in range(500)], range(4)))
    assert (store.io.gets, store.io.bytes_read) == (2000, 200_000)


# -- templates ----------------------------------------------------------------------------------


def test_bucket_url_and_stores(tmp_path):
    assert bucket_url("s3://islands-{bucket}", "eu-west") == "s3://islands-eu-west"
    with pytest.raises(ValueError, match=r"\{bucket\}"):
        bucket_url("s3://islands", "eu-west")
    stores = Stores(f"file://{tmp_path}/{{bucket}}", ["us-east", "eu-west"])
    assert stores.global_.url == f"file://{tmp_path}/global"
    assert stores.region("eu-west").url == f"file://{tmp_path}/eu-west"
    assert [s.url for s in stores.all()] == [f"file://{tmp_path}/{b}" for b in ("global", "us-east", "eu-west")]


# -- memory:// (unit tests of pure logic only) -------------------------------------------------


def test_memory_store_smoke():
    store = ObjectStore(f"memory://islands-test-{uuid.uuid4().hex[:8]}")
    assert store.put_if_absent("runs/r/x", b"one") is True
    assert store.put_if_absent("runs/r/x", b"two") is False
    assert store.get("runs/r/x", sha256=sha256_hex(b"one")) == b"one"
    assert store.size("runs/r/x") == 3
    assert store.size("runs/r/y") is None
    assert store.list("runs/") == {"runs/r/x": 3}
    store.check_reachable()


def test_list_after_a_key_returns_only_the_keys_sorting_after_it(store_url):
    for base in ("", "/base"):
        store = ObjectStore(store_url + base)
        for p in range(4):
            store.put_if_absent(layout.delta_key("r", "x", p), b"d" * p)
        assert store.list(layout.learner_deltas_prefix("r", "x"), start_after=layout.delta_key("r", "x", 1)) == {
            layout.delta_key("r", "x", 2): 2,
            layout.delta_key("r", "x", 3): 3,
        }
        assert store.list("runs/r/", start_after=layout.delta_key("r", "x", 3)) == {}


def test_s3_lists_every_page(s3_bucket, monkeypatch):
    store = ObjectStore(f"s3://{s3_bucket}")
    keys = {f"runs/r/k{i:02d}": 1 for i in range(5)}
    for key in keys:
        store.put_if_absent(key, b"x")
    call, pages = store._call, []

    def counted(method, **kw):
        pages.append(method)
        return call(method, **kw)

    monkeypatch.setattr(s3_module, "LIST_PAGE_KEYS", 2)
    monkeypatch.setattr(store, "_call", counted)
    assert store.list("runs/") == keys
    assert pages == ["list_objects_v2"] * 3
    assert store.list("runs/", start_after="runs/r/k00") == {k: 1 for k in list(keys)[1:]}


def test_s3_asking_for_a_missing_key_is_one_request(s3_bucket, caplog):
    # readers poll for keys that are not there yet (the next manifest, stop.json): each poll
    # must be one HEAD, not a HEAD and a LIST looking for a folder of that name
    store = ObjectStore(f"s3://{s3_bucket}")
    with caplog.at_level("INFO", logger="werkzeug"):  # the S3 server's request log
        assert store.exists("runs/r/manifest.json") is False
    requests = [r.getMessage() for r in caplog.records if s3_bucket in r.getMessage()]
    assert len(requests) == 1 and "HEAD /" in requests[0], requests


def test_spool_hashes_the_object_and_its_body_across_many_chunks(store, tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "READ_BYTES", 1000)
    header = b'{"__metadata__":{}}'
    data = len(header).to_bytes(8, "little") + header + bytes(range(256)) * 40  # ~10 chunks
    store.put_if_absent("runs/r/d", data)
    got = spool(store, "runs/r/d", tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == data
    assert got.bytes == len(data)
    assert got.sha256 == sha256_hex(data)
    assert got.body_sha256 == sha256_hex(data[8 + len(header) :])


def test_a_store_made_after_the_endpoint_variable_changes_talks_to_the_new_endpoint(monkeypatch):
    """fsspec hands out one file system per set of arguments: without the endpoint among them, a
    store made after AWS_ENDPOINT_URL changed (a restarted stack, a test's own server) got the
    old endpoint's file system, and its buckets answered NoSuchBucket."""
    stores = {}
    for url in ("http://127.0.0.1:1", "http://127.0.0.1:2"):
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        stores[url] = ObjectStore("s3://islands-endpoint-test")
    (a, first), (b, second) = stores.items()
    assert first.fs is not second.fs
    assert (first.fs.endpoint_url, second.fs.endpoint_url) == (a, b)
