"""The benchmarks: each prints ratios against a baseline measured in the same run.

``switchagg bench`` runs :mod:`.throughput` (against gloo), ``--loss`` runs :mod:`.loss` and
``--ddp`` the DDP iteration bench of :mod:`switchagg.ddp_demo`; the BMv2 ones run as modules
(``python -m switchagg.benchmarks.bmv2_vs_forwarding``, ``.bmv2_instructions``), as root.
"""
