"""Where a move goes, and whether it can go there, checked before the source changes.

``locations`` (the scheme, the overlap with the project and its state), ``check_place`` (the
destination's name, and no run-holding location around it) and ``check_room`` (names probed, free
space) are the checks of ``spill move`` that need no control object; ``move.move`` runs them with
the stores' check, ``transfer.check_source`` and ``arrival.check_destination`` in the order
docs/move.md gives ("Before the source changes"). Each refusal is one line, with nothing written at
either place.
"""

from __future__ import annotations

from typing import Any

from spill.control.keys import current
from spill.control.ownership import busy, is_held, outer_state
from spill.control.place import FROZEN
from spill.errors import StoreError, UsageError
from spill.ground.paths import STATE_DIR
from spill.project.report.status import is_state
from spill.store import snapshot
from spill.store.fs import exists, join, listdir, stat
from spill.store.location import Location
from spill.store.probe import check_names, not_a_file, probe_names, space


def _inside(a: str, b: str) -> bool:
    return a == b or a.startswith(b.rstrip("/") + "/")


def source(src: Location, state: Location | None) -> tuple[Location | None, Location]:
    """(project root or None, source state) of ``spill move``'s first argument."""
    src = src.absolute
    if exists(src.join("spill.yaml")):
        return src, state.absolute if state else src.join(STATE_DIR)

    if not is_state(src):
        raise UsageError(f"{src} is neither a project folder nor a state location")
    return None, src


def locations(
    src: Location, to: Location, state: Location | None
) -> tuple[Location | None, Location, Location, Location]:
    """(project root or None, source state, destination root, destination state), after
    checks 1 and 2 of docs/move.md's list (no store is asked anything of the destination)."""
    to = to.absolute
    if to.scheme == "memory":
        raise UsageError(
            f"{to}: memory:// lives only inside one process; move to a folder or an object store"
        )
    to.check()  # a backend missing: one line, nothing connected
    root, src_state = source(src, state)
    real = to.canonical
    for mine in (src_state, root) if root else (src_state,):
        if _inside(real, mine.canonical) or _inside(mine.canonical, real):
            that = f" (that is {real})" if real != to else ""
            raise UsageError(
                f"{to}{that} and {root or src_state} overlap; move to a location outside the "
                "project"
            )
    return root, src_state, to, to.join(STATE_DIR) if root else to


def check_place(to: Location) -> None:
    """Check 4 of docs/move.md's list, once the destination's store is known to be usable."""
    check_names(to)  # a name too long there would fail every read of it, not in one line
    not_a_file(to)
    outer = outer_state(to, every=True)
    if outer is not None:
        raise StoreError(
            f"{to} lies inside {outer}, which holds runs of its own (a state location); move "
            "to a location outside it"
        )


SWEEP = "sweep"  # a sweep's jobs, each a state of its own (spill.project.sweep)


def sweep_jobs(state: Location, finished: bool = False) -> dict[str, dict[str, Any]]:
    """``sweep/<job>`` -> the current control object of each sweep job under ``state`` that
    holds a run; a job a live process holds is refused (``Busy``, exit 75): its files are
    still changing. ``finished`` (a move): a job whose run may still be written (not complete,
    a copy or moved away) is refused too, in one line: its raw copy would be a second place to
    continue the same run from."""
    out = {}
    for name in listdir(join(state, SWEEP)):
        where = join(state, SWEEP, name)
        doc = current(where)
        if doc is None:
            continue
        if is_held(doc):
            raise busy(doc, where, " (a job of the sweep)")
        if finished and doc["status"] not in FROZEN:
            raise StoreError(
                f"sweep job {where} is unfinished (run {doc['run']}, {doc['status']}), and a "
                "move carries finished jobs only, so that one place continues each run: finish "
                "it (run the sweep again) or drop it (remove that folder), then move again"
            )
        out[f"{SWEEP}/{name}"] = doc
    return out


# The snapshot's names and sizes are read before the quiesce, so a writer that commits more before
# it stops may make the copy a little longer.
def snapshot_files(
    root: Location | None, src_state: Location, doc: dict[str, Any], exports: bool = False
) -> list[tuple[str, str]]:
    """(source URI, path relative to the destination) of every file a move of run ``doc``
    copies: the project's files, then the run's and its sweep jobs' whole
    (``snapshot.state_files``; the exports with ``exports``); an unfinished job is refused."""
    rels = snapshot.state_files(src_state, doc, exports, sweep_jobs(src_state, finished=True))
    files = [(join(src_state, r), f"{STATE_DIR}/{r}" if root else r) for r in rels]
    if root:
        files = [(join(root, r), r) for r in snapshot.project_files(root, src_state)] + files
    return files


def is_export(rel: str, project: bool) -> bool:
    """Whether a path a move's manifest names is an export's (``.spill/exports/...`` in a
    project's move)."""
    return rel.startswith(f"{STATE_DIR}/{snapshot.EXPORTS}/" if project else f"{snapshot.EXPORTS}/")


def _bytes(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.1f} MiB)" if n >= 2**20 else f"{n} bytes ({n / 1024:.0f} KiB)"


def still_to_copy(dst_root: Location, files: list[tuple[str, str]]) -> list[tuple[str, int]]:
    """(relative path, size) of the files not at the destination yet at their size."""
    out = []
    for src, rel in files:
        size = (stat(src) or (0, None))[0]
        have = stat(join(dst_root, rel))
        if have is None or have[0] != size:
            out.append((rel, size))
    return out


def room_needed(dst_root: Location, left: list[tuple[str, int]]) -> tuple[int, int] | None:
    """(bytes the copy of ``left`` takes there, bytes free), where the store can say."""
    room = space(dst_root)
    if room is None:
        return None
    free, block = room
    folders = {rel.rpartition("/")[0] for rel, _ in left}
    need = sum(-(-size // block) * block for _, size in left) + (len(folders) + 16) * block
    return need, free


def full(
    dst_root: Location, need: int, free: int, why: str = "", then: str = "or move to another place"
) -> StoreError:
    return StoreError(
        f"{dst_root} has {_bytes(free)} free, and the move needs {_bytes(need)} there{why}; "
        f"free some space, {then}"
    )


def written(files: list[tuple[str, str]], state_rel: str, run: str) -> list[str]:
    """Every name a move writes at its destination, relative to it, at its longest: each file's
    temporary name while it is copied (``.move-<pid>-<name>``), the manifest's and the control
    object's while they are replaced (``.<name>.tmp-<12 hex>``)."""
    pid = "9" * len(str(2**22))  # the longest pid Linux gives
    out = [
        f"{d}{'/' if d else ''}.move-{pid}-{n}" for d, _, n in (r.rpartition("/") for _, r in files)
    ]
    runs = f"{state_rel}/runs/{run}".lstrip("/")
    tmp = ".tmp-" + "f" * 12
    return [*out, f"{runs}/.move-{'f' * 16}.json{tmp}", f"{runs}/.control.json{tmp}"]


AGAIN = "then run the same `spill move` again (or `spill move --abort` to call it off)"


def check_room(
    dst_root: Location, files: list[tuple[str, str]], state_rel: str, run: str, moving: bool
) -> None:
    """Checks 8 and 9 of docs/move.md's list (``moving``: the source is in this move already)."""
    probe_names(dst_root, [rel for _, rel in files], written(files, state_rel, run))
    room = room_needed(dst_root, still_to_copy(dst_root, files))
    if room is not None and room[0] > room[1]:
        raise full(dst_root, *room, then=AGAIN if moving else "or move to another place")
