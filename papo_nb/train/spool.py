"""A run's MLflow logging, journalled in its run folder and delivered off the training thread.

MLflow 3.17's own async logging (``log_metrics(..., synchronous=False)``, what transformers' MLflowCallback uses)
queues in memory only: a batch that fails while the server is down is dropped with an error line
(``mlflow/utils/async_logging/async_logging_queue.py``, ``_log_run_data``), and its HTTP client retries each request
7 times with exponential backoff (about 4 minutes) first. Other calls (tables, artifacts, tags) are synchronous.

Here every call is first appended to ``<run folder>/mlflow_spool/journal.jsonl`` (one JSON line per call, with its
original step and timestamp; a value JSON cannot hold, such as a table of images, goes to ``blobs/<seq>.pkl``) and
then delivered, in order, by one worker thread; ``delivered.json`` records how far delivery got. The training thread
never waits for the server. While the server is unreachable the worker warns once (with what is queued and where),
retries with a capped backoff, and delivers everything when the server answers again. ``close`` waits a bounded time
at the end; what is left stays in the spool, and ``papo-nb sync RUN_DIR`` (``deliver_spool``) delivers it later.

Replaying is idempotent where MLflow allows: a metric row equal in key, value, step and timestamp is dropped by the
SQL store (``SqlAlchemyStore._log_metrics_once``), a param logged again with its value is accepted, tags and
artifacts are overwritten. Only ``log_table``, which appends, could repeat rows, and only when a process dies between
a delivery and its cursor write.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any

SPOOL_DIRNAME = "mlflow_spool"
JOURNAL_FILE = "journal.jsonl"
CURSOR_FILE = "delivered.json"
BLOBS_DIRNAME = "blobs"
# MLflow's HTTP client retries 7 times with backoff factor 2 (about 4 minutes) and waits up to 120 s per request; the
# worker retries by itself, so a request should fail at once and a hung server in a few seconds.
FAST_FAILING_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
RETRY_SECONDS = (0.5, 1.0, 2.0, 5.0)  # the worker's backoff while the server is unreachable, capped at the last
METRICS_PER_BATCH = 1000  # MLflow's log_batch limits
PARAMS_PER_BATCH = 100
REPLAYED_CLIENT_CALLS = ("log_batch", "log_dict", "log_table", "log_metric", "log_text", "set_tag", "set_terminated")


def spool_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / SPOOL_DIRNAME


def fast_failing_http() -> None:
    """Make MLflow's HTTP requests fail fast in this process (an explicit setting by the user is kept)."""
    for name, value in FAST_FAILING_HTTP.items():
        os.environ.setdefault(name, value)


