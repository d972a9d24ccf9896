"""Looking inside runs: curves of the engine's records and probes, Grad-CAM of FedCP's two heads,
and a DLG/iDLG privacy evaluation of what clients upload.

* :mod:`.records` — ``metrics.jsonl`` and ``analysis.jsonl`` read and checked;
* :mod:`.plots` — the figures (headless matplotlib);
* :mod:`.report` — ``report.json`` / ``report.md`` of an analysis folder;
* :mod:`.runstate` — a run's method rebuilt with the states of its newest checkpoint;
* :mod:`.gradcam` — Grad-CAM with a forward hook, per FedCP head;
* :mod:`.dlg` — DLG and iDLG against FedAvg, FedPer and FedCP uploads;
* :mod:`.imaging` — PSNR, SSIM and the pairing of reconstructions with true images.

The command line is :mod:`fedcp_dist.cli.analyze` (``fedcp-analyze``, ``fedcp-dlg``).
"""
