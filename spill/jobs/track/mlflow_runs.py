"""An MLflow run (``MLflowRun``), through ``MlflowClient`` at ``MLFLOW_TRACKING_URI`` (mlflow's own
default when unset): found again by its ``spill.key`` tag, so a resumed run (any process, any
machine) logs into the run it started, and only the steps after those its metric history holds.

Statuses: RUNNING while a process logs, FINISHED at the last step, KILLED when a leg stops early
(``--stop-after``, preempted), FAILED on an error; a SIGKILLed leg stays RUNNING. A wrong port fails
the open in seconds, and a server that stops answering is given up after ~30 s.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from spill.errors import SpillError

KEY_TAG = "spill.key"
BATCH = 1000  # MLflow's limit of metrics per log_batch
# MLflow's own client retries a failed request 7 times over about 4 minutes and waits 120 s for an
# answer; a run that opens MLflow sets these shorter defaults (each unless already set in the
# environment), so a wrong port fails the open in seconds and a server that stops answering is given
# up after ~30 s (on the tracking's sender thread: no step waits for it).
HTTP = {  # MLflow's variables, read at each request: 3 tries of 10 s at most, 1-2 s apart
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0.5",
}


class MLflowRun:
    """One MLflow run of an experiment, found or made by its key."""

    name = "mlflow"

    def __init__(
        self, key: str, experiment: str, run: str, params: dict[str, Any], tags: dict[str, str]
    ) -> None:
        for name, value in HTTP.items():
            os.environ.setdefault(name, value)
        # against a server, set_terminated prints the run's link to stdout (--json's): not from
        # the sender thread, where redirecting stdout would take the main thread's with it
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)  # its retry lines
        from mlflow.entities import RunTag  # lazy: an optional tracker
        from mlflow.tracking import MlflowClient

        try:
            self.client = c = MlflowClient()
            exp = self._experiment(experiment)
            found = c.search_runs(
                [exp],
                filter_string=f"tags.`{KEY_TAG}` = '{key}'",
                max_results=1,
                order_by=["attributes.start_time ASC"],
            )
            if found:  # a later leg: its producer's tags replace the last leg's
                self.run_id = found[0].info.run_id
                c.update_run(self.run_id, status="RUNNING")
                c.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
                have = found[0].data.params
                self.last = {k: _newest(c, self.run_id, k) for k in found[0].data.metrics}
            else:
                info = c.create_run(exp, run_name=run, tags={**tags, KEY_TAG: key}).info
                self.run_id, have, self.last = info.run_id, {}, {}
            self._params({k: v for k, v in params.items() if k not in have})
        except SpillError:
            raise
        except Exception as e:
            raise SpillError(f"{_where()}: {_line(e)}; check MLFLOW_TRACKING_URI") from None
        self.uri = c.tracking_uri

    # The experiment is made on first use (sibling sweep jobs racing to make it find the winner's).
    def _experiment(self, name: str) -> str:
        c = self.client
        if (exp := c.get_experiment_by_name(name)) is not None:
            return exp.experiment_id
        try:
            return c.create_experiment(name)
        except Exception:  # a sibling made it first
            if (exp := c.get_experiment_by_name(name)) is None:
                raise
            return exp.experiment_id

    # Params are logged once: MLflow refuses a param logged again with another value, so a resumed
    # run logs only those the run lacks (``ckpt_every`` may differ between legs; the first leg's
    # stays).
    def _params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param  # lazy: an optional tracker

        items = [Param(k, "null" if v is None else str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow's limit of params per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def write(self, points: list[tuple[int, str, float]]) -> None:
        from mlflow.entities import Metric  # lazy: an optional tracker

        now = int(time.time() * 1000)
        metrics = [Metric(tag, float(value), now, step) for step, tag, value in points]
        for i in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + BATCH])

    def close(self, status: str | None) -> None:
        if status is not None:  # None: as it is (a build's eval:base, before its tune)
            self.client.set_terminated(self.run_id, status)


def _newest(client, run_id: str, key: str) -> int:
    return max((m.step for m in client.get_metric_history(run_id, key)), default=-1)


def _where() -> str:
    import mlflow  # lazy: an optional tracker

    return f"MLflow at {mlflow.get_tracking_uri()}"


def _line(e: Exception) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= 400 else f"{text[:200]} ... {text[-200:]}"  # the advice ends it
