"""The CP algorithms: the interface and registry (``registry.py``), what they report in shapes (``costs.py``),
and one module per algorithm (``ring``, ``allgather``, ``ulysses``, ``hybrid``)."""
