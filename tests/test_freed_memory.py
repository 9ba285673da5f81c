"""Freed tensors leave the process's resident memory: after glibc's malloc has raised its mmap
threshold (a large block freed), blocks of a few MiB come from its heap, and freeing every other
one of them gave nothing back; with islands.infra.memory's fixed threshold each is unmapped when
freed (the learner and every `islands` command set it at their start, and pass it to the processes
they start: a phase's torchrun job)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, os, sys
import torch
from islands.infra.memory import return_freed_memory

def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:")) * 1024

if sys.argv[1] == "set":
    assert return_freed_memory()
elif sys.argv[1] == "inherited":
    assert "glibc.malloc.mmap_threshold=1048576" in os.environ["GLIBC_TUNABLES"]
big = torch.ones(4 << 20)
del big  # a 16 MiB block freed: glibc raises its threshold past 4 MiB
held = [torch.ones(1 << 20) for _ in range(200)]  # 200 blocks of 4 MiB, every page written
before = rss()
del held[::2]  # 100 blocks freed, each between two held ones
print(json.dumps({"returned": before - rss(), "freed": 100 * (4 << 20)}))
"""


def returned(mode: str, env: dict[str, str] | None = None) -> float:
    """The share of what the child freed that left its resident memory. By default the child
    gets this process's environment without GLIBC_TUNABLES, which an islands command run in this
    process earlier leaves set for the processes it starts."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    proc = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["returned"] / out["freed"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_blocks_freed_between_held_ones_go_back_to_the_system():
    kept_by_default, with_threshold = returned("default"), returned("set")
    print(f"\nreturned of what was freed: {kept_by_default:.0%} by default, {with_threshold:.0%} with the threshold")
    assert with_threshold > 0.9
    assert kept_by_default < 0.5  # what the threshold changes: glibc's default keeps it


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_processes_started_after_it_inherit_the_threshold(monkeypatch):
    """A phase's torchrun job never calls it: what it starts from its environment must do."""
    from islands.infra.memory import return_freed_memory

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=65536")
    assert return_freed_memory()
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=1048576"
    assert returned("inherited", dict(os.environ)) > 0.9
