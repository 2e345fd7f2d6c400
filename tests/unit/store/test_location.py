"""A location is parsed once: what parsing finds, and how often a tune job parses its state."""

import json
import os
import subprocess
import sys

import pytest

from spill.errors import StoreError
from spill.store.location import Location, from_home, location, on_disk, shown_home
from tests.func.tune_kit import spill_env, tune_argv, write_train


@pytest.mark.parametrize(
    "text, scheme, path, writes",
    [
        ("/srv/state", "", "/srv/state", "flock"),
        ("file:///srv/state", "", "/srv/state", "flock"),
        ("file://localhost/srv/state", "", "/srv/state", "flock"),
        ("memory://runs/a", "memory", "memory://runs/a", "process"),
        ("s3://bucket/runs", "s3", "s3://bucket/runs", "object"),
        ("S3://bucket/runs", "s3", "S3://bucket/runs", "object"),
        ("gs://bucket/runs", "gs", "gs://bucket/runs", "object"),
        ("az://container/runs", "az", "az://container/runs", "object"),
    ],
)
def test_parse(text, scheme, path, writes):
    where = location(text)
    assert isinstance(where, Location) and where == text
    assert (where.scheme, where.path, where.writes, where.local) == (
        scheme,
        path,
        writes,
        scheme == "",
    )
    assert location(where) is where  # parsing a location again is no parse


def test_home_is_expanded():
    assert location("~/state").path == os.path.expanduser("~/state")


def test_join_keeps_what_was_parsed():
    local = location("file:///srv/state/").join("runs", "/a/")
    assert (local, local.path, local.local) == (
        "file:///srv/state/runs/a",
        "/srv/state/runs/a",
        True,
    )
    remote = location("s3://b/state").join("control/current.json")
    assert (remote, remote.path, remote.scheme) == (
        "s3://b/state/control/current.json",
        "s3://b/state/control/current.json",
        "s3",
    )


@pytest.mark.parametrize("text", ["ftp://host/state", "http://example.com/state"])
def test_refused_when_parsed(text):
    with pytest.raises(StoreError, match=r"unsupported location .* use a local path, s3://"):
        location(text)


def test_file_uri_of_another_host_is_refused():
    with pytest.raises(StoreError, match="names an absolute local path"):
        location("file://otherhost/state")


PROBE = """
import sys
import spill.store.location as where
texts = []
parse = where.location
def counting(place):
    if not isinstance(place, where.Location):
        texts.append(str(place))
    return parse(place)
where.location = counting  # before spill.cli imports it anywhere
from spill.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "texts": texts}))
"""


def test_a_tune_job_parses_its_state_once(tmp_path, tiny_models):
    """Every layer a tune job walks (CLI, writer, control, checkpoints, adapter export) takes the
    location the CLI parsed: the state's text, or any key under it, is parsed exactly once."""
    state = str(tmp_path / "state")
    argv = tune_argv(tiny_models["llama"], write_train(tmp_path / "train.jsonl"), state, steps=2)
    out = subprocess.run(
        [sys.executable, "-c", "import json\n" + PROBE, *argv],
        capture_output=True,
        text=True,
        env=spill_env(tmp_path / "home"),
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["rc"] == 0
    assert [t for t in seen["texts"] if t.startswith(state)] == [state]


def test_a_location_spells_its_home_and_its_parents(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    here = location(str(tmp_path / "link") + "/")
    assert here.canonical == str(real) and here.home("h1") == f"h1:{real}"
    assert here.parents()[:2] == [str(tmp_path), str(tmp_path.parent)]
    there = location("s3://bucket/a/b/")
    assert there.canonical == "s3://bucket/a/b" and there.home("h1") == "s3://bucket/a/b"
    assert there.parents() == ["s3://bucket/a", "s3://bucket"]
    assert all(isinstance(p, Location) for p in here.parents() + there.parents())


def test_a_recorded_home_is_read_back_where_it_can_be():
    assert from_home("s3://bucket/a", "h1") == "s3://bucket/a"
    assert from_home("h1:/srv/state", "h1") == "/srv/state"
    assert from_home("h2:/srv/state", "h1") is None
    assert isinstance(from_home("h1:/srv/state", "h1"), Location)
    assert shown_home("h2:/srv/state") == "/srv/state"
    assert shown_home("gs://bucket/a") == "gs://bucket/a"


def test_requests_in_flight_one_on_a_disk_several_on_an_object_store():
    assert location("/srv/state").requests == 1 and location("s3://b/state").requests == 4


def test_a_file_uri_is_plain_as_the_path_it_names_other_text_as_given():
    assert location("file:///srv/a/../state").plain == "/srv/state"
    assert location("file:///srv/state").uri and location("s3://b/state").uri
    for text in ("proj", "~/proj", "s3://b/proj/", "memory://b/p"):
        assert location(text).plain == text
        assert location(text).uri == ("://" in text)
    assert isinstance(location("file:///srv/state").plain, Location)


def test_absolute_is_one_spelling_with_links_kept_and_stays_parsed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    here = location("link/").absolute
    assert here == f"{tmp_path}/link" and here.local and isinstance(here, Location)
    assert location(f"file://{tmp_path}/x").absolute == f"{tmp_path}/x"
    there = location("s3://b/p/").absolute
    assert there == "s3://b/p" and there.scheme == "s3" and there.path == "s3://b/p"


def test_a_location_pickles_whole():
    import pickle

    for text in ("/srv/state", "file:///srv/state", "s3://b/p"):
        given = location(text)
        back = pickle.loads(pickle.dumps(given))
        assert (back, back.scheme, back.path) == (given, given.scheme, given.path)
        assert isinstance(back, Location)


@pytest.mark.parametrize(
    "text, path",
    [
        ("proj", "proj"),
        ("~/proj", os.path.expanduser("~/proj")),
        ("file:///srv/state", "/srv/state"),
        ("s3://b/state", None),
        ("ftp://host/state", None),  # any URI: not refused, not on this disk
    ],
)
def test_on_disk_names_the_local_path_of_any_text_and_no_uris(text, path):
    assert on_disk(text) == path
    if "ftp" not in text:
        assert on_disk(location(text)) == path