def is_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the store did not answer (worth retrying) rather than refused the call."""
    import requests
    from mlflow.exceptions import MlflowException

    if isinstance(exc, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, MlflowException):
        text = str(exc)
        status = getattr(exc, "get_http_status_code", lambda: 0)()
        return "failed with exception" in text or "Max retries exceeded" in text or status >= 500 or "disk" in text
    import sqlite3

    return isinstance(exc, sqlite3.OperationalError) or "database is locked" in str(exc) or "disk is full" in str(exc)


class TrackingSpool:
    """The journal of one MLflow run and the worker that delivers it; ``journal`` may be called from any thread."""

    def __init__(self, run_dir: str | Path, run_id: str, tracking_uri: str, *, start: bool = True):
        self.dir, self.run_id, self.tracking_uri = spool_dir(run_dir), run_id, tracking_uri
        (self.dir / BLOBS_DIRNAME).mkdir(parents=True, exist_ok=True)
        self.journal_path, self.cursor_path = self.dir / JOURNAL_FILE, self.dir / CURSOR_FILE
        cursor = read_cursor(self.dir)
        self.seq, self.delivered, self.offset = last_seq(self.journal_path), cursor["seq"], cursor["offset"]
        self.lock, self.wake = threading.Lock(), threading.Condition()
        self.closing = self.stopped = False
        self.down_since: float | None = None
        self.outages: list[dict[str, Any]] = []
        self.worker = threading.Thread(target=self._work, name="papo_nb-mlflow-spool", daemon=True)
        if start:
            self.worker.start()

    # ---------------------------------------------------------------- writing (the training thread)

    def journal(self, method: str, **kwargs: Any) -> None:
        """Append one MlflowClient call on this run (``method`` of REPLAYED_CLIENT_CALLS, its keyword arguments but
        ``run_id``) and wake the worker. It writes a line to a local file and returns."""
        if method not in REPLAYED_CLIENT_CALLS:
            raise ValueError(f"method: {method!r} is not journalled; allowed: {', '.join(REPLAYED_CLIENT_CALLS)}")
        with self.lock:
            self.seq += 1
            record = {"seq": self.seq, "method": method, "run_id": self.run_id}
            try:
                record["kwargs"] = json.loads(json.dumps(kwargs))
            except (TypeError, ValueError):  # a DataFrame of images, ...: pickled beside the journal
                blob = self.dir / BLOBS_DIRNAME / f"{self.seq}.pkl"
                blob.write_bytes(pickle.dumps(kwargs))
                record["blob"] = blob.name
            with self.journal_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        with self.wake:
            self.wake.notify()

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        now = int(time.time() * 1000)
        rows = [{"key": k, "value": float(v), "timestamp": now, "step": step or 0} for k, v in metrics.items()]
        self.journal("log_batch", metrics=rows)

    def log_params(self, params: dict[str, Any]) -> None:
        self.journal("log_batch", params=[{"key": k, "value": str(v)} for k, v in params.items()])

    def set_tags(self, tags: dict[str, Any]) -> None:
        self.journal("log_batch", tags=[{"key": k, "value": str(v)} for k, v in tags.items()])

    @property
    def pending(self) -> int:
        return self.seq - self.delivered

    # ---------------------------------------------------------------- delivering (the worker, or papo-nb sync)

    def _work(self) -> None:
        client, failures = None, 0
        while not self.stopped:
            records = self._unread()
            if not records:
                if self.closing:
                    return
                with self.wake:
                    self.wake.wait(0.5)
                continue
            try:
                client = client or tracking_client_for(self.tracking_uri)
                self.deliver(client, records)
                failures = 0
            except Exception as exc:  # noqa: BLE001 - a refused call must not kill the worker: it is reported
                if not is_unreachable(exc):
                    self._reject(records[0], exc)
                    continue
                failures += 1
                self._mark_down(exc)
                with self.wake:
                    self.wake.wait(RETRY_SECONDS[min(failures, len(RETRY_SECONDS)) - 1])

    def _unread(self) -> list[dict]:
        """Complete journal lines after the cursor (at most one batch's worth)."""
        if not self.journal_path.is_file():
            return []
        with self.journal_path.open("rb") as f:
            f.seek(self.offset)
            chunk = f.read(1 << 20)
        records, end = [], self.offset
        for line in chunk.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            end += len(line)
            record = json.loads(line)
            record["_end"] = end
            records.append(record)
        return records

    def deliver(self, client, records: list[dict]) -> None:
        """Deliver ``records`` in order, moving the cursor after each call that landed; raises what a call raised."""
        while records:
            group = mergeable_prefix(records)
            call_records, records = (group, records[len(group) :]) if group else (records[:1], records[1:])
            replay(client, self.dir, call_records)
            self.delivered, self.offset = call_records[-1]["seq"], call_records[-1]["_end"]
            write_cursor(self.dir, self.delivered, self.offset)
            for record in call_records:  # a delivered table's pickle is not needed again (hundreds of kB per step)
                if "blob" in record:
                    (self.dir / BLOBS_DIRNAME / record["blob"]).unlink(missing_ok=True)
            if self.down_since is not None:
                self._mark_up()

    def _mark_down(self, exc: BaseException) -> None:
        if self.down_since is not None:
            return
        self.down_since = time.time()
        print(
            f"papo_nb: the MLflow store {self.tracking_uri} is unreachable ({type(exc).__name__}); training goes on, "
            f"{self.pending} logging call(s) queued and every further one spooled to {self.journal_path}; they are "
            "delivered in order when it answers again",
            file=sys.stderr,
            flush=True,
        )

    def _mark_up(self) -> None:
        outage = {"down_at": self.down_since, "up_at": time.time(), "pending_after": self.pending}
        self.outages.append(outage)
        self.down_since = None
        print(
            f"papo_nb: the MLflow store {self.tracking_uri} answers again after "
            f"{outage['up_at'] - outage['down_at']:.0f} s; delivering the spool ({self.pending} call(s) left)",
            file=sys.stderr,
            flush=True,
        )

    def _reject(self, record: dict, exc: BaseException) -> None:
        """A call the store refused (not an outage): set aside in rejected.jsonl, named on stderr, and skipped."""
        with (self.dir / "rejected.jsonl").open("a") as f:
            f.write(json.dumps({**record, "error": f"{type(exc).__name__}: {exc}"[:2000]}) + "\n")
        self.delivered, self.offset = record["seq"], record["_end"]
        write_cursor(self.dir, self.delivered, self.offset)
        print(f"papo_nb: MLflow refused {record['method']} (call {record['seq']}): {exc}", file=sys.stderr, flush=True)

    def close(self, timeout: float) -> int:
        """Stop accepting work, deliver for at most ``timeout`` seconds, stop the worker; returns the calls left in
        the spool (0: all delivered). What is left is named on stderr with the command that delivers it."""
        self.closing = True
        with self.wake:
            self.wake.notify()
        if self.worker.ident is not None:  # started
            self.worker.join(timeout)
            self.stopped = True
            self.worker.join(float(FAST_FAILING_HTTP["MLFLOW_HTTP_REQUEST_TIMEOUT"]) + 1)
        left = self.pending
        if left:
            run_dir = self.dir.parent
            print(
                f"papo_nb: {left} MLflow logging call(s) of run {self.run_id} were not delivered to "
                f"{self.tracking_uri}; they are kept in {self.journal_path}: deliver them with "
                f"`papo-nb sync {run_dir}` once the store answers",
                file=sys.stderr,
                flush=True,
            )
        return left


def tracking_client_for(tracking_uri: str):
    from papo_nb.infra.tracking import tracking_client

    return tracking_client(tracking_uri)


def mergeable_prefix(records: list[dict]) -> list[dict]:
    """The leading ``log_batch`` records that fit one MLflow batch together (empty when the first is another call)."""
    group, metrics, params, tags = [], 0, 0, 0
    for record in records:
        kwargs = record.get("kwargs")
        if record["method"] != "log_batch" or kwargs is None:
            break
        m, p, t = (len(kwargs.get(k, [])) for k in ("metrics", "params", "tags"))
        if group and (metrics + m > METRICS_PER_BATCH or params + p > PARAMS_PER_BATCH or tags + t > PARAMS_PER_BATCH):
            break
        group.append(record)
        metrics, params, tags = metrics + m, params + p, tags + t
    return group


def replay(client, folder: Path, records: list[dict]) -> None:
    """One MlflowClient call for ``records``: their merged log_batch, or the single other call."""
    from mlflow.entities import Metric, Param, RunTag

    first = records[0]
    if first["method"] == "log_batch" and "blob" not in first:
        merged = {k: [row for r in records for row in r["kwargs"].get(k, [])] for k in ("metrics", "params", "tags")}
        client.log_batch(
            first["run_id"],
            metrics=[Metric(**row) for row in merged["metrics"]],
            params=list({row["key"]: Param(**row) for row in merged["params"]}.values()),
            tags=[RunTag(**row) for row in merged["tags"]],
        )
        return
    blob = folder / BLOBS_DIRNAME / first.get("blob", "")
    kwargs = pickle.loads(blob.read_bytes()) if "blob" in first else first["kwargs"]
    getattr(client, first["method"])(first["run_id"], **kwargs)


def read_cursor(folder: Path) -> dict:
    path = folder / CURSOR_FILE
    return json.loads(path.read_text()) if path.is_file() else {"seq": 0, "offset": 0}


def write_cursor(folder: Path, seq: int, offset: int) -> None:
    from papo_nb.train.run_folder import write_atomic

    write_atomic(folder / CURSOR_FILE, json.dumps({"seq": seq, "offset": offset}))


def last_seq(journal: Path) -> int:
    """The last call's number in ``journal``; a line a killed process left half-written is cut off first."""
    if not journal.is_file():
        return 0
    last, complete = 0, 0
    with journal.open("rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                break
            last, complete = json.loads(line)["seq"], complete + len(line)
    if complete != journal.stat().st_size:
        os.truncate(journal, complete)
    return last


def deliver_spool(run_dir: str | Path, tracking_uri: str | None = None, timeout: float = 300.0) -> tuple[int, int]:
    """``papo-nb sync``: deliver what a run's spool still holds, in order, to ``tracking_uri`` (default: the store
    recorded in run_info.json). Returns (calls delivered, calls left); raises FileNotFoundError for a folder without a
    spool and the store's own error when it stays unreachable past ``timeout`` seconds."""
    from papo_nb.train.run_folder import read_run_info

    folder = spool_dir(run_dir)
    if not (folder / JOURNAL_FILE).is_file():
        raise FileNotFoundError(f"RUN_DIR: {run_dir} holds no MLflow spool ({folder / JOURNAL_FILE} is missing)")
    uri = tracking_uri or read_run_info(run_dir).get("tracking_uri") or ""
    if not uri:
        raise ValueError(f"RUN_DIR: {run_dir}'s run_info.json names no tracking store; pass --tracking-uri")
    fast_failing_http()
    spool = TrackingSpool(run_dir, "", uri, start=False)
    before, deadline, client = spool.delivered, time.monotonic() + timeout, tracking_client_for(uri)
    while records := spool._unread():
        try:
            spool.deliver(client, records)
        except Exception as exc:  # noqa: BLE001 - retried while the store is unreachable, else set aside
            if not is_unreachable(exc):
                spool._reject(records[0], exc)
            elif time.monotonic() > deadline:
                raise
            else:
                time.sleep(RETRY_SECONDS[-1])
    return spool.delivered - before, spool.pending


def sync_command(run_dir: str, tracking_uri: str, timeout: float) -> int:
    """The body of ``papo-nb sync``: 0 all delivered, 1 the store stayed unreachable, 2 nothing to deliver from."""
    if not timeout >= 0:
        print(f"papo-nb sync: error: --timeout: {timeout!r} is not allowed; give seconds >= 0", file=sys.stderr)
        return 2
    try:
        delivered, left = deliver_spool(run_dir, tracking_uri or None, timeout)
    except (FileNotFoundError, ValueError) as exc:
        print(f"papo-nb sync: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the store's own error, named
        if not is_unreachable(exc):
            raise
        print(f"papo-nb sync: error: the store did not answer within {timeout:.0f} s ({exc})", file=sys.stderr)
        return 1
    print(f"papo-nb sync: delivered {delivered} call(s) from {spool_dir(run_dir) / JOURNAL_FILE}; {left} left")
    return 0 if left == 0 else 1
