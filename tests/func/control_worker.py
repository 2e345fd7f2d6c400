"""Real processes that own runs, for the authority tests (run by path, not imported).

    python control_worker.py hold <state> [--lease S] [--for S] [--release] [--wait]
        acquire the run, print ``acquired <generation> <pid>``, hold it ``--for`` seconds
        (default: until killed), then release it (``--release``) or just exit
    python control_worker.py race <base> <rounds> <n> [<warm from>]
        ``rounds`` races of ``n`` forked processes for one run; one JSON line per round

A failure is reported as spill's CLI does: ``spill: error: <message>`` on stderr and the
error's own exit code (``Busy.exit_code`` is 75).

``race`` imports ``spill.control.ownership`` (and s3fs) once, then forks its racers, so a round costs
forks rather than fresh interpreters. It creates no filesystem and no event loop before forking
(fsspec's loop thread does not survive a fork), and asserts so. From round ``<warm from>`` on it
reads the state itself before each round, so the racers are forked from a process whose fsspec
loop thread and cached filesystem exist: fsspec must reset both in the child (it does, at fork
and on a new pid). The racers wait on one pipe and start when
the driver closes it; the winner holds the run until every loser has exited, reads the control
object back from the store, then releases it (even rounds) or exits without releasing (odd
rounds: the next round takes it over by the same-host dead-owner rule). A round whose index is
a multiple of ``FRESH`` races for generation 1 of a new state; the others race for the next
generation of the run the previous round left.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

FRESH = 3
LOSERS_DEADLINE = 60.0


def _fail(e: BaseException) -> int:
    from spill.errors import SpillError

    if isinstance(e, SpillError):
        print(f"spill: error: {e}", file=sys.stderr)
        return e.exit_code
    traceback.print_exc()
    return 3


def hold(argv: list[str]) -> int:
    from spill.control.ownership import acquire
    from spill.store.location import location

    state, opts = location(argv[0]), argv[1:]

    def opt(name: str) -> float | None:
        return float(opts[opts.index(name) + 1]) if name in opts else None

    try:
        run = acquire(state, lease=opt("--lease"), wait="--wait" in opts, poll=0.05)
    except Exception as e:
        return _fail(e)
    print("acquired", run.gen, os.getpid(), flush=True)
    seconds = opt("--for")
    if seconds is None:
        while True:
            time.sleep(60)
    time.sleep(seconds)
    if "--release" in opts:
        run.release()
        print("released", flush=True)
    return 0


def _racer(state: str, go: int, done: int, out: str, keep: bool) -> int:
    """One forked racer: wait for the start, acquire, and (the winner) hold until told."""
    from spill.control.keys import current
    from spill.control.ownership import acquire
    from spill.store.location import location

    state = location(state)  # parsed in the racer, as a process given the text parses it
    for fd, suffix in ((1, ".out"), (2, ".err")):
        f = os.open(out + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.read(go, 1)  # EOF for everyone at once: the driver closed the write end
    try:
        run = acquire(state)
    except Exception as e:
        return _fail(e)
    print(json.dumps({"won": run.gen}), flush=True)
    os.read(done, 1)  # every loser has exited
    try:
        doc = current(state)
        seen = {k: doc["owner"][k] for k in ("host", "pid", "nonce")}
        seen["generation"] = doc["generation"]
        print(json.dumps({"doc": seen, "nonce": run.nonce}), flush=True)
        if not keep:
            run.release()
    except Exception as e:
        return _fail(e)
    return 0


def _round(state: str, n: int, scratch: str, keep: bool) -> dict:
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    kids: dict[int, str] = {}
    for i in range(n):
        out = os.path.join(scratch, f"racer-{i}")
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                os.close(go_w)
                os.close(done_w)
                code = _racer(state, go_r, done_r, out, keep)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        kids[pid] = out
    os.close(go_r)
    os.close(done_r)
    os.close(go_w)  # start
    codes: dict[int, int] = {}
    deadline = time.monotonic() + LOSERS_DEADLINE
    while len(codes) < n - 1 and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
        else:
            time.sleep(0.005)
    os.close(done_w)  # the winner (or winners, if the lock failed) may go on
    for pid in kids:
        if pid not in codes:
            codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    racers = []
    for pid, out in kids.items():
        with open(out + ".out") as f:
            lines = [json.loads(line) for line in f if line.strip()]
        with open(out + ".err") as f:
            err = f.read()
        racers.append({"pid": pid, "rc": codes[pid], "out": lines, "err": err})
    return {"state": state, "racers": racers}


def race(argv: list[str]) -> int:
    import fsspec.asyn

    import spill.control.ownership  # noqa: F401  (imported once, before the forks)
    from spill.control.keys import current
    from spill.store.fs import is_local, join, scheme_of
    from spill.store.location import location

    base, rounds, n = argv[0], int(argv[1]), int(argv[2])
    warm_from = int(argv[3]) if len(argv) > 3 else rounds
    cached: list = []  # the instance caches fsspec keeps per class
    if not is_local(base):  # s3fs, gcsfs or adlfs (gs:// and az:// clients are made per pid)
        cached.append(fsspec.get_filesystem_class(scheme_of(base))._cache)

    state = base
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(rounds):
            fresh = r % FRESH == 0
            if fresh:
                state = join(base, f"race-{r:03d}")
            warm = r >= warm_from and not is_local(base)
            if warm:
                current(location(state))
            # cold: nothing a child could inherit half-made, no event loop, no cached filesystem
            cold = fsspec.asyn.loop[0] is None and not any(cached)
            assert cold is not warm
            t0 = time.perf_counter()
            result = _round(state, n, scratch, keep=r % 2 == 1)
            result.update(round=r, fresh=fresh, released=r % 2 == 0, warm=warm)
            result["seconds"] = time.perf_counter() - t0
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    sys.exit({"hold": hold, "race": race}[mode](rest))
