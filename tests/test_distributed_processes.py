"""How rank 0 reads its workers' ends (fw.distributed.processes): a worker's sentinel is ready once it has
closed its files, a moment before waitpid can read its status, so the status is read by joining it."""

from __future__ import annotations

import multiprocessing.connection
import os

from fw.distributed.processes import describe_exit, reap_ended


class _Process:
    """A worker whose sentinel is ready (`ended`) while its exit status reads None until it is joined, as a
    killed process's does between closing its files and becoming a zombie."""

    def __init__(self, ended: bool):
        self.sentinel, self._write = os.pipe()
        if ended:
            os.close(self._write)
        self.ended, self.exitcode, self.joins = ended, None, 0

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        self.joins += 1
        if self.ended:
            self.exitcode = -9

    def close(self) -> None:
        os.close(self.sentinel)
        if not self.ended:
            os.close(self._write)


def test_the_workers_whose_sentinel_is_ready_are_joined_and_read_as_killed():
    procs = {1: _Process(ended=True), 2: _Process(ended=False)}
    try:
        ready = multiprocessing.connection.wait([p.sentinel for p in procs.values()], timeout=0.5)
        assert ready == [procs[1].sentinel] and procs[1].is_alive()  # ready, yet no status before the join
        reap_ended(procs, ready)
        assert not procs[1].is_alive() and describe_exit(procs[1].exitcode) == "was killed by SIGKILL"
        assert procs[2].is_alive() and procs[2].joins == 0  # a running worker is not waited for
    finally:
        for proc in procs.values():
            proc.close()
