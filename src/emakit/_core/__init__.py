"""The parts every EMA kind is built from (facades in ``ema.py``, ``multi.py``, ...):

* :mod:`~emakit._core.tracker`: counters, decay rule, plan and runner (the update path);
* :mod:`~emakit._core.shadow`: the EMA copy of a module and its layout;
* :mod:`~emakit._core.sharding`: the EMA copy of an FSDP2 model;
* :mod:`~emakit._core.tree`: pytrees as EMA sources;
* :mod:`~emakit._core.state`: the versioned state-dict codec;
* :mod:`~emakit._core.swap`: the EMA weights in the online model, and back.

This package re-exports nothing: import from the modules.
"""
