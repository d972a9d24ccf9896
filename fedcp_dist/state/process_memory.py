"""How much memory the process and a client state take: what the rounds' records, the memory
check before the first round and the benchmarks report."""
from __future__ import annotations

import os
import resource
from typing import Dict, Optional, Tuple

import torch

State = Dict[str, torch.Tensor]


def state_bytes(state: Optional[State]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values()) if state else 0


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; elsewhere the peak, from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak resident memory (getrusage: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def anon_rss_bytes() -> int:
    """This process's resident anonymous memory (its own, not files mapped into memory: the page
    cache the kernel may drop); 0 where /proc/self/status is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def memory_record(store) -> dict:
    """The memory numbers of a round's record (rank 0's): resident memory now (all of it, and the
    anonymous part) and at its peak, and the bytes of per-client state the store holds in memory,
    each in MiB."""
    mib, rss = 2.0**20, rss_bytes()
    # the kernel updates the peak lazily: it may lag the current figure
    return {"rss_mb": rss / mib, "rss_anon_mb": anon_rss_bytes() / mib, "peak_rss_mb": max(rss, peak_rss_bytes()) / mib,
            "client_state_held_mb": store.held_bytes() / mib}


def client_state_size(algo, store, agg, compressor, client: int) -> Tuple[int, int]:
    """(bytes, tensors) a client keeps: its state, its own BatchNorm statistics and its compression
    residual (one float32 copy of the upload)."""
    state = algo.init_client_state(client) or {}
    gs = store.global_state
    bn = [gs[k] for k in store.bn_keys if k in gs]
    nbytes, tensors = state_bytes(state) + sum(t.numel() * t.element_size() for t in bn), len(state) + len(bn)
    if compressor.enabled and compressor.error_feedback:
        nbytes, tensors = nbytes + 4 * sum(s.numel() for s in agg.shapes.values()), tensors + len(agg.shapes)
    return nbytes, tensors
