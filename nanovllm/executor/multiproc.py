"""Tensor parallelism: rank 0 (in the engine's process) drives ranks 1..N-1 (spawned workers).

Rank 0 publishes every command through a CommandChannel and wakes each worker through its own
semaphore; each worker builds its own step inputs from the sequences and joins the step's
collectives (gloo on CPU, NCCL on CUDA), through which alone tensors move.
"""
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import wait
from multiprocessing.synchronize import Semaphore

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.executor.base import Executor
from nanovllm.executor.rank0_thread import Rank0Thread, abandoned_call_running
from nanovllm.executor.shm_channel import CommandChannel
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.runner.rank_commands import RANK_COMMANDS

logger = logging.getLogger(__name__)

# A collective that waits longer than this for a peer fails instead of hanging forever; gloo
# fails at once when a peer's socket closes, so this only bounds a peer that is stuck.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
STARTUP_TIMEOUT_S = 300.0  # spawned ranks must join the process group within this
PARENT_POLL_S = 0.5  # how often an idle worker checks that the engine's process is alive
DEATH_GRACE_S = 5.0  # a broken collective may be noticed before the dead peer is reaped
JOIN_TIMEOUT_S = 10.0
# After a worker's death, freeing rank 0's GPU state and group waits at most this long: an
# abort or a device sync may wait forever on the dead peer's collective (NCCL issues 829, 863).
RELEASE_TIMEOUT_S = 5.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process exited while the engine needed it."""


def cpu_threads_per_rank(world_size: int) -> int:
    """Split this machine's cores between ranks: oversubscribed ranks crawl at every collective."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


def abort_communicator(device: str) -> None:
    """Abort NCCL's communicator, so that collectives on a dead peer fail at once."""
    # The abort itself can wait on the dead peer (NCCL 2.28 on two H200s), so nobody waits for
    # it (see Rank0Thread). gloo's sockets fail on their own.
    if device == "cuda" and dist.is_initialized():
        dist.distributed_c10d._abort_process_group()


def init_process_group(device: str, store: dist.Store, rank: int, world_size: int) -> None:
    """Join the engine's process group: NCCL on CUDA, gloo on CPU."""
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)


def worker_main(config: Config, rank: int, port: int, channel_name: str,
                wakeup: Semaphore) -> None:
    """Entry point of a spawned rank: join the group, build the shard, serve commands."""
    # Ctrl-C in a terminal reaches the whole process group; rank 0 alone handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    world_size = config.tensor_parallel_size
    if config.device == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(world_size))
    channel = CommandChannel.attach(channel_name)  # before joining, so no command is missed
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    store.set(f"joined/{rank}", "1")
    init_process_group(config.device, store, rank, world_size)
    runner = None
    try:
        runner = ModelRunner(config, rank)
        worker_loop(runner, channel, wakeup)
    finally:
        if runner is not None:
            runner.shutdown()
        channel.close()
        dist.destroy_process_group()


def worker_loop(runner: ModelRunner, channel: CommandChannel, wakeup: Semaphore) -> None:
    """Read commands and dispatch them until "shutdown", or until the engine's process dies."""
    parent = mp.parent_process()
    while True:
        if not wakeup.acquire(timeout=PARENT_POLL_S):
            if parent is not None and not parent.is_alive():
                return  # orphaned: nobody will ever send "shutdown"
            continue
        method, args = channel.read()
        if method == "shutdown":
            return
        if method not in RANK_COMMANDS:
            raise RuntimeError(f"unknown worker command {method!r}; expected one of "
                               f"{[*RANK_COMMANDS, 'shutdown']}")
        RANK_COMMANDS[method](runner, *args)


