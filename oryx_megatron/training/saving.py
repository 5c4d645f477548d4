"""Saving a training run's checkpoints, while the loop waits or in the background (``checkpoint.async_save``).

Both ways run megatron-core's asynchronous ``dist_checkpointing`` save (``compat.megatron.save_request``): on
every rank megatron writes the common state, plans the shards and returns an AsyncRequest whose ``async_fn``
writes this rank's shards. Here that function is wrapped to hash each file it wrote afterwards (``_HashingWriter``).

- **sync**: the request runs here and now (megatron's own sync save does the same).
- **async**: megatron's ``AsyncCallsQueue`` forks a writer process per rank, whose memory is a copy-on-write
  snapshot of the state at that moment (training goes on changing the weights), and training continues.
  ``poll`` (after every step; one all-reduce while a save is in flight) asks whether the writers of EVERY rank
  have finished.

Then the request's finalize functions run on every rank: ``_gather_writes`` (what every rank's writer reported:
its files' hashes, or how it died), megatron's (rank 0 writes ``.metadata``, then ``metadata.json``), then
``_publish``: rank 0 writes ``run_config.yaml``, checks the files against ``.metadata`` (``verify_checkpoint``),
writes ``checksums.sha256`` (``checkpoint.checksums``: last, so a checkpoint that has it is complete), moves
`latest` and applies retention. A kill anywhere before that leaves
`latest` on the previous complete checkpoint. A writer that died while the trainer lives (killed, out of memory;
or one of the worker processes megatron-core 0.16 forks per file, 0.19 writing in threads, which ``_WorkerWatch``
notices, since megatron would wait for it forever) fails the save on every rank as ONE ``CheckpointError`` line
naming the checkpoint, at the first ``poll`` after every rank's writer has ended (at the latest the next save or
the run's end). One save is in flight at a time: a new save, the end of training and the exit for requeue wait
for it (``finish``).
Metrics: ``checkpoint/blocking_s`` (what a save call blocked the loop), and, when an async save completes,
``checkpoint/background_s`` (its slowest rank's write and hashing) and ``checkpoint/finalize_s`` (what completing
it blocked the loop, with any wait for the writers).
"""

import logging
import multiprocessing
import os
import shutil
import signal
import threading
import time
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

import psutil
import torch.distributed as dist
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from oryx_megatron.checkpoint import (
    LATEST,
    RUN_CONFIG,
    CheckpointError,
    apply_retention,
    checkpoints,
    file_sha256,
    iteration_dir,
    iteration_of,
    latest_name,
    verify_checkpoint,
    write_checksums,
)
from oryx_megatron.compat.megatron import discard_write_results, save_request
from oryx_megatron.training.checkpointing import run_state

logger = logging.getLogger("oryx_megatron.train")


WRITER_NAME = "oryx-ckpt-write"  # an async save's writer process and its workers, as ps (/proc/PID/comm) names them
WATCH_S = 0.1  # how often a writer looks at its worker processes

# What a writer reports: its files (name -> sha256) and seconds; or, when it failed, why (one line)
Report = Union[Tuple[Dict[str, str], float], str]


class _HashingWriter:
    """A rank's shard writer (megatron's ``async_fn``), then the sha256 of each file it wrote; both, with the
    seconds they took, are reported through a pipe, since an async save runs them in a forked process (named
    ``WRITER_NAME``, watched by ``_WorkerWatch``). ``process``: that process, once megatron has forked it."""

    def __init__(self, write):
        self.write = write
        self.process: Optional[multiprocessing.Process] = None
        self._trainer = os.getpid()
        self._received, self._sent = multiprocessing.get_context("fork").Pipe(duplex=False)

    def __call__(self, rank, write_buckets, *args, **kwargs):
        start, watch = time.perf_counter(), None
        if os.getpid() != self._trainer:  # an async save's writer
            _name_this_process(WRITER_NAME)
            watch = _WorkerWatch(self._sent)
            watch.start()
        self.write(rank, write_buckets, *args, **kwargs)
        if watch is not None:
            watch.stop()
        hashes = {Path(file).name: file_sha256(Path(file)) for file, *_ in write_buckets}  # (path, name, data)
        self._sent.send((hashes, time.perf_counter() - start))

    def report(self) -> Report:
        """What the writer sent, once it has ended: (file name -> sha256, its seconds), or why it failed."""
        try:
            if self._received.poll():
                return self._received.recv()
            code = self.process.exitcode if self.process is not None else None
            return f"background writer {_how_it_ended(code)} before it had written and hashed its files"
        finally:
            self._received.close()
            self._sent.close()


