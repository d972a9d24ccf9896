"""``fedcp-partition --describe``: a shard's attributes and its clients as text."""
from __future__ import annotations

import json

import numpy as np

from fedcp_dist.data.shards.layout import TABLE_KIND, TEXT_KIND, ShardInfo

#: clients up to which :func:`describe_lines` prints one row per client (more: a summary)
DESCRIBE_ROWS = 50
#: the smallest clients the summary shows
DESCRIBE_SMALLEST = 5


def _compact_labels(labels) -> str:
    """Render sorted ints compactly: [0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    labels = [int(v) for v in labels]
    parts, i = [], 0
    while i < len(labels):
        j = i
        while j + 1 < len(labels) and labels[j + 1] == labels[j] + 1:
            j += 1
        parts.append(str(labels[i]) if i == j else f"{labels[i]}-{labels[j]}")
        i = j + 1
    return ",".join(parts) or "-"


def describe_lines(info: ShardInfo, all_clients: bool = False) -> list[str]:
    """The text of ``fedcp-partition --describe``: the shard's attributes, then its clients.

    Up to :data:`DESCRIBE_ROWS` clients (or with ``all_clients``) one row per client: train and
    test samples and the classes present.  Beyond that, so that 10,000 clients do not print
    10,000 lines: percentiles of those figures over the clients, the number of clients without
    train or test samples, and the rows of the :data:`DESCRIBE_SMALLEST` smallest clients.  Both
    end with the total row.
    """
    lines = [f"file:             {info.path}",
             f"format_version:   {info.format_version}",
             f"source:           {info.source} ({info.kind}, input {info.input_shape}, "
             f"{info.num_classes} classes)"]
    if info.kind == TEXT_KIND:
        ids = "LEAF's Shakespeare characters, no padding" if info.partition == "leaf" else "0 = padding, 1 = unknown"
        lines.append(f"vocabulary:       {info.vocab_size} token ids ({ids})")
    elif info.kind == TABLE_KIND and info.partition == "synthetic":
        lines.append("standardised:     no (mean 0, std 1: the generated features as they are)")
    elif info.kind == TABLE_KIND:
        shown = ", ".join(f"{m:.4g}/{s:.4g}" for m, s in zip(info.mean[:4], info.std[:4]))
        more = ", ..." if len(info.mean) > 4 else ""
        lines.append(f"standardised:     per feature, train-row mean/std {shown}{more}")
    else:
        lines.append(f"mean / std:       {info.mean} / {info.std}")
    lines += [f"partition:        {info.partition} "
              f"{json.dumps(info.partition_params, sort_keys=True)}",
              f"seed:             {info.seed}",
              f"fingerprint:      {info.fingerprint or 'none (written before shards had one)'}",
              f"clients:          {info.num_clients}",
              ""]
    label_counts = info.train_label_counts + info.test_label_counts
    header = f"{'client':>7} {'train':>8} {'test':>8} {'classes':>7}  labels"

    def row(i: int) -> str:
        present = np.flatnonzero(label_counts[i])
        return (f"{i:>7} {int(info.train_counts[i]):>8} {int(info.test_counts[i]):>8} "
                f"{len(present):>7}  {_compact_labels(present)}")

    if all_clients or info.num_clients <= DESCRIBE_ROWS:
        lines += [header] + [row(i) for i in range(info.num_clients)]
    else:
        sizes = info.train_counts + info.test_counts
        quantiles = (0, 5, 25, 50, 75, 95, 100)
        names = ("min", "5%", "25%", "median", "75%", "95%", "max")
        lines.append(f"{'per client':<10}" + "".join(f"{q:>8}" for q in names) + f"{'mean':>10}")
        for name, values in (("train", info.train_counts), ("test", info.test_counts),
                             ("samples", sizes), ("classes", (label_counts > 0).sum(axis=1))):
            q = np.percentile(values, quantiles, method="lower")
            lines.append(f"{name:<10}" + "".join(f"{int(v):>8}" for v in q)
                         + f"{float(np.mean(values)):>10.2f}")
        lines += [f"clients without train samples: {int((info.train_counts == 0).sum())}, "
                  f"without test samples: {int((info.test_counts == 0).sum())}",
                  "",
                  f"the {DESCRIBE_SMALLEST} smallest of {info.num_clients} clients "
                  f"(every client: --describe FILE --all)",
                  header]
        smallest = np.argsort(sizes, kind="stable")[:DESCRIBE_SMALLEST]
        lines += [row(int(i)) for i in smallest]
    present = np.flatnonzero(label_counts.sum(axis=0))
    lines.append(f"{'total':>7} {int(info.train_counts.sum()):>8} "
                 f"{int(info.test_counts.sum()):>8} {len(present):>7}  "
                 f"{_compact_labels(present)}")
    return lines
