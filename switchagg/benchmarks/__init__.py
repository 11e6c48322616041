"""The benchmarks: each prints ratios against a baseline measured in the same run.

``switchagg bench`` runs :mod:`.throughput` (against gloo), ``--loss`` runs :mod:`.loss` and
``--ddp`` and ``--fsdp`` :mod:`.training` (through the backend); the BMv2 ones run as modules
(``python -m switchagg.benchmarks.bmv2_vs_forwarding``, ``.bmv2_instructions``), as root.
"""