class _WorkerWatch(threading.Thread):
    """In an async save's writer: megatron-core 0.16's write forks a worker process per file (0.19's writes in
    threads: nothing to watch) and waits for every one of them on a queue, forever if one dies (killed, out of
    memory). Every ``WATCH_S`` this thread looks at the writer's child processes without reaping them (``waitid``
    with ``WNOWAIT``); when one has ended abnormally it kills and reaps the others, reports why through the pipe
    and ends the writer, so that the save fails instead of hanging the trainer at its next save."""

    def __init__(self, report_to):
        super().__init__(name="ckpt-worker-watch", daemon=True)
        self.report_to, self._stopped = report_to, threading.Event()

    def stop(self) -> None:
        self._stopped.set()
        self.join()

    def run(self) -> None:
        writer = psutil.Process()
        while not self._stopped.wait(WATCH_S):
            workers = writer.children()
            died = next(((w.pid, code) for w in workers if (code := _abnormal_end(w.pid)) is not None), None)
            if died is not None:
                for worker in workers:
                    with suppress(psutil.NoSuchProcess):
                        worker.kill()
                psutil.wait_procs(workers, timeout=10)
                self.report_to.send(f"background writer's worker process {died[0]} {_how_it_ended(died[1])}")
                os._exit(1)


def _abnormal_end(pid: int) -> Optional[int]:
    """The exit code (negative: the signal) of the child ``pid`` if it ended abnormally; None while it runs or
    when it ended well. It is not reaped (megatron joins its workers)."""
    try:
        ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # already reaped: megatron joins the workers that ended well
        return None
    if ended is None or (ended.si_code == os.CLD_EXITED and ended.si_status == 0):
        return None
    return ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status


def _how_it_ended(exit_code: Optional[int]) -> str:
    if exit_code is not None and exit_code < 0:
        return f"was killed by {signal.Signals(-exit_code).name}"
    return f"exited with code {exit_code}" if exit_code else "ended"


def _name_this_process(name: str) -> None:
    """Name this process (and what it forks) ``name`` for ps and /proc/PID/comm (Linux; elsewhere nothing)."""
    try:
        Path("/proc/self/comm").write_text(name)
    except OSError:
        pass


