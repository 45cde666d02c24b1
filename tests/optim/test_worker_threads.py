"""``worker.release_idle_threads``: the calling thread's OpenMP team shrinks (libgomp ends the
surplus threads) and its thread count setting stays what it was."""
from __future__ import annotations

import os
import threading

import torch

from cpu_offload.optim.worker import release_idle_threads


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_release_idle_threads_shrinks_the_callers_team_only():
    seen: dict = {}

    def run() -> None:
        torch.set_num_threads(6)
        torch.empty(2**20).fill_(1.0)  # a team of 6: 5 threads started
        seen["team"] = _threads()
        release_idle_threads(2)
        seen["after"] = _threads()
        seen["setting"] = torch.get_num_threads()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen["setting"] == 6
    if torch.__config__.parallel_info().find("OpenMP") >= 0:
        assert seen["after"] == seen["team"] - 4
