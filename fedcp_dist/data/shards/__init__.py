"""The partitioned-data file (this package: :mod:`.layout` the names and :class:`ShardInfo`,
:mod:`.write`, :mod:`.read`, :mod:`.describe`): one HDF5 file holding every client's train and test samples.

Format version 3, the one written (no pickled objects anywhere)::

    /                     attributes: format_version (3), kind, source, num_classes, num_clients,
                          input_shape, mean, std, partition, partition_params (JSON), seed,
                          fingerprint and, for text, vocab_size
    /train_x              every client's training samples, client 0's first: images uint8
                          (n, C, H, W), text int32 token ids (n, max_len); chunks of 256 samples,
                          gzip 4 + shuffle
    /train_y              int64 (n,)
    /train_len            text only: int32 (n,) real (non-padding) tokens per row
    /train_offsets        int64 (N + 1,): client i's training rows are [off[i], off[i + 1])
    /train_label_counts   int64 (N, num_classes): each client's training samples per class
    /test_x, /test_y, /test_len, /test_offsets, /test_label_counts: the same for the test split
    /vocab                text only: UTF-8 strings, the tokens in id order (0 = padding)

Nothing whose size grows with the number of clients N is an attribute: HDF5 keeps attributes in
the object header, whose messages hold at most 64 KiB, which is what kept versions 1 and 2 (with
the per-client counts among the attributes) from being written for more than about 800 clients
of 10 classes.  One array per split instead of a group per client also keeps the file small and
writing and loading fast at thousands of clients: each group costs four chunked datasets, each
with its own header and chunk index.

Versions 1 and 2 put one group per client (still read, and written with ``format_version=1`` or
``2`` for older readers, up to the attribute limit)::

    /                       the attributes above plus train_counts, test_counts (int64 (N,)),
                            train_label_counts, test_label_counts (int64 (N, num_classes))
    /clients/{i}/train_x    client i's rows of /train_x above; likewise train_y, test_x, test_y
                            and, for text, train_len, test_len
    /vocab                  text only

Tables (``kind`` "table", version 3 only: users' CSV files, :mod:`fedcp_dist.data.owndata`)
keep raw float32 feature rows ``(n, F)`` in ``/train_x`` and ``/test_x``, ``input_shape`` = [F],
``mean`` / ``std`` the per-feature statistics of the training rows (the engine standardises every
batch with them) and the feature names in ``/columns`` (UTF-8 strings).

Version 1 is the image layout (``kind`` "image"); version 2 adds ``kind`` "text" (``input_shape``
= [max_len], empty ``mean`` / ``std``, the ``vocab_size`` attribute, the ``*_len`` datasets and
``/vocab``).  Every version keeps ``format_version`` where version 1 had it, so a reader refuses
a version it does not know by that number, with a clear message, instead of misreading it: a
version-1 reader refuses text shards, readers of versions 1 and 2 refuse version 3.  This
reader reads all three.

``fingerprint`` (every version, as written now; shards written before it have none) is
``sha256:`` and the hex SHA-256 of what a run reads from the file: every client's arrays in
client order (each array's name, dtype, shape and bytes) and the attributes that shape
training (kind, num_classes, input_shape, mean, std, the vocabulary, the feature names). Two
shards with the same fingerprint train alike; a shard partitioned again at the same path gets
another. A run records it in its checkpoints and refuses to resume onto other data
(:mod:`fedcp_dist.rundir.checkpoint`).  :func:`layout_digest` is the cheap stand-in for a shard without
one: the attributes and per-client counts, which a re-partition almost always changes.

Files are written atomically (temporary file in the same directory, then ``os.replace``), so
a reader never sees a half-written shard and an existing file survives a failed write.  Writing
and loading go a block of :data:`WRITE_SAMPLES` rows at a time, so memory stays at the data
handed in (or loaded) plus a block or two.
"""
from __future__ import annotations

from fedcp_dist.data.shards.describe import DESCRIBE_ROWS, DESCRIBE_SMALLEST, describe_lines
from fedcp_dist.data.shards.layout import (CHUNK_SAMPLES, FINGERPRINT, FORMAT_VERSION, IMAGE_FORMAT_VERSION, KIND,
                                           KINDS, READABLE_VERSIONS, SPLITS, TABLE_KIND, TEXT_FORMAT_VERSION,
                                           TEXT_KIND, TEXT_SPLITS, WRITE_SAMPLES, Rows, ShardInfo, layout_digest)
from fedcp_dist.data.shards.read import ShardReader, load_clients, read_info, read_vocab
from fedcp_dist.data.shards.write import write_shard

__all__ = ["CHUNK_SAMPLES", "DESCRIBE_ROWS", "DESCRIBE_SMALLEST", "FINGERPRINT", "FORMAT_VERSION",
           "IMAGE_FORMAT_VERSION", "KIND", "KINDS", "READABLE_VERSIONS", "SPLITS", "TABLE_KIND",
           "TEXT_FORMAT_VERSION", "TEXT_KIND", "TEXT_SPLITS", "WRITE_SAMPLES", "Rows", "ShardInfo", "ShardReader",
           "describe_lines", "layout_digest", "load_clients", "read_info", "read_vocab", "write_shard"]