class MultiprocExecutor(Executor):
    """All ranks of one engine: spawned workers, rank 0's runner here, and a watchdog."""

    pipelined = False

    def __init__(self, config: Config):
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this "
                               "process (another tensor-parallel engine?); shut it down first")
        # One abandoned a moment ago ends once gloo sees the dead peer; NCCL's may never end.
        if abandoned_call_running(wait_s=DEATH_GRACE_S):
            raise RuntimeError("a step of a tensor-parallel engine whose worker died still runs "
                               "in this process and would disturb a new one; start the new "
                               "engine in a fresh process")
        self.device, self.world_size = config.device, config.tensor_parallel_size
        self.closed = False
        # Rank 0's runner: freed before leaving the group, because NCCL's exit waits while CUDA
        # graphs that captured its collectives exist.
        self.runner: ModelRunner | None = None
        self.rank0: Rank0Thread | None = None  # runs rank 0's share of each command
        # Port 0: the OS picks a free port, so engines on one machine never collide.
        self.store = dist.TCPStore("127.0.0.1", 0, self.world_size, is_master=True,
                                   timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        self.channel = CommandChannel.create()
        ctx = mp.get_context("spawn")
        # One wakeup per worker. Semaphores, not Events: Event.set() waits for every waiter to
        # wake, so it hangs forever once a worker is killed while waiting; release() never blocks.
        self.wakeups = [ctx.Semaphore(0) for _ in range(1, self.world_size)]
        self.processes = [
            ctx.Process(target=worker_main, name=f"nanovllm-tp{rank}",
                        args=(config, rank, self.store.port, self.channel.name, wakeup))
            for rank, wakeup in enumerate(self.wakeups, start=1)]
        self.saved_num_threads = torch.get_num_threads()
        if self.device == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(self.world_size))
        self.worker_died = threading.Event()  # set once a worker is known dead (outside shutdown)
        self.lock = threading.Lock()  # orders the watchdog's verdict against shutdown
        self.abort_lock = threading.Lock()  # the communicator is aborted once, by one thread
        self.aborted = False
        self.watchdog = threading.Thread(target=self._watchdog, name="nanovllm-tp-watchdog",
                                         daemon=True)
        try:
            for process in self.processes:
                process.start()
            self._wait_until_joined()
            init_process_group(self.device, self.store, 0, self.world_size)
            self.watchdog.start()
            with self.guard():  # agrees on the KV pool size with the workers' runners
                self.runner = ModelRunner(config, 0)
            self.runner.peer_died = self.worker_died
            self.rank0 = Rank0Thread(self.runner.device)
        except BaseException:
            self.shutdown()
            raise

    def _wait_until_joined(self) -> None:
        """Wait for every worker to reach the rendezvous, failing fast if one dies first."""
        keys = [f"joined/{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.store.check(keys):
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel workers did not start within "
                                   f"{STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def _watchdog(self) -> None:
        """Wait for any worker's exit; then, unless shutting down, abort the communicator."""
        sentinels = [p.sentinel for p in self.processes]
        while not wait(sentinels, timeout=PARENT_POLL_S):
            if self.closed:
                return
        with self.lock:
            if self.closed:
                return
            self.worker_died.set()  # before the abort, which may never return
        logger.error("tensor-parallel worker died (%s); aborting the communicator",
                     ", ".join(self.dead_workers()) or "its process ended")
        self._abort()

    def _abort(self) -> None:
        """Abort the communicator once; a second caller waits for the first one's abort."""
        with self.abort_lock:
            if not self.aborted:
                self.aborted = True
                abort_communicator(self.device)

    def dead_workers(self) -> list[str]:
        """'rank R (pid P) exit code C' for each worker that has exited."""
        return [f"rank {rank} (pid {p.pid}) exit code {p.exitcode}"
                for rank, p in enumerate(self.processes, start=1) if p.exitcode is not None]

    def check_alive(self) -> None:
        """Raise WorkerDiedError (after cleaning up) if any worker has exited."""
        dead = self.dead_workers()
        if dead:
            self.shutdown()
            raise WorkerDiedError(f"tensor-parallel worker died: {', '.join(dead)}")

    @contextmanager
    def guard(self) -> Iterator[None]:
        """A failure inside leaves the ranks out of step: clean up, and name a dead worker."""
        try:
            yield
        except BaseException as error:
            # A broken collective is often noticed before the dead peer has been reaped.
            grace = DEATH_GRACE_S if isinstance(error, RuntimeError) else 0.0
            deadline = time.monotonic() + grace
            while not self.dead_workers() and time.monotonic() < deadline:
                time.sleep(0.05)
            dead = self.dead_workers()
            self.shutdown(join_timeout_s=1.0)
            if dead:
                raise WorkerDiedError(f"tensor-parallel worker died: {', '.join(dead)}") from error
            raise

    def execute(self, method: str, *args, **rank0_kwargs) -> object:
        """Run `method` on every rank: workers through the channel, then rank 0's runner."""
        if self.closed:
            raise RuntimeError("the tensor-parallel workers are shut down")
        self.check_alive()
        with self.guard():
            self.channel.write(method, args)
            for wakeup in self.wakeups:
                wakeup.release()
            result = self.rank0.call(self.worker_died, RANK_COMMANDS[method], self.runner,
                                     *args, **rank0_kwargs)
        self.check_alive()  # an aborted collective may return garbage instead of raising
        return result

    def shutdown(self, join_timeout_s: float = JOIN_TIMEOUT_S) -> None:
        """Tell workers to exit, join (or kill) them, unlink the segment, leave the group."""
        # After a worker's death, nothing here waits on the GPU or the group without a bound.
        with self.lock:
            if self.closed:
                return
            self.closed = True
        peer_died = self.worker_died.is_set() or bool(self.dead_workers())
        started = [p for p in self.processes if p.pid is not None]
        self.channel.write("shutdown", ())
        if self.rank0 is not None:
            self.rank0.close()
        for wakeup in self.wakeups:
            wakeup.release()
        # Leave the group before joining: with NCCL each rank's exit from the group waits for
        # the others', so joining first would always wait out the timeout.
        if peer_died:
            self.worker_died.set()  # rank 0's runner then never waits on the GPU again
            self._release_after_death()
            join_timeout_s = min(join_timeout_s, 1.0)  # survivors may be stuck in a collective
        else:
            self._leave_group()
        for process in started:
            process.join(join_timeout_s)
        for process in started:
            if process.is_alive():
                process.kill()
                process.join(join_timeout_s)
        self.channel.close()
        self.store = None
        torch.set_num_threads(self.saved_num_threads)
        # The watchdog's target holds this executor: left to end on its own, it may drop the last
        # reference at interpreter exit, on a daemon thread, where freeing a tensor aborts
        if self.watchdog.is_alive() and self.watchdog is not threading.current_thread():
            self.watchdog.join(2 * PARENT_POLL_S)  # it ends once the workers have

    def _leave_group(self) -> None:
        """Free rank 0's runner, then leave the group; every rank is alive and does the same."""
        if self.runner is not None:
            self.runner.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()  # also breaks a worker out of a stuck gloo collective

    def _release_after_death(self) -> None:
        """Abort, free rank 0's runner and leave the group in a thread, waited for at most
        RELEASE_TIMEOUT_S: with a peer gone, each of these may wait forever."""
        def release() -> None:
            self._abort()  # on CUDA this also leaves the group: destroy would wait on the peer
            if self.runner is not None:
                self.runner.shutdown()
            if dist.is_initialized() and self.device == "cpu":
                dist.destroy_process_group()  # gloo's sockets fail as soon as a peer is gone

        thread = threading.Thread(target=release, name="nanovllm-tp-release", daemon=True)
        thread.start()
        thread.join(RELEASE_TIMEOUT_S)
        if thread.is_alive():
            logger.error("rank 0 could not free its GPU state within %.0f s of a worker's death "
                         "(a collective still waits on the dead peer); the process group stays "
                         "until this process exits", RELEASE_TIMEOUT_S)
