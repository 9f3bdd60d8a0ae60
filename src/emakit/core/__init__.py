"""The parts every EMA kind is built from (facades in ``ema.py``, ``multi.py``, ...):

* :mod:`~emakit.core.tracker`: counters, decay rule, plan and runner (the update path);
* :mod:`~emakit.core.shadow`: the EMA copy of a module and its layout;
* :mod:`~emakit.core.sharding`: the EMA copy of an FSDP2 model;
* :mod:`~emakit.core.tree`: pytrees as EMA sources;
* :mod:`~emakit.core.state`: the versioned state-dict codec;
* :mod:`~emakit.core.swap`: the EMA weights in the online model, and back.

This package re-exports nothing: import from the modules.
"""