class CheckpointSaver:
    """The saves of one training run into ``ckpt_dir``: ``save`` on every rank at the same iterations, ``poll``
    after each step, ``finish`` before the run ends; ``close`` on the way out of an error."""

    def __init__(self, ckpt_dir: str, async_save: bool = False, keep_last: Optional[int] = None,
                 keep_every: Optional[int] = None):
        self.ckpt_dir, self.keep_last, self.keep_every = ckpt_dir, keep_last, keep_every
        self.queue = AsyncCallsQueue() if async_save else None
        self._completed: Dict[str, float] = {}  # metrics of the saves completed since they were last returned

    def save(self, iteration: int, model_chunks, optimizer, scheduler, loader, run_config_yaml: str,
             extra: Optional[dict] = None) -> Dict[str, float]:
        """Save ``iteration`` (every rank): wait for the save in flight, start this one in an empty
        directory, and write it (sync) or leave it writing (async). Returns the metrics: this save's
        ``checkpoint/blocking_s`` and those of the one it waited for."""
        start = time.perf_counter()
        waited_for = self.finish()
        if discarded := discard_write_results():  # of saves that never completed: never read as this one's
            logger.warning("discarded the write results of %d earlier save(s) that did not complete", discarded)
        path = _empty_directory(self.ckpt_dir, iteration)
        request = save_request(run_state(model_chunks, optimizer, scheduler, loader, iteration, extra), path)
        writer = None
        if request.async_fn is not None:  # None: nothing of the checkpoint lies on this rank
            writer = _HashingWriter(request.async_fn)
        reports: List[Report] = []  # every rank's, once every writer has ended
        request = request._replace(async_fn=writer, finalize_fns=[
            partial(self._gather_writes, path, writer, reports), *request.finalize_fns,
            partial(self._publish, path, run_config_yaml, reports)])
        if self.queue is None:
            request.execute_sync()
        else:
            self.queue.schedule_async_request(request)
            if writer is not None:
                writer.process = self.queue.async_calls[-1].async_caller.process
            logger.info("saving %s in the background", path)
        return {**waited_for, "checkpoint/blocking_s": time.perf_counter() - start}

    def poll(self) -> Dict[str, float]:
        """Complete the save in flight if every rank's writer has finished (collective while one is in
        flight: call it on every rank); the metrics of what completed."""
        return self._complete(blocking=False)

    def finish(self) -> Dict[str, float]:
        """Wait for every rank's writer of the save in flight and complete it (collective); its metrics."""
        return self._complete(blocking=True)

    def close(self) -> None:
        """On the way out of an error: wait for this rank's writer to end, completing nothing (no
        collective: other ranks may be gone). `latest` stays on the last completed save."""
        if self.queue is not None:
            for call in self.queue.async_calls:
                call.async_caller.close()
            self.queue.async_calls.clear()

    def _complete(self, blocking: bool) -> Dict[str, float]:
        if self.queue is not None and self.queue.get_num_unfinalized_calls():
            start = time.perf_counter()
            if self.queue.maybe_finalize_async_calls(blocking=blocking):
                self._completed["checkpoint/finalize_s"] = time.perf_counter() - start
        return self._take_completed()

    def _take_completed(self) -> Dict[str, float]:
        completed, self._completed = self._completed, {}
        return completed

    def _gather_writes(self, path: Path, writer: Optional[_HashingWriter], reports: List[Report]) -> None:
        """The first finalize function (every rank; every writer has ended): every rank's writer's report into
        ``reports``. When one failed, the save fails on every rank, before megatron's finalize reads the write
        results: one CheckpointError naming the checkpoint and the rank; `latest` stays where it is."""
        gathered: List[Report] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, writer.report() if writer is not None else ({}, 0.0))
        self._fail_if(path, [f"rank {rank}'s {why}" for rank, why in enumerate(gathered) if isinstance(why, str)])
        reports.extend(gathered)

    def _publish(self, path: Path, run_config_yaml: str, reports: List[Report]) -> None:
        """The last finalize function (every rank; megatron's finalize has written .metadata and
        metadata.json): rank 0 writes run_config.yaml and checks what it would publish (``verify_checkpoint``
        without the checksums: the writers hashed the bytes as they wrote them; a failure fails the save on every
        rank), then writes the checksums (the shards' from their writers' ``reports``), moves `latest` and
        applies retention."""
        damage = [None]
        if dist.get_rank() == 0:
            (path / RUN_CONFIG).write_text(run_config_yaml)
            try:
                verify_checkpoint(path, checksums=False)
            except CheckpointError as e:
                damage = [f"it wrote a damaged checkpoint: {e.reason}"]
        dist.broadcast_object_list(damage, src=0)
        self._fail_if(path, [why for why in damage if why is not None])
        if dist.get_rank() == 0:
            write_checksums(path, {name: sha for file_hashes, _ in reports for name, sha in file_hashes.items()})
            _write_latest(self.ckpt_dir, path.name)
            apply_retention(self.ckpt_dir, self.keep_last, self.keep_every)
        dist.barrier()
        if self.queue is not None:
            self._completed["checkpoint/background_s"] = max(s for _, s in reports)
        logger.info("saved %s", path)

    def _fail_if(self, path: Path, failures: List[str]) -> None:
        """One CheckpointError naming the checkpoint, its ``failures`` and where `latest` stays, if any."""
        if failures:
            latest = latest_name(self.ckpt_dir)
            raise CheckpointError(path, f"the save failed: {'; '.join(failures)}; `latest` still names "
                                        f"{latest.name if latest is not None else 'no checkpoint'}")


def save_checkpoint(ckpt_dir: str, iteration: int, model_chunks, optimizer, scheduler, loader,
                    run_config_yaml: str, keep_last: Optional[int] = None, keep_every: Optional[int] = None,
                    extra: Optional[dict] = None) -> Path:
    """One synchronous save on every rank (``CheckpointSaver.save``); returns its directory."""
    saver = CheckpointSaver(ckpt_dir, keep_last=keep_last, keep_every=keep_every)
    saver.save(iteration, model_chunks, optimizer, scheduler, loader, run_config_yaml, extra)
    return iteration_dir(ckpt_dir, iteration)


def _empty_directory(ckpt_dir: str, iteration: int) -> Path:
    """The empty directory of ``iteration``'s checkpoint (rank 0 makes it; every rank waits). A leftover of a
    save that did not finish (never the one `latest` names) is removed; a fresh run (checkpoint.load=false)
    in a used dir that saves the iteration `latest` names points `latest` at an older one first."""
    path = iteration_dir(ckpt_dir, iteration)
    if dist.get_rank() == 0:
        named = latest_name(ckpt_dir)
        if path.exists() and named is not None and path.resolve() == named.resolve():
            older = [p for p in checkpoints(ckpt_dir) if iteration_of(p) < iteration]
            logger.warning("overwriting %s; `latest` names %s until the save completes", path,
                           older[-1].name if older else "nothing")
            if older:
                _write_latest(ckpt_dir, older[-1].name)
            else:
                (Path(ckpt_dir) / LATEST).unlink()
        elif path.exists():
            logger.warning("removing %s: a save of iteration %d that did not finish", path, iteration)
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
    dist.barrier()
    return path


def _write_latest(ckpt_dir: str, name: str) -> None:
    tmp = Path(ckpt_dir) / f"{LATEST}.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, Path(ckpt_dir) / LATEST)
